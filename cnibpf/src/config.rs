//! The network configuration: parsed from stdin and validated completely before anything
//! touches the kernel. Every message names the key (as a path into the JSON) and the bad value.

use std::{collections::BTreeMap, fmt, net::IpAddr, path::PathBuf};

use ipnet::IpNet;
use serde_json::{Map, Value};

use crate::{error::code, paths};

/// Spec versions this plugin speaks, oldest first.
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
/// Most rules one attachment may carry (the datapath evaluates them in a bounded loop).
pub const MAX_FILTER_RULES: usize = cnibpf_common::filter::MAX_RULES;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("network configuration is not valid JSON")]
    Decode(#[source] serde_json::Error),
    #[error("unsupported cniVersion {version:?}; supported: {}", SUPPORTED_VERSIONS.join(", "))]
    UnsupportedVersion { version: String },
    #[error("{verb} needs cniVersion {minimum} or later, the configuration has {version}")]
    VerbNeedsVersion {
        verb: &'static str,
        minimum: &'static str,
        version: String,
    },
    #[error("{key}: {reason}")]
    Invalid { key: String, reason: String },
    #[error(
        "cnibpf is a chained plugin: ADD needs a prevResult from an interface plugin (e.g. bridge) before it in the conflist"
    )]
    MissingPrevResult,
    #[error("{feature} is not supported yet by this version of cnibpf")]
    NotSupportedYet { feature: String },
}

impl ConfigError {
    pub fn code(&self) -> u32 {
        match self {
            Self::Decode(_) => code::DECODE,
            Self::UnsupportedVersion { .. } | Self::VerbNeedsVersion { .. } => {
                code::INCOMPATIBLE_VERSION
            }
            Self::Invalid { .. } | Self::MissingPrevResult => code::INVALID_CONFIG,
            Self::NotSupportedYet { .. } => code::NOT_SUPPORTED_YET,
        }
    }

    fn invalid(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Invalid {
            key: key.into(),
            reason: reason.into(),
        }
    }
}

/// A spec version, ordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct CniVersion(u8, u8, u8);

impl CniVersion {
    pub const V0_4_0: Self = Self(0, 4, 0);
    pub const V1_0_0: Self = Self(1, 0, 0);
    pub const V1_1_0: Self = Self(1, 1, 0);

    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        if !SUPPORTED_VERSIONS.contains(&text) {
            return Err(ConfigError::UnsupportedVersion {
                version: text.to_owned(),
            });
        }
        let mut parts = text.split('.').map(|part| part.parse::<u8>().unwrap_or(0));
        Ok(Self(
            parts.next().unwrap_or(0),
            parts.next().unwrap_or(0),
            parts.next().unwrap_or(0),
        ))
    }
}

impl fmt::Display for CniVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    Auto,
    Ebpf,
    Nftables,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    pub fn number(self) -> u8 {
        match self {
            Self::Tcp => cnibpf_common::PROTO_TCP,
            Self::Udp => cnibpf_common::PROTO_UDP,
            Self::Sctp => cnibpf_common::PROTO_SCTP,
        }
    }

    pub fn from_number(number: u8) -> Option<Self> {
        [Self::Tcp, Self::Udp, Self::Sctp]
            .into_iter()
            .find(|protocol| protocol.number() == number)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
            Self::Sctp => "sctp",
        }
    }
}

/// One entry of `runtimeConfig.portMappings`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortMapping {
    pub host_port: u16,
    pub container_port: u16,
    pub protocol: Protocol,
    /// `None` for any address of the host (absent, empty, `0.0.0.0` or `::`).
    pub host_ip: Option<IpAddr>,
}

impl PortMapping {
    /// Whether two mappings could both claim one packet: same protocol and port, and host
    /// addresses that are equal or where either is a wildcard.
    pub fn overlaps(&self, other: &Self) -> bool {
        self.protocol == other.protocol
            && self.host_port == other.host_port
            && match (self.host_ip, other.host_ip) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Allow,
    Drop,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuleProtocol {
    Any,
    Tcp,
    Udp,
    Sctp,
    Icmp,
    Icmpv6,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnState {
    New,
    Established,
    Any,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Ingress,
    Egress,
    Both,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortRange {
    pub low: u16,
    pub high: u16,
}

/// One validated `filter` rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FilterRule {
    pub index: u32,
    pub target: Target,
    pub src: Option<IpNet>,
    pub dst: Option<IpNet>,
    pub protocol: RuleProtocol,
    pub sport: Option<PortRange>,
    pub dport: Option<PortRange>,
    pub connstate: ConnState,
    pub direction: Direction,
}

/// The cnibpf keys of the plugin entry.
#[derive(Clone, Debug, PartialEq)]
pub struct PluginConfig {
    pub backend: BackendChoice,
    pub ip_masq: bool,
    pub ip_masq_exclude: Vec<IpNet>,
    /// Sorted by ascending `index`, the evaluation order.
    pub filter: Vec<FilterRule>,
    pub filter_default: Target,
    pub uplinks: Option<Vec<String>>,
    pub pin_path: PathBuf,
    pub cgroup_path: Option<PathBuf>,
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
}

impl NetConf {
    pub fn parse(bytes: &[u8]) -> Result<Self, ConfigError> {
        let value: Value = serde_json::from_slice(bytes).map_err(ConfigError::Decode)?;
        let Value::Object(top) = value else {
            return Err(ConfigError::invalid(
                "(top level)",
                format!("expected a JSON object, got {}", describe(&value)),
            ));
        };
        let cni_version_text = required_string(&top, "", "cniVersion")?;
        let cni_version = CniVersion::parse(&cni_version_text)?;
        let name = required_string(&top, "", "name")?;
        validate_network_name(&name)?;
        let prev_result = match top.get("prevResult") {
            None | Some(Value::Null) => None,
            Some(Value::Object(result)) => Some(Value::Object(result.clone())),
            Some(other) => {
                return Err(ConfigError::invalid(
                    "prevResult",
                    format!("expected an object, got {}", describe(other)),
                ));
            }
        };
        let runtime_config = optional_object(&top, "", "runtimeConfig")?;
        let port_mappings = match runtime_config.and_then(|rc| rc.get("portMappings")) {
            None | Some(Value::Null) => Vec::new(),
            Some(value) => parse_port_mappings(value)?,
        };
        // libcni also sends the list as `cni.dev/attachments`, the name of an earlier draft.
        let valid_attachments = match top
            .get(VALID_ATTACHMENTS)
            .or_else(|| top.get(LEGACY_VALID_ATTACHMENTS))
        {
            None | Some(Value::Null) => None,
            Some(value) => Some(parse_valid_attachments(value)?),
        };
        if let Some(capabilities) = top.get("capabilities") {
            parse_capabilities(capabilities)?;
        }
        Ok(Self {
            cni_version,
            cni_version_text,
            name,
            prev_result,
            plugin: PluginConfig::parse(&top)?,
            port_mappings,
            valid_attachments,
        })
    }

    /// Refuses configuration that validates but asks for datapath this version cannot
    /// provide yet: failing loudly beats pretending a container is masqueraded or filtered.
    pub fn reject_unimplemented(&self) -> Result<(), ConfigError> {
        let not_yet = |feature: &str| {
            Err(ConfigError::NotSupportedYet {
                feature: feature.to_owned(),
            })
        };
        for (position, mapping) in self.port_mappings.iter().enumerate() {
            // SCTP's CRC32c covers the ports but not the addresses: translating the address
            // alone keeps it valid, changing a port would mean recomputing it per packet.
            if mapping.protocol == Protocol::Sctp && mapping.host_port != mapping.container_port {
                return not_yet(&format!(
                    "runtimeConfig.portMappings[{position}]: sctp with hostPort {} != containerPort {}",
                    mapping.host_port, mapping.container_port
                ));
            }
        }
        Ok(())
    }

    /// The `cniVersion` rules of the spec for verbs newer than 0.3.
    pub fn require_version(&self, verb: &'static str) -> Result<(), ConfigError> {
        let minimum = match verb {
            "CHECK" => CniVersion::V0_4_0,
            "GC" | "STATUS" => CniVersion::V1_1_0,
            _ => return Ok(()),
        };
        if self.cni_version < minimum {
            return Err(ConfigError::VerbNeedsVersion {
                verb,
                minimum: if minimum == CniVersion::V0_4_0 {
                    "0.4.0"
                } else {
                    "1.1.0"
                },
                version: self.cni_version_text.clone(),
            });
        }
        Ok(())
    }
}

impl PluginConfig {
    fn parse(top: &Map<String, Value>) -> Result<Self, ConfigError> {
        let backend = match optional_string(top, "", "backend")?.as_deref() {
            None | Some("auto") => BackendChoice::Auto,
            Some("ebpf") => BackendChoice::Ebpf,
            Some("nftables") => BackendChoice::Nftables,
            Some(other) => {
                return Err(ConfigError::invalid(
                    "backend",
                    format!("expected \"auto\", \"ebpf\" or \"nftables\", got {other:?}"),
                ));
            }
        };
        let ip_masq = match top.get("ipMasq") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(flag)) => *flag,
            Some(other) => {
                return Err(ConfigError::invalid(
                    "ipMasq",
                    format!("expected true or false, got {}", describe(other)),
                ));
            }
        };
        let ip_masq_exclude = optional_array(top, "", "ipMasqExclude")?
            .iter()
            .enumerate()
            .map(|(position, value)| parse_cidr(&format!("ipMasqExclude[{position}]"), value))
            .collect::<Result<Vec<_>, _>>()?;
        let filter = parse_filter(optional_array(top, "", "filter")?)?;
        let filter_default = match optional_string(top, "", "filterDefault")? {
            None => Target::Allow,
            Some(text) => parse_target("filterDefault", &text)?,
        };
        let uplinks = match top.get("uplinks") {
            None | Some(Value::Null) => None,
            Some(_) => {
                let names = optional_array(top, "", "uplinks")?
                    .iter()
                    .enumerate()
                    .map(|(position, value)| {
                        let key = format!("uplinks[{position}]");
                        let name = expect_string(&key, value)?;
                        validate_ifname(&key, &name)?;
                        Ok(name)
                    })
                    .collect::<Result<Vec<_>, ConfigError>>()?;
                if names.is_empty() {
                    return Err(ConfigError::invalid(
                        "uplinks",
                        "must name at least one interface (leave the key out to use the default-route devices)",
                    ));
                }
                Some(names)
            }
        };
        let pin_path = match optional_string(top, "", "pinPath")? {
            None => PathBuf::from(paths::DEFAULT_PIN_PATH),
            Some(path) => absolute_path("pinPath", &path)?,
        };
        let cgroup_path = optional_string(top, "", "cgroupPath")?
            .map(|path| absolute_path("cgroupPath", &path))
            .transpose()?;
        Ok(Self {
            backend,
            ip_masq,
            ip_masq_exclude,
            filter,
            filter_default,
            uplinks,
            pin_path,
            cgroup_path,
        })
    }
}

fn parse_capabilities(value: &Value) -> Result<(), ConfigError> {
    let Value::Object(capabilities) = value else {
        return Err(ConfigError::invalid(
            "capabilities",
            format!("expected an object, got {}", describe(value)),
        ));
    };
    for (name, enabled) in capabilities {
        if !enabled.is_boolean() {
            return Err(ConfigError::invalid(
                format!("capabilities.{name}"),
                format!("expected true or false, got {}", describe(enabled)),
            ));
        }
    }
    Ok(())
}

fn parse_port_mappings(value: &Value) -> Result<Vec<PortMapping>, ConfigError> {
    let Value::Array(entries) = value else {
        return Err(ConfigError::invalid(
            "runtimeConfig.portMappings",
            format!("expected an array, got {}", describe(value)),
        ));
    };
    let mut mappings: Vec<PortMapping> = Vec::with_capacity(entries.len());
    for (position, entry) in entries.iter().enumerate() {
        let prefix = format!("runtimeConfig.portMappings[{position}]");
        let Value::Object(entry) = entry else {
            return Err(ConfigError::invalid(
                prefix,
                format!("expected an object, got {}", describe(entry)),
            ));
        };
        let host_port = required_port(entry, &prefix, "hostPort")?;
        let container_port = required_port(entry, &prefix, "containerPort")?;
        let protocol = match optional_string(entry, &prefix, "protocol")? {
            None => Protocol::Tcp,
            Some(text) => match text.to_ascii_lowercase().as_str() {
                "tcp" => Protocol::Tcp,
                "udp" => Protocol::Udp,
                "sctp" => Protocol::Sctp,
                _ => {
                    return Err(ConfigError::invalid(
                        format!("{prefix}.protocol"),
                        format!("expected \"tcp\", \"udp\" or \"sctp\", got {text:?}"),
                    ));
                }
            },
        };
        let host_ip = match optional_string(entry, &prefix, "hostIP")?.as_deref() {
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
                    "{}/{} hostPort {} overlaps runtimeConfig.portMappings[{earlier}]",
                    protocol.name(),
                    host_ip.map_or_else(|| "*".to_owned(), |ip| ip.to_string()),
                    host_port,
                ),
            ));
        }
        mappings.push(mapping);
    }
    Ok(mappings)
}

const VALID_ATTACHMENTS: &str = "cni.dev/valid-attachments";
const LEGACY_VALID_ATTACHMENTS: &str = "cni.dev/attachments";

fn parse_valid_attachments(value: &Value) -> Result<Vec<AttachmentRef>, ConfigError> {
    let key = VALID_ATTACHMENTS;
    let Value::Array(entries) = value else {
        return Err(ConfigError::invalid(
            key,
            format!("expected an array, got {}", describe(value)),
        ));
    };
    entries
        .iter()
        .enumerate()
        .map(|(position, entry)| {
            let prefix = format!("{key}[{position}]");
            let Value::Object(entry) = entry else {
                return Err(ConfigError::invalid(
                    prefix,
                    format!("expected an object, got {}", describe(entry)),
                ));
            };
            Ok(AttachmentRef {
                container_id: required_string(entry, &prefix, "containerID")?,
                ifname: required_string(entry, &prefix, "ifname")?,
            })
        })
        .collect()
}

const RULE_KEYS: &[&str] = &[
    "index",
    "target",
    "src",
    "dst",
    "proto",
    "sport",
    "dport",
    "connstate",
    "direction",
];

fn parse_filter(entries: &[Value]) -> Result<Vec<FilterRule>, ConfigError> {
    if entries.len() > MAX_FILTER_RULES {
        return Err(ConfigError::invalid(
            "filter",
            format!(
                "{} rules, at most {MAX_FILTER_RULES} are allowed per attachment",
                entries.len()
            ),
        ));
    }
    let mut by_index: BTreeMap<u32, (usize, FilterRule)> = BTreeMap::new();
    for (position, entry) in entries.iter().enumerate() {
        let rule = parse_rule(position, entry)?;
        if let Some((earlier, _)) = by_index.get(&rule.index) {
            return Err(ConfigError::invalid(
                format!("filter[{position}].index"),
                format!("index {} is already used by filter[{earlier}]", rule.index),
            ));
        }
        by_index.insert(rule.index, (position, rule));
    }
    Ok(by_index.into_values().map(|(_, rule)| rule).collect())
}

fn parse_rule(position: usize, entry: &Value) -> Result<FilterRule, ConfigError> {
    let prefix = format!("filter[{position}]");
    let Value::Object(rule) = entry else {
        return Err(ConfigError::invalid(
            prefix,
            format!("expected an object, got {}", describe(entry)),
        ));
    };
    if let Some(unknown) = rule.keys().find(|key| !RULE_KEYS.contains(&key.as_str())) {
        return Err(ConfigError::invalid(
            format!("{prefix}.{unknown}"),
            format!(
                "unknown rule key; a rule may only have {}",
                RULE_KEYS.join(", ")
            ),
        ));
    }
    let index = match rule.get("index") {
        None | Some(Value::Null) => {
            return Err(ConfigError::invalid(
                format!("{prefix}.index"),
                "is required",
            ));
        }
        Some(value) => value
            .as_u64()
            .and_then(|index| u32::try_from(index).ok())
            .ok_or_else(|| {
                ConfigError::invalid(
                    format!("{prefix}.index"),
                    format!(
                        "expected an integer from 0 to {}, got {}",
                        u32::MAX,
                        describe(value)
                    ),
                )
            })?,
    };
    let target = match rule.get("target") {
        None | Some(Value::Null) => {
            return Err(ConfigError::invalid(
                format!("{prefix}.target"),
                "is required",
            ));
        }
        Some(value) => parse_target(
            &format!("{prefix}.target"),
            &expect_string(&format!("{prefix}.target"), value)?,
        )?,
    };
    let src = rule
        .get("src")
        .map(|value| parse_cidr(&format!("{prefix}.src"), value))
        .transpose()?;
    let dst = rule
        .get("dst")
        .map(|value| parse_cidr(&format!("{prefix}.dst"), value))
        .transpose()?;
    if let (Some(src), Some(dst)) = (src, dst)
        && matches!(src, IpNet::V4(_)) != matches!(dst, IpNet::V4(_))
    {
        return Err(ConfigError::invalid(
            format!("{prefix}.dst"),
            format!(
                "{dst} and src {src} are of different address families: the rule could never match"
            ),
        ));
    }
    let protocol = match optional_string(rule, &prefix, "proto")? {
        None => RuleProtocol::Any,
        Some(text) => match text.to_ascii_lowercase().as_str() {
            "any" => RuleProtocol::Any,
            "tcp" => RuleProtocol::Tcp,
            "udp" => RuleProtocol::Udp,
            "sctp" => RuleProtocol::Sctp,
            "icmp" => RuleProtocol::Icmp,
            "icmpv6" => RuleProtocol::Icmpv6,
            _ => {
                return Err(ConfigError::invalid(
                    format!("{prefix}.proto"),
                    format!("expected tcp, udp, sctp, icmp, icmpv6 or any, got {text:?}"),
                ));
            }
        },
    };
    let family_conflict = match protocol {
        RuleProtocol::Icmp => [src, dst]
            .into_iter()
            .flatten()
            .find(|net| matches!(net, IpNet::V6(_))),
        RuleProtocol::Icmpv6 => [src, dst]
            .into_iter()
            .flatten()
            .find(|net| matches!(net, IpNet::V4(_))),
        _ => None,
    };
    if let Some(net) = family_conflict {
        return Err(ConfigError::invalid(
            format!("{prefix}.proto"),
            format!(
                "{text} cannot match address {net}",
                text = if protocol == RuleProtocol::Icmp {
                    "icmp"
                } else {
                    "icmpv6"
                }
            ),
        ));
    }
    let sport = rule
        .get("sport")
        .map(|value| parse_port_range(&format!("{prefix}.sport"), value))
        .transpose()?;
    let dport = rule
        .get("dport")
        .map(|value| parse_port_range(&format!("{prefix}.dport"), value))
        .transpose()?;
    let has_ports = matches!(
        protocol,
        RuleProtocol::Tcp | RuleProtocol::Udp | RuleProtocol::Sctp
    );
    for (key, range) in [("sport", sport), ("dport", dport)] {
        if range.is_some() && !has_ports {
            return Err(ConfigError::invalid(
                format!("{prefix}.{key}"),
                "ports need proto tcp, udp or sctp",
            ));
        }
    }
    let connstate = match optional_string(rule, &prefix, "connstate")? {
        None => ConnState::Any,
        Some(text) => match text.to_ascii_lowercase().as_str() {
            "new" => ConnState::New,
            "established" => ConnState::Established,
            "any" => ConnState::Any,
            _ => {
                return Err(ConfigError::invalid(
                    format!("{prefix}.connstate"),
                    format!("expected new, established or any, got {text:?}"),
                ));
            }
        },
    };
    let direction = match optional_string(rule, &prefix, "direction")? {
        None => Direction::Both,
        Some(text) => match text.to_ascii_lowercase().as_str() {
            "ingress" => Direction::Ingress,
            "egress" => Direction::Egress,
            "both" => Direction::Both,
            _ => {
                return Err(ConfigError::invalid(
                    format!("{prefix}.direction"),
                    format!("expected ingress, egress or both, got {text:?}"),
                ));
            }
        },
    };
    Ok(FilterRule {
        index,
        target,
        src,
        dst,
        protocol,
        sport,
        dport,
        connstate,
        direction,
    })
}

fn parse_target(key: &str, text: &str) -> Result<Target, ConfigError> {
    match text.to_ascii_uppercase().as_str() {
        "ALLOW" => Ok(Target::Allow),
        "DROP" => Ok(Target::Drop),
        _ => Err(ConfigError::invalid(
            key,
            format!("expected \"ALLOW\" or \"DROP\", got {text:?}"),
        )),
    }
}

fn parse_port_range(key: &str, value: &Value) -> Result<PortRange, ConfigError> {
    let bad = || {
        ConfigError::invalid(
            key,
            format!(
                "expected a port 1-65535 or a range \"low-high\", got {}",
                describe(value)
            ),
        )
    };
    let port = |text: &str| text.trim().parse::<u16>().ok().filter(|port| *port != 0);
    let range = match value {
        Value::Number(number) => {
            let port = number
                .as_u64()
                .and_then(|port| u16::try_from(port).ok())
                .filter(|port| *port != 0)
                .ok_or_else(bad)?;
            PortRange {
                low: port,
                high: port,
            }
        }
        Value::String(text) => match text.split_once('-') {
            None => {
                let single = port(text).ok_or_else(bad)?;
                PortRange {
                    low: single,
                    high: single,
                }
            }
            Some((low, high)) => PortRange {
                low: port(low).ok_or_else(bad)?,
                high: port(high).ok_or_else(bad)?,
            },
        },
        _ => return Err(bad()),
    };
    if range.low > range.high {
        return Err(ConfigError::invalid(
            key,
            format!(
                "range {}-{} is empty: the low port is above the high port",
                range.low, range.high
            ),
        ));
    }
    Ok(range)
}

fn parse_cidr(key: &str, value: &Value) -> Result<IpNet, ConfigError> {
    let text = expect_string(key, value)?;
    if let Ok(net) = text.parse::<IpNet>() {
        return Ok(net.trunc());
    }
    match text.parse::<IpAddr>() {
        Ok(addr) => Ok(IpNet::from(addr)),
        Err(_) => Err(ConfigError::invalid(
            key,
            format!("expected a CIDR such as 10.0.0.0/8 or an address, got {text:?}"),
        )),
    }
}

fn required_port(entry: &Map<String, Value>, prefix: &str, key: &str) -> Result<u16, ConfigError> {
    let path = format!("{prefix}.{key}");
    match entry.get(key) {
        None | Some(Value::Null) => Err(ConfigError::invalid(path, "is required")),
        Some(value) => value
            .as_u64()
            .and_then(|port| u16::try_from(port).ok())
            .filter(|port| *port != 0)
            .ok_or_else(|| {
                ConfigError::invalid(
                    path,
                    format!("expected a port 1-65535, got {}", describe(value)),
                )
            }),
    }
}

fn validate_network_name(name: &str) -> Result<(), ConfigError> {
    let valid = name.len() < cnibpf_common::owner::NAME_LEN
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
    if valid {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            "name",
            format!(
                "{name:?} is not a valid network name (letters, digits, '_', '.', '-', starting with a letter or digit, under {} bytes)",
                cnibpf_common::owner::NAME_LEN
            ),
        ))
    }
}

/// Interface name rules of the kernel (`dev_valid_name`).
pub fn ifname_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("is empty")
    } else if name.len() >= cnibpf_common::owner::IFNAME_LEN {
        Some("is longer than 15 bytes")
    } else if name == "." || name == ".." {
        Some("is not a valid interface name")
    } else if name
        .chars()
        .any(|c| c == '/' || c == ':' || c.is_whitespace())
    {
        Some("contains '/', ':' or whitespace")
    } else {
        None
    }
}

fn validate_ifname(key: &str, name: &str) -> Result<(), ConfigError> {
    match ifname_problem(name) {
        Some(problem) => Err(ConfigError::invalid(
            key,
            format!("interface name {name:?} {problem}"),
        )),
        None => Ok(()),
    }
}

fn absolute_path(key: &str, text: &str) -> Result<PathBuf, ConfigError> {
    let path = PathBuf::from(text);
    if !path.is_absolute()
        || path
            .components()
            .any(|c| c == std::path::Component::ParentDir)
    {
        return Err(ConfigError::invalid(
            key,
            format!("expected an absolute path without '..', got {text:?}"),
        ));
    }
    Ok(path)
}

fn key_path(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_owned()
    } else {
        format!("{prefix}.{key}")
    }
}

fn required_string(
    map: &Map<String, Value>,
    prefix: &str,
    key: &str,
) -> Result<String, ConfigError> {
    optional_string(map, prefix, key)?
        .ok_or_else(|| ConfigError::invalid(key_path(prefix, key), "is required"))
}

fn optional_string(
    map: &Map<String, Value>,
    prefix: &str,
    key: &str,
) -> Result<Option<String>, ConfigError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => expect_string(&key_path(prefix, key), value).map(Some),
    }
}

fn expect_string(key: &str, value: &Value) -> Result<String, ConfigError> {
    match value {
        Value::String(text) => Ok(text.clone()),
        other => Err(ConfigError::invalid(
            key,
            format!("expected a string, got {}", describe(other)),
        )),
    }
}

fn optional_object<'a>(
    map: &'a Map<String, Value>,
    prefix: &str,
    key: &str,
) -> Result<Option<&'a Map<String, Value>>, ConfigError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(object)) => Ok(Some(object)),
        Some(other) => Err(ConfigError::invalid(
            key_path(prefix, key),
            format!("expected an object, got {}", describe(other)),
        )),
    }
}

fn optional_array<'a>(
    map: &'a Map<String, Value>,
    prefix: &str,
    key: &str,
) -> Result<&'a [Value], ConfigError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(array)) => Ok(array),
        Some(other) => Err(ConfigError::invalid(
            key_path(prefix, key),
            format!("expected an array, got {}", describe(other)),
        )),
    }
}

/// A short description of a JSON value for error messages: its type and, for scalars, itself.
fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".to_owned(),
        Value::Bool(flag) => format!("boolean {flag}"),
        Value::Number(number) => format!("number {number}"),
        Value::String(text) => format!("string {text:?}"),
        Value::Array(_) => "an array".to_owned(),
        Value::Object(_) => "an object".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn parse(extra: Value) -> NetConf {
        let mut config = json!({ "cniVersion": "1.0.0", "name": "n", "type": "cnibpf" });
        for (key, value) in extra.as_object().expect("object") {
            config[key] = value.clone();
        }
        NetConf::parse(config.to_string().as_bytes()).expect("valid configuration")
    }

    #[test]
    fn rules_are_evaluated_in_index_order_whatever_the_array_order() {
        let conf = parse(json!({ "filter": [
            { "index": 20, "target": "allow", "proto": "TCP", "dport": "1000-2000" },
            { "index": 10, "target": "Drop", "src": "172.64.0.0/13" },
        ] }));
        let indexes: Vec<u32> = conf.plugin.filter.iter().map(|rule| rule.index).collect();
        assert_eq!(indexes, [10, 20]);
        assert_eq!(conf.plugin.filter[0].target, Target::Drop);
        assert_eq!(conf.plugin.filter[1].protocol, RuleProtocol::Tcp);
        assert_eq!(
            conf.plugin.filter[1].dport,
            Some(PortRange {
                low: 1000,
                high: 2000
            })
        );
        assert_eq!(conf.plugin.filter[1].direction, Direction::Both);
    }

    #[test]
    fn defaults_and_wildcards() {
        let conf = parse(json!({ "runtimeConfig": { "portMappings": [
            { "hostPort": 80, "containerPort": 8080, "hostIP": "" },
            { "hostPort": 81, "containerPort": 8081, "hostIP": "::", "protocol": "UDP" },
            { "hostPort": 82, "containerPort": 8082, "hostIP": "10.0.0.1" },
        ] } }));
        assert_eq!(conf.plugin.backend, BackendChoice::Auto);
        assert_eq!(conf.plugin.pin_path, PathBuf::from(paths::DEFAULT_PIN_PATH));
        assert_eq!(conf.plugin.filter_default, Target::Allow);
        assert!(!conf.plugin.ip_masq);
        assert_eq!(conf.port_mappings[0].host_ip, None);
        assert_eq!(conf.port_mappings[0].protocol, Protocol::Tcp);
        assert_eq!(conf.port_mappings[1].host_ip, None);
        assert_eq!(conf.port_mappings[1].protocol, Protocol::Udp);
        assert_eq!(
            conf.port_mappings[2].host_ip,
            Some("10.0.0.1".parse().expect("literal"))
        );
    }

    #[test]
    fn cidrs_are_normalised_and_addresses_become_host_routes() {
        let conf = parse(json!({ "ipMasqExclude": ["10.1.2.3/8", "2001:db8::1"] }));
        assert_eq!(conf.plugin.ip_masq_exclude[0].to_string(), "10.0.0.0/8");
        assert_eq!(
            conf.plugin.ip_masq_exclude[1].to_string(),
            "2001:db8::1/128"
        );
    }

    #[test]
    fn versions_order_and_verb_minimums() {
        assert!(CniVersion::parse("0.3.1").expect("supported") < CniVersion::V0_4_0);
        assert!(CniVersion::parse("1.1.0").expect("supported") == CniVersion::V1_1_0);
        assert!(CniVersion::parse("2.0.0").is_err());
        let old = parse(json!({ "cniVersion": "0.3.0" }));
        assert!(old.require_version("CHECK").is_err());
        assert!(old.require_version("ADD").is_ok());
    }
}
