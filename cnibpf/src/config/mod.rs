//! The network configuration: decoded from stdin as the reference plugins decode it (see
//! `fold`), then validated completely before anything touches the kernel. Every message names
//! the key (as a path into the JSON) and the bad value.
//!
//! (Over 700 lines with its tests, which read the decoding end to end: the key-by-key parts
//! live in `filter`, `conditions`, `version`, `input` and `fold`.)

pub mod conditions;
mod filter;
mod fold;
pub mod input;
mod log;
mod names;
mod version;

use std::{net::IpAddr, path::PathBuf};

use ipnet::IpNet;
use serde::de::DeserializeOwned;
use serde_json::Value;

pub(crate) use self::filter::{MAX_FILTER_RULES, RULE_KEYS};
pub use self::fold::{describe, names_field};
use self::log::log_conf;
pub use self::log::{LogConf, Recording};
pub use self::names::ifname_problem;
use self::names::{absolute_path, validate_network_name};
pub use self::version::{CniVersion, SUPPORTED_VERSIONS};
use self::{
    filter::parse_filter,
    fold::Folding,
    input::{AttachmentInput, CleanupInput, NetConfInput, PortMappingInput},
    version::require_version,
};
use crate::{
    code,
    model::{
        BackendChoice, Capacity, FilterRule, HostPortAccess, PortMapping, Protocol, Target,
        UnknownWord,
    },
    paths,
};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("network configuration is not valid JSON")]
    Decode(#[source] serde_json::Error),
    #[error("unsupported cniVersion {version:?}; supported: {}", SUPPORTED_VERSIONS.join(", "))]
    UnsupportedVersion { version: String },
    #[error("{verb} needs cniVersion {minimum} or later, the configuration has {version}")]
    VerbNeedsVersion {
        verb: &'static str,
        minimum: CniVersion,
        version: String,
    },
    #[error("{key}: {reason}")]
    Invalid { key: String, reason: String },
    #[error(
        "cnibpf is a chained plugin: ADD needs a prevResult from an interface plugin (e.g. bridge) before it in the conflist"
    )]
    MissingPrevResult,
    #[error("{key}: {reason}")]
    NotSupported { key: String, reason: String },
}

impl ConfigError {
    pub fn code(&self) -> u32 {
        match self {
            Self::Decode(_) => code::DECODE,
            Self::UnsupportedVersion { .. } | Self::VerbNeedsVersion { .. } => {
                code::INCOMPATIBLE_VERSION
            }
            Self::Invalid { .. } | Self::MissingPrevResult => code::INVALID_CONFIG,
            Self::NotSupported { .. } => code::NOT_SUPPORTED,
        }
    }

    pub fn invalid(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Invalid {
            key: key.into(),
            reason: reason.into(),
        }
    }

    fn not_supported(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::NotSupported {
            key: key.into(),
            reason: reason.into(),
        }
    }
}

/// The rule changes `cnibpf filter apply` reads (a JSON list of rules, each with its
/// `action`), decoded and validated as a configuration's `filter` is.
pub fn parse_rule_changes(bytes: &[u8]) -> Result<Vec<crate::model::RuleChange>, ConfigError> {
    let value: Value = serde_json::from_slice(bytes).map_err(ConfigError::Decode)?;
    filter::parse_changes(decode(value, "filter")?)
}

/// Decodes `value` into `T` the way the reference plugins would, with errors that name the
/// key path. `prefix` is the path of `value` itself ("" for the top level).
pub fn decode<T: DeserializeOwned>(value: Value, prefix: &str) -> Result<T, ConfigError> {
    serde_path_to_error::deserialize(Folding(value)).map_err(|error| {
        let path = error.path().to_string();
        let path = match (prefix.is_empty(), path.as_str()) {
            (true, ".") => "(top level)".to_owned(),
            (true, _) => path,
            (false, ".") => prefix.to_owned(),
            (false, _) if path.starts_with('[') => format!("{prefix}{path}"),
            (false, _) => format!("{prefix}.{path}"),
        };
        let message = error.into_inner().to_string();
        // serde's words for a key that names no field of a struct that denies unknown ones
        // (only filter rules do).
        if message.starts_with("unknown field") {
            return ConfigError::invalid(
                path,
                format!(
                    "unknown rule key; a rule may only have {}",
                    RULE_KEYS.join(", ")
                ),
            );
        }
        ConfigError::invalid(path, message)
    })
}

/// The cnibpf keys of the plugin entry.
#[derive(Clone, Debug, PartialEq)]
pub struct PluginConfig {
    pub backend: BackendChoice,
    pub ip_masq: bool,
    pub ip_masq_exclude: Vec<IpNet>,
    /// `hostFirewall`: what the eBPF datapath translates goes through the host's stack, so
    /// that the host's own firewall chains judge it.
    pub host_firewall: bool,
    /// `sourceCheck` (default on): what the container sends leaves only from its own
    /// addresses.
    pub source_check: bool,
    /// Sorted by ascending `index`, the evaluation order.
    pub filter: Vec<FilterRule>,
    pub filter_default: Target,
    pub uplinks: Option<Vec<String>>,
    /// `serviceInterfaces`: interfaces whose addresses are Service addresses, not the node's
    /// own (kube-proxy's IPVS mode puts every ClusterIP on `kube-ipvs0`): a wildcard hostPort
    /// never takes them.
    pub service_interfaces: Vec<String>,
    pub pin_path: PathBuf,
    pub cgroup_path: Option<PathBuf>,
    pub host_ports: HostPortAccess,
    /// `maxFlows`, `maxAttachments`, `maxHostPorts`: the eBPF datapath's map sizes.
    pub capacity: Capacity,
}

/// One entry of `cni.dev/valid-attachments` (GC).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct AttachmentRef {
    pub container_id: String,
    pub ifname: String,
}

/// A complete, validated network configuration.
#[derive(Clone, Debug)]
pub struct NetConf {
    pub cni_version: CniVersion,
    pub cni_version_text: String,
    pub name: String,
    pub prev_result: Option<Value>,
    pub plugin: PluginConfig,
    pub port_mappings: Vec<PortMapping>,
    pub valid_attachments: Option<Vec<AttachmentRef>>,
    /// The runtime asks the `bandwidth` plugin to shape the pod (`runtimeConfig.bandwidth`,
    /// when cnibpf declares that capability too).
    pub shaped: bool,
}

/// The top level decoded into `T`, with the keys every verb needs checked.
struct Header<T> {
    input: T,
    cni_version: CniVersion,
    cni_version_text: String,
    name: String,
}

impl<T: DeserializeOwned> Header<T> {
    fn parse(
        bytes: &[u8],
        identity: impl FnOnce(&mut T) -> (Option<String>, Option<String>),
    ) -> Result<Self, ConfigError> {
        let value: Value = serde_json::from_slice(bytes).map_err(ConfigError::Decode)?;
        if !value.is_object() {
            return Err(ConfigError::invalid(
                "(top level)",
                format!("expected a JSON object, got {}", describe(&value)),
            ));
        }
        let mut input: T = decode(value, "")?;
        let (cni_version, name) = identity(&mut input);
        let cni_version_text =
            cni_version.ok_or_else(|| ConfigError::invalid("cniVersion", "is required"))?;
        let name = name.ok_or_else(|| ConfigError::invalid("name", "is required"))?;
        let cni_version = CniVersion::parse(&cni_version_text)?;
        validate_network_name(&name)?;
        Ok(Self {
            input,
            cni_version,
            cni_version_text,
            name,
        })
    }
}

impl NetConf {
    pub fn parse(bytes: &[u8]) -> Result<Self, ConfigError> {
        let Header {
            mut input,
            cni_version,
            cni_version_text,
            name,
        } = Header::<NetConfInput>::parse(bytes, |input| {
            (input.cni_version.take(), input.name.take())
        })?;
        let runtime = input.runtime_config.take().unwrap_or_default();
        let port_mappings = parse_port_mappings(runtime.port_mappings.unwrap_or_default())?;
        let shaped = runtime.bandwidth.as_ref().is_some_and(requests_shaping);
        let valid_attachments = input
            .valid_attachments
            .take()
            .or_else(|| input.legacy_valid_attachments.take())
            .map(parse_valid_attachments)
            .transpose()?;
        Ok(Self {
            cni_version,
            cni_version_text,
            name,
            prev_result: input.prev_result.take().map(Value::Object),
            plugin: PluginConfig::parse(input)?,
            port_mappings,
            valid_attachments,
            shaped,
        })
    }

    /// The `cniVersion` rules of the spec for verbs newer than 0.3.
    pub fn require_version(&self, verb: &'static str) -> Result<(), ConfigError> {
        require_version(self.cni_version, &self.cni_version_text, verb)
    }
}

/// What DEL and GC read of a configuration: they remove what an attachment owns, found through
/// its stored state, so only `name` and `pinPath` matter (and the version, for the answer).
#[derive(Clone, Debug)]
pub struct CleanupConf {
    pub name: String,
    pub pin_path: PathBuf,
    /// The reference portmap `cnibpf install --replace-portmap` put cnibpf in the place of,
    /// as its DEL's configuration: for a container cnibpf holds nothing of (made while portmap
    /// was chained), the DEL is handed to it.
    pub replaced_portmap: Option<Vec<u8>>,
}

impl CleanupConf {
    pub fn parse(bytes: &[u8]) -> Result<Self, ConfigError> {
        let mut header = Header::<CleanupInput>::parse(bytes, |input| {
            (input.cni_version.take(), input.name.take())
        })?;
        log_conf(
            header.input.log_file.take(),
            header.input.log_max_size_mb,
            header.input.log_max_files,
        )?;
        let replaced_portmap =
            replaced_portmap(&header.cni_version_text, &header.name, &mut header.input);
        Ok(Self {
            name: header.name,
            pin_path: pin_path(header.input.pin_path)?,
            replaced_portmap,
        })
    }
}

/// `releaseOnly`: the entry `cnibpf uninstall` leaves in cnibpf's conflist while pods cnibpf
/// set up remain. ADD passes the previous result on and CHECK accepts (new pods are the
/// restored network's); DEL and GC release as ever, and once no attachment is left the
/// instance is removed whole, with `file` (the conflist) and `binary`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
pub struct ReleaseOnly {
    pub file: Option<PathBuf>,
    pub binary: Option<PathBuf>,
}

impl ReleaseOnly {
    /// Read from any configuration, even one a verb refuses: `None` unless it holds
    /// `releaseOnly` as an object.
    pub fn of_stdin(bytes: &[u8]) -> Option<Self> {
        let value: Value = serde_json::from_slice(bytes).ok()?;
        let object = value.get("releaseOnly")?.as_object()?;
        let path = |key: &str| object.get(key).and_then(Value::as_str).map(PathBuf::from);
        Some(Self {
            file: path("file"),
            binary: path("binary"),
        })
    }
}

/// The configuration the replaced portmap's DEL reads, built as libcni builds a chained
/// plugin's: its own keys, the network's `cniVersion` and `name`, the runtime's arguments of
/// the capabilities it declares, and the previous result. `None` when the entry replaced no
/// portmap (a record that is not a plugin object counts as none: a DEL never fails on it) or
/// the runtime passes no hostPorts.
fn replaced_portmap(cni_version: &str, name: &str, input: &mut CleanupInput) -> Option<Vec<u8>> {
    let mut record = input.cnibpf_install.take()?;
    let Value::Object(mut portmap) = record.get_mut("replacedPortmap")?.take() else {
        return None;
    };
    if portmap.get("type").and_then(Value::as_str) != Some("portmap") {
        return None;
    }
    portmap.insert("cniVersion".to_owned(), Value::from(cni_version));
    portmap.insert("name".to_owned(), Value::from(name));
    let declared: Vec<String> = portmap
        .get("capabilities")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .filter(|(_, enabled)| **enabled == Value::Bool(true))
        .map(|(capability, _)| capability.clone())
        .collect();
    let runtime: serde_json::Map<String, Value> = input
        .runtime_config
        .take()
        .and_then(|runtime| match runtime {
            Value::Object(runtime) => Some(runtime),
            _ => None,
        })
        .into_iter()
        .flatten()
        .filter(|(capability, _)| declared.contains(capability))
        .collect();
    // Without hostPorts portmap's DEL does nothing: it is not run.
    let has_host_ports = runtime
        .get("portMappings")
        .and_then(Value::as_array)
        .is_some_and(|mappings| !mappings.is_empty());
    if !has_host_ports {
        return None;
    }
    portmap.insert("runtimeConfig".to_owned(), Value::Object(runtime));
    if let Some(prev_result) = input.prev_result.take() {
        portmap.insert("prevResult".to_owned(), prev_result);
    }
    serde_json::to_vec(&Value::Object(portmap)).ok()
}

impl PluginConfig {
    fn parse(mut input: NetConfInput) -> Result<Self, ConfigError> {
        // Validated with the rest; `Recording` reads them for every call.
        log_conf(
            input.log_file.take(),
            input.log_max_size_mb,
            input.log_max_files,
        )?;
        let backend = match input.backend.as_deref() {
            None => BackendChoice::Auto,
            // The reference portmap's own backend key, carried over with the conflist.
            Some("iptables") => {
                return Err(ConfigError::not_supported(
                    "backend",
                    "cnibpf has no iptables backend: use \"auto\" (eBPF, else nftables), \"ebpf\" or \"nftables\"",
                ));
            }
            Some(text) => parse_word("backend", text)?,
        };
        let host_ports = host_port_access(&input)?;
        let capacity =
            Capacity::parse(input.max_flows, input.max_attachments, input.max_host_ports)
                .map_err(|(dimension, reason)| ConfigError::invalid(dimension.key(), reason))?;
        let uplinks = match input.uplinks {
            None => None,
            Some(names) if names.is_empty() => {
                return Err(ConfigError::invalid(
                    "uplinks",
                    "must name at least one interface (leave the key out to use the default-route devices)",
                ));
            }
            Some(names) => Some(interface_names("uplinks", names)?),
        };
        let service_interfaces = match input.service_interfaces {
            None => DEFAULT_SERVICE_INTERFACES
                .iter()
                .map(|name| (*name).to_owned())
                .collect(),
            Some(names) => interface_names("serviceInterfaces", names)?,
        };
        Ok(Self {
            backend,
            ip_masq: input.ip_masq.unwrap_or(false),
            ip_masq_exclude: input
                .ip_masq_exclude
                .unwrap_or_default()
                .into_iter()
                .map(|cidr| cidr.0)
                .collect(),
            host_firewall: input.host_firewall.unwrap_or(false),
            source_check: input.source_check.unwrap_or(true),
            filter: parse_filter(input.filter.unwrap_or_default())?,
            filter_default: match input.filter_default {
                None => Target::Allow,
                Some(text) => match parse_word("filterDefault", &text)? {
                    Target::Reject => {
                        return Err(ConfigError::invalid(
                            "filterDefault",
                            "is \"ALLOW\" or \"DROP\": REJECT answers what a rule names, a default would answer every packet nothing else allows",
                        ));
                    }
                    target => target,
                },
            },
            uplinks,
            service_interfaces,
            pin_path: pin_path(input.pin_path)?,
            cgroup_path: input
                .cgroup_path
                .map(|path| absolute_path("cgroupPath", &path))
                .transpose()?,
            host_ports,
            capacity,
        })
    }
}

/// `serviceInterfaces` when the entry does not say: kube-proxy's IPVS mode binds every
/// ClusterIP and load-balancer address to this interface (left down), which makes them local
/// addresses of the node.
pub const DEFAULT_SERVICE_INTERFACES: [&str; 1] = ["kube-ipvs0"];

/// A list of interface names under `key`, each a valid name.
fn interface_names(key: &str, names: Vec<String>) -> Result<Vec<String>, ConfigError> {
    for (position, name) in names.iter().enumerate() {
        if let Some(problem) = ifname_problem(name) {
            return Err(ConfigError::invalid(
                format!("{key}[{position}]"),
                format!("interface name {name:?} {problem}"),
            ));
        }
    }
    Ok(names)
}

/// The reference portmap's keys: honoured where cnibpf can honour them, refused (101) where
/// it cannot, never ignored where they narrow who reaches a hostPort.
fn host_port_access(input: &NetConfInput) -> Result<HostPortAccess, ConfigError> {
    if let Some(bit) = input.mark_masq_bit
        && !(0..=31).contains(&bit)
    {
        return Err(ConfigError::invalid(
            "markMasqBit",
            format!("must be between 0 and 31, got {bit}"),
        ));
    }
    if input.mark_masq_bit.is_some() && input.external_set_mark_chain.is_some() {
        return Err(ConfigError::invalid(
            "externalSetMarkChain",
            "cannot be used with markMasqBit (as in the reference portmap)",
        ));
    }
    if input.masq_all == Some(true) {
        return Err(ConfigError::not_supported(
            "masqAll",
            "cnibpf keeps the client's address on translated connections; masqAll is for macvlan/ipvlan containers, which cnibpf does not serve",
        ));
    }
    if let Some(backend) = &input.ip_masq_backend {
        return Err(ConfigError::not_supported(
            "ipMasqBackend",
            format!(
                "cnibpf masquerades itself (ipMasq) with the datapath its own \"backend\" key picks; {backend:?} is not read"
            ),
        ));
    }
    Ok(HostPortAccess {
        conditions_v4: conditions::parse(
            "conditionsV4",
            input.conditions_v4.as_deref().unwrap_or_default(),
            true,
        )?,
        conditions_v6: conditions::parse(
            "conditionsV6",
            input.conditions_v6.as_deref().unwrap_or_default(),
            false,
        )?,
        no_hairpin_snat: input.snat == Some(false),
    })
}

/// Whether a `runtimeConfig.bandwidth` value asks for any shaping.
fn requests_shaping(bandwidth: &Value) -> bool {
    let Some(object) = bandwidth.as_object() else {
        return false;
    };
    object.iter().any(|(key, value)| {
        (names_field(key, "ingressRate") || names_field(key, "egressRate"))
            && value.as_u64().is_some_and(|rate| rate > 0)
    })
}

fn pin_path(configured: Option<String>) -> Result<PathBuf, ConfigError> {
    match configured {
        None => Ok(PathBuf::from(paths::DEFAULT_PIN_PATH)),
        Some(path) => absolute_path("pinPath", &path),
    }
}

/// A vocabulary word at `key`, with the message naming what was expected.
fn parse_word<T: std::str::FromStr<Err = UnknownWord>>(
    key: &str,
    text: &str,
) -> Result<T, ConfigError> {
    text.parse().map_err(|error: UnknownWord| {
        ConfigError::invalid(key, format!("expected {}, got {text:?}", error.expected))
    })
}

fn parse_port_mappings(entries: Vec<PortMappingInput>) -> Result<Vec<PortMapping>, ConfigError> {
    let mut mappings: Vec<PortMapping> = Vec::with_capacity(entries.len());
    for (position, entry) in entries.into_iter().enumerate() {
        let prefix = format!("runtimeConfig.portMappings[{position}]");
        let required = |port: Option<input::Port>, key: &str| {
            port.map(|port| port.0)
                .ok_or_else(|| ConfigError::invalid(format!("{prefix}.{key}"), "is required"))
        };
        let host_port = required(entry.host_port, "hostPort")?;
        let container_port = required(entry.container_port, "containerPort")?;
        let protocol = match entry.protocol.as_deref() {
            None => Protocol::Tcp,
            Some(text) => parse_word(&format!("{prefix}.protocol"), text)?,
        };
        let host_ip = match entry.host_ip.as_deref() {
            None | Some("") => None,
            Some(text) => match text.parse::<IpAddr>() {
                Ok(addr) if addr.is_unspecified() => None,
                Ok(addr) => Some(addr),
                Err(_) => {
                    return Err(ConfigError::invalid(
                        format!("{prefix}.hostIP"),
                        format!("expected an IPv4 or IPv6 address, got {text:?}"),
                    ));
                }
            },
        };
        let mapping = PortMapping {
            host_port,
            container_port,
            protocol,
            host_ip,
        };
        if let Some(earlier) = mappings.iter().position(|other| other.overlaps(&mapping)) {
            return Err(ConfigError::invalid(
                prefix,
                format!(
                    "{protocol}/{} hostPort {host_port} overlaps runtimeConfig.portMappings[{earlier}]",
                    host_ip.map_or_else(|| "*".to_owned(), |ip| ip.to_string()),
                ),
            ));
        }
        mappings.push(mapping);
    }
    Ok(mappings)
}

fn parse_valid_attachments(
    entries: Vec<AttachmentInput>,
) -> Result<Vec<AttachmentRef>, ConfigError> {
    entries
        .into_iter()
        .enumerate()
        .map(|(position, entry)| {
            let required = |field: Option<String>, key: &str| {
                field.ok_or_else(|| {
                    ConfigError::invalid(
                        format!("cni.dev/valid-attachments[{position}].{key}"),
                        "is required",
                    )
                })
            };
            Ok(AttachmentRef {
                container_id: required(entry.container_id, "containerID")?,
                ifname: required(entry.ifname, "ifname")?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests;
