//! Passing the previous plugin's result through, converted to the requested spec version.
//!
//! Results of 0.3.x and 0.4.0 carry `"version": "4"|"6"` in each `ips` entry; 1.x results do
//! not. Everything else cnibpf passes through untouched.

use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::Value;

use crate::config::{self, CniVersion, ConfigError, input::ResultInput, names_field};

/// `prevResult` converted to `version` (`cniVersion` set, `ips[].version` added or removed).
/// Keys are found as the reference plugins find them (ignoring case).
pub fn convert(
    prev_result: &Value,
    version: CniVersion,
    version_text: &str,
) -> Result<Value, ConfigError> {
    let mut result = prev_result.clone();
    let Some(object) = result.as_object_mut() else {
        return Err(ConfigError::invalid("prevResult", "expected an object"));
    };
    object.retain(|key, _| !names_field(key, "cniVersion"));
    object.insert(
        "cniVersion".to_owned(),
        Value::String(version_text.to_owned()),
    );
    let ips = object
        .iter_mut()
        .find(|(key, _)| names_field(key, "ips"))
        .map(|(_, ips)| ips);
    if let Some(Value::Array(ips)) = ips {
        for (position, ip) in ips.iter_mut().enumerate() {
            let key = format!("prevResult.ips[{position}]");
            let Some(ip) = ip.as_object_mut() else {
                return Err(ConfigError::invalid(key, "expected an object"));
            };
            ip.retain(|key, _| !names_field(key, "version"));
            if version < CniVersion::V1_0_0 {
                let address = ip
                    .iter()
                    .find(|(key, _)| names_field(key, "address"))
                    .and_then(|(_, address)| address.as_str())
                    .and_then(|text| text.parse::<IpNet>().ok())
                    .ok_or_else(|| {
                        ConfigError::invalid(format!("{key}.address"), "expected a CIDR address")
                    })?;
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
        let input: ResultInput = config::decode(prev_result.clone(), "prevResult")?;
        let mut host_interfaces = Vec::new();
        let mut container_positions = Vec::new();
        let mut container_mac = None;
        for (position, interface) in input.interfaces.unwrap_or_default().into_iter().enumerate() {
            let name = interface.name.ok_or_else(|| {
                ConfigError::invalid(
                    format!("prevResult.interfaces[{position}].name"),
                    "is required",
                )
            })?;
            if interface.sandbox.unwrap_or_default().is_empty() {
                host_interfaces.push(name);
            } else if name == ifname {
                container_positions.push(position);
                container_mac = interface.mac.as_deref().and_then(parse_mac);
            }
        }
        let mut container_addresses = Vec::new();
        let mut gateways = Vec::new();
        for (position, ip) in input.ips.unwrap_or_default().into_iter().enumerate() {
            let address = ip
                .address
                .as_deref()
                .and_then(|text| text.parse::<IpNet>().ok())
                .ok_or_else(|| {
                    ConfigError::invalid(
                        format!("prevResult.ips[{position}].address"),
                        "expected a CIDR address such as 10.22.0.5/16",
                    )
                })?;
            let belongs = match ip.interface {
                None => true,
                Some(index) => {
                    usize::try_from(index).is_ok_and(|index| container_positions.contains(&index))
                }
            };
            if belongs {
                container_addresses.push(address);
                gateways.extend(ip.gateway.and_then(|text| text.parse::<IpAddr>().ok()));
            }
        }
        Ok(Self {
            host_interfaces,
            container_addresses,
            gateways,
            container_mac,
        })
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
        let addresses: Vec<IpAddr> = prev.container_addresses.iter().map(IpNet::addr).collect();
        assert_eq!(
            addresses,
            [
                "10.22.0.5".parse::<IpAddr>().expect("literal"),
                "2001:db8::5".parse().expect("literal")
            ]
        );
        let other = PrevResult::parse(&sample(false), "net1").expect("parsable");
        assert!(
            other.container_addresses.is_empty(),
            "addresses of eth0 are not net1's"
        );
    }
}
