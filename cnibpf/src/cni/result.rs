//! Passing the previous plugin's result through, converted to the requested spec version.
//!
//! Results of 0.3.x and 0.4.0 carry `"version": "4"|"6"` in each `ips` entry; 1.x results do
//! not. Everything else cnibpf passes through untouched.

use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::Value;

use crate::config::{CniVersion, ConfigError};

/// `prevResult` converted to `version` (`cniVersion` set, `ips[].version` added or removed).
pub fn convert(
    prev_result: &Value,
    version: CniVersion,
    version_text: &str,
) -> Result<Value, ConfigError> {
    let mut result = prev_result.clone();
    let Some(object) = result.as_object_mut() else {
        return Err(invalid("prevResult", "expected an object"));
    };
    object.insert(
        "cniVersion".to_owned(),
        Value::String(version_text.to_owned()),
    );
    if let Some(Value::Array(ips)) = object.get_mut("ips") {
        for (position, ip) in ips.iter_mut().enumerate() {
            let key = format!("prevResult.ips[{position}]");
            let Some(ip) = ip.as_object_mut() else {
                return Err(invalid(&key, "expected an object"));
            };
            if version >= CniVersion::V1_0_0 {
                ip.remove("version");
            } else {
                let address = ip
                    .get("address")
                    .and_then(Value::as_str)
                    .and_then(|text| text.parse::<IpNet>().ok())
                    .ok_or_else(|| invalid(&format!("{key}.address"), "expected a CIDR address"))?;
                let family = if matches!(address, IpNet::V4(_)) {
                    "4"
                } else {
                    "6"
                };
                ip.insert("version".to_owned(), Value::String(family.to_owned()));
            }
        }
    }
    Ok(result)
}

/// The container's side of `prevResult`: its interface names and addresses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrevResult {
    /// Interfaces without a `sandbox` (the host side), by name.
    pub host_interfaces: Vec<String>,
    /// Addresses of the container interface `ifname` (or of every interface when `ips` entries
    /// name none), with their prefix.
    pub container_addresses: Vec<IpNet>,
}

impl PrevResult {
    pub fn parse(prev_result: &Value, ifname: &str) -> Result<Self, ConfigError> {
        let interfaces = match prev_result.get("interfaces") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(interfaces)) => interfaces.clone(),
            Some(_) => return Err(invalid("prevResult.interfaces", "expected an array")),
        };
        let mut host_interfaces = Vec::new();
        let mut container_positions = Vec::new();
        for (position, interface) in interfaces.iter().enumerate() {
            let name = interface
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    invalid(
                        &format!("prevResult.interfaces[{position}].name"),
                        "expected a string",
                    )
                })?;
            let sandbox = interface
                .get("sandbox")
                .and_then(Value::as_str)
                .unwrap_or("");
            if sandbox.is_empty() {
                host_interfaces.push(name.to_owned());
            } else if name == ifname {
                container_positions.push(position);
            }
        }
        let ips = match prev_result.get("ips") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(ips)) => ips.clone(),
            Some(_) => return Err(invalid("prevResult.ips", "expected an array")),
        };
        let mut container_addresses = Vec::new();
        for (position, ip) in ips.iter().enumerate() {
            let key = format!("prevResult.ips[{position}]");
            let address = ip
                .get("address")
                .and_then(Value::as_str)
                .and_then(|text| text.parse::<IpNet>().ok())
                .ok_or_else(|| {
                    invalid(
                        &format!("{key}.address"),
                        "expected a CIDR address such as 10.22.0.5/16",
                    )
                })?;
            let belongs = match ip.get("interface").and_then(Value::as_u64) {
                None => true,
                Some(index) => {
                    usize::try_from(index).is_ok_and(|index| container_positions.contains(&index))
                }
            };
            if belongs {
                container_addresses.push(address);
            }
        }
        Ok(Self {
            host_interfaces,
            container_addresses,
        })
    }

    pub fn container_address(&self, ipv4: bool) -> Option<IpAddr> {
        self.container_addresses
            .iter()
            .map(IpNet::addr)
            .find(|addr| addr.is_ipv4() == ipv4)
    }
}

fn invalid(key: &str, reason: &str) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_owned(),
        reason: reason.to_owned(),
    }
}
