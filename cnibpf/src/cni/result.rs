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
    /// Gateways of those addresses.
    pub gateways: Vec<IpAddr>,
    /// MAC address of the container interface `ifname`, when prevResult gives it.
    pub container_mac: Option<[u8; 6]>,
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
        let mut container_mac = None;
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
                container_mac = interface
                    .get("mac")
                    .and_then(Value::as_str)
                    .and_then(parse_mac);
            }
        }
        let ips = match prev_result.get("ips") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(ips)) => ips.clone(),
            Some(_) => return Err(invalid("prevResult.ips", "expected an array")),
        };
        let mut container_addresses = Vec::new();
        let mut gateways = Vec::new();
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
                gateways.extend(
                    ip.get("gateway")
                        .and_then(Value::as_str)
                        .and_then(|text| text.parse::<IpAddr>().ok()),
                );
            }
        }
        Ok(Self {
            host_interfaces,
            container_addresses,
            gateways,
            container_mac,
        })
    }

    pub fn container_address(&self, ipv4: bool) -> Option<IpAddr> {
        self.container_addresses
            .iter()
            .map(IpNet::addr)
            .find(|addr| addr.is_ipv4() == ipv4)
    }
}

/// `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        *byte = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

fn invalid(key: &str, reason: &str) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_owned(),
        reason: reason.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn sample(version_field: bool) -> Value {
        let mut ip = json!({ "address": "10.22.0.5/16", "gateway": "10.22.0.1", "interface": 2 });
        if version_field {
            ip["version"] = json!("4");
        }
        json!({
            "cniVersion": "1.0.0",
            "interfaces": [{ "name": "cni0" }, { "name": "veth1" }, { "name": "eth0", "sandbox": "/run/netns/c" }],
            "ips": [ip, { "address": "2001:db8::5/64", "interface": 2 }],
        })
    }

    #[test]
    fn conversion_adds_or_removes_the_ip_version_field() {
        let old = convert(&sample(false), CniVersion::V0_4_0, "0.4.0").expect("convertible");
        assert_eq!(old["cniVersion"], "0.4.0");
        assert_eq!(old["ips"][0]["version"], "4");
        assert_eq!(old["ips"][1]["version"], "6");
        let new = convert(&sample(true), CniVersion::V1_1_0, "1.1.0").expect("convertible");
        assert_eq!(new["cniVersion"], "1.1.0");
        assert!(new["ips"][0].get("version").is_none());
        assert_eq!(new["interfaces"], sample(false)["interfaces"]);
    }

    #[test]
    fn container_side_of_prev_result() {
        let prev = PrevResult::parse(&sample(false), "eth0").expect("parsable");
        assert_eq!(prev.host_interfaces, ["cni0", "veth1"]);
        assert_eq!(
            prev.container_address(true),
            Some("10.22.0.5".parse().expect("literal"))
        );
        assert_eq!(
            prev.container_address(false),
            Some("2001:db8::5".parse().expect("literal"))
        );
        let other = PrevResult::parse(&sample(false), "net1").expect("parsable");
        assert!(
            other.container_addresses.is_empty(),
            "addresses of eth0 are not net1's"
        );
    }
}
