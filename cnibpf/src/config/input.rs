//! The configuration as JSON carries it: serde structs shaped like what the reference plugins
//! decode, read through [`super::fold::Folding`] so that keys match their fields as Go's
//! `encoding/json` matches them. Every field is optional here (null is absent, as in Go);
//! `super` says which are required and what the values mean.

use std::{collections::BTreeMap, net::IpAddr};

use ipnet::IpNet;
use serde::{Deserialize, Deserializer, de::Error as _};
use serde_json::{Map, Value};

use super::fold::describe;
use crate::model::{PortRange, PortRangeError};

/// The top level: the spec's keys, the reference portmap's keys that cnibpf honours or refuses,
/// and cnibpf's own. Unknown keys are ignored, as the spec wants.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetConfInput {
    pub cni_version: Option<String>,
    pub name: Option<String>,
    pub prev_result: Option<Map<String, Value>>,
    pub runtime_config: Option<RuntimeConfigInput>,
    /// Decoded only to refuse a capability that is not a boolean, as libcni does.
    #[expect(
        dead_code,
        reason = "validated by decoding; the runtime acts on capabilities"
    )]
    pub capabilities: Option<BTreeMap<String, bool>>,
    /// A list given as null is empty (CRI-O sends null when it has no pods), as the reference
    /// plugins take it; a list left out is absent.
    #[serde(
        rename = "cni.dev/valid-attachments",
        default,
        deserialize_with = "null_as_empty"
    )]
    pub valid_attachments: Option<Vec<AttachmentInput>>,
    /// libcni's earlier spelling of `cni.dev/valid-attachments`.
    #[serde(
        rename = "cni.dev/attachments",
        default,
        deserialize_with = "null_as_empty"
    )]
    pub legacy_valid_attachments: Option<Vec<AttachmentInput>>,

    pub backend: Option<String>,
    pub ip_masq: Option<bool>,
    pub ip_masq_exclude: Option<Vec<Cidr>>,
    pub host_firewall: Option<bool>,
    pub source_check: Option<bool>,
    pub filter: Option<Vec<RuleInput>>,
    pub filter_default: Option<String>,
    pub uplinks: Option<Vec<String>>,
    pub service_interfaces: Option<Vec<String>>,
    pub pin_path: Option<String>,
    pub cgroup_path: Option<String>,
    pub log_file: Option<String>,
    #[serde(rename = "logMaxSizeMB")]
    pub log_max_size_mb: Option<u64>,
    pub log_max_files: Option<u32>,
    pub max_flows: Option<u64>,
    pub max_attachments: Option<u64>,
    pub max_host_ports: Option<u64>,

    // The reference portmap's own keys, and the bridge's, that a conflist may carry over.
    pub snat: Option<bool>,
    pub conditions_v4: Option<Vec<String>>,
    pub conditions_v6: Option<Vec<String>>,
    pub mark_masq_bit: Option<i64>,
    pub external_set_mark_chain: Option<String>,
    pub masq_all: Option<bool>,
    pub ip_masq_backend: Option<String>,
}

/// What DEL and GC read: the rest of a configuration may be anything, even invalid.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CleanupInput {
    pub cni_version: Option<String>,
    pub name: Option<String>,
    pub pin_path: Option<String>,
    /// What `cnibpf install` recorded in the entry; only the portmap it replaced is read.
    pub cnibpf_install: Option<Value>,
    /// Passed on, as they came, to the portmap a DEL is handed to.
    pub runtime_config: Option<Value>,
    pub prev_result: Option<Value>,
    pub log_file: Option<String>,
    #[serde(rename = "logMaxSizeMB")]
    pub log_max_size_mb: Option<u64>,
    pub log_max_files: Option<u32>,
}

/// What the call log and the call statistics read of any configuration, even one a verb
/// refuses: where they go.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RecordingInput {
    pub pin_path: Option<String>,
    pub log_file: Option<String>,
    #[serde(rename = "logMaxSizeMB")]
    pub log_max_size_mb: Option<u64>,
    pub log_max_files: Option<u32>,
}

/// `runtimeConfig`: the capabilities cnibpf reads. Whatever else a runtime passes (`dns`,
/// `ipRanges`, `cgroupPath`, pod annotations, …) is not read and cannot fail an ADD.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeConfigInput {
    pub port_mappings: Option<Vec<PortMappingInput>>,
    /// The reference `bandwidth` plugin's capability, read only to learn that the pod is
    /// shaped (any shape is accepted: it is that plugin's to judge).
    pub bandwidth: Option<Value>,
}

/// One `runtimeConfig.portMappings` entry, as the reference portmap's `PortMapEntry`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PortMappingInput {
    pub host_port: Option<Port>,
    pub container_port: Option<Port>,
    pub protocol: Option<String>,
    #[serde(rename = "hostIP")]
    pub host_ip: Option<String>,
}

/// A list that is present, null read as empty: the field's `default` is for a key left out.
fn null_as_empty<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    deserializer: D,
) -> Result<Option<Vec<T>>, D::Error> {
    Ok(Some(
        Option::<Vec<T>>::deserialize(deserializer)?.unwrap_or_default(),
    ))
}

/// One `cni.dev/valid-attachments` entry (GC).
#[derive(Debug, Default, Deserialize)]
pub struct AttachmentInput {
    #[serde(rename = "containerID")]
    pub container_id: Option<String>,
    pub ifname: Option<String>,
}

/// One `filter` rule. Unknown keys are an error: a typo must not widen a rule.
#[derive(Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleInput {
    pub index: Option<RuleIndex>,
    pub action: Option<String>,
    pub target: Option<String>,
    pub src: Option<Cidr>,
    pub dst: Option<Cidr>,
    #[serde(rename = "srcNetwork")]
    pub src_network: Option<String>,
    #[serde(rename = "dstNetwork")]
    pub dst_network: Option<String>,
    pub log: Option<bool>,
    pub proto: Option<String>,
    pub sport: Option<PortRangeInput>,
    pub dport: Option<PortRangeInput>,
    pub connstate: Option<String>,
    pub direction: Option<String>,
}

/// `prevResult`, as far as cnibpf reads it (the rest passes through untouched).
#[derive(Debug, Default, Deserialize)]
pub struct ResultInput {
    pub interfaces: Option<Vec<InterfaceInput>>,
    pub ips: Option<Vec<IpInput>>,
}

#[derive(Debug, Default, Deserialize)]
pub struct InterfaceInput {
    pub name: Option<String>,
    pub mac: Option<String>,
    pub sandbox: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub struct IpInput {
    pub address: Option<String>,
    pub gateway: Option<String>,
    pub interface: Option<u64>,
}

/// A port 1-65535.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Port(pub u16);

impl<'de> Deserialize<'de> for Port {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(deserializer)?;
        value
            .as_u64()
            .and_then(|port| u16::try_from(port).ok())
            .filter(|port| *port != 0)
            .map(Self)
            .ok_or_else(|| {
                D::Error::custom(format!("expected a port 1-65535, got {}", describe(&value)))
            })
    }
}

/// A filter rule's `index`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuleIndex(pub u32);

impl<'de> Deserialize<'de> for RuleIndex {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(deserializer)?;
        value
            .as_u64()
            .and_then(|index| u32::try_from(index).ok())
            .map(Self)
            .ok_or_else(|| {
                D::Error::custom(format!(
                    "expected an integer from 0 to {}, got {}",
                    u32::MAX,
                    describe(&value)
                ))
            })
    }
}

/// A port or a `"low-high"` range: a number or a string.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortRangeInput(pub PortRange);

impl<'de> Deserialize<'de> for PortRangeInput {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(deserializer)?;
        let malformed = || {
            D::Error::custom(format!(
                "expected a port 1-65535 or a range \"low-high\", got {}",
                describe(&value)
            ))
        };
        match &value {
            Value::Number(number) => number
                .as_u64()
                .and_then(|port| u16::try_from(port).ok())
                .filter(|port| *port != 0)
                .map(|port| Self(PortRange::single(port)))
                .ok_or_else(malformed),
            Value::String(text) => match text.parse() {
                Ok(range) => Ok(Self(range)),
                Err(PortRangeError::Malformed) => Err(malformed()),
                Err(PortRangeError::Empty { low, high }) => Err(D::Error::custom(format!(
                    "range {low}-{high} is empty: the low port is above the high port"
                ))),
            },
            _ => Err(malformed()),
        }
    }
}

/// A CIDR, or an address standing for its host route; stored truncated to its prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr(pub IpNet);

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        if let Ok(net) = text.parse::<IpNet>() {
            return Ok(Self(net.trunc()));
        }
        text.parse::<IpAddr>()
            .map(|addr| Self(IpNet::from(addr)))
            .map_err(|_| {
                D::Error::custom(format!(
                    "expected a CIDR such as 10.0.0.0/8 or an address, got {text:?}"
                ))
            })
    }
}
