//! Port mappings: as configured (`runtimeConfig.portMappings`), as resolved per family to the
//! container's address, and who may reach them (the reference portmap's keys).

use std::{fmt, net::IpAddr};

use ipnet::IpNet;

use super::{Protocol, conditions::Conditions};

/// One entry of `runtimeConfig.portMappings`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortMapping {
    pub host_port: u16,
    pub container_port: u16,
    pub protocol: Protocol,
    /// `None` for any address of the host (absent, empty, `0.0.0.0` or `::`).
    pub host_ip: Option<IpAddr>,
}

/// Whether two (protocol, hostIP, hostPort) claims could both take one packet: same protocol
/// and port, and host addresses that are equal or where either is a wildcard. The one rule
/// for overlapping hostPorts, in a configuration and between attachments.
pub fn host_ports_overlap(
    a: (Protocol, Option<IpAddr>, u16),
    b: (Protocol, Option<IpAddr>, u16),
) -> bool {
    a.0 == b.0
        && a.2 == b.2
        && match (a.1, b.1) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        }
}

impl PortMapping {
    pub fn overlaps(&self, other: &Self) -> bool {
        host_ports_overlap(
            (self.protocol, self.host_ip, self.host_port),
            (other.protocol, other.host_ip, other.host_port),
        )
    }
}

/// Who reaches the attachment's hostPorts, as the reference portmap's keys say.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostPortAccess {
    /// `conditionsV4`: all must hold for IPv4 traffic to be translated.
    pub conditions_v4: Conditions,
    /// `conditionsV6`.
    pub conditions_v6: Conditions,
    /// `snat: false`: a container reaching its own hostPort keeps its address as the source
    /// (and so is not answered), as with the reference.
    pub no_hairpin_snat: bool,
}

impl HostPortAccess {
    pub fn conditions(&self, ipv4: bool) -> &Conditions {
        if ipv4 {
            &self.conditions_v4
        } else {
            &self.conditions_v6
        }
    }
}

/// A port mapping for one family, with the container address it leads to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResolvedMapping {
    pub protocol: Protocol,
    /// `None` is the wildcard of the container address's family.
    pub host_addr: Option<IpAddr>,
    pub host_port: u16,
    pub container_addr: IpAddr,
    pub container_port: u16,
}

impl ResolvedMapping {
    pub fn is_ipv4(&self) -> bool {
        self.container_addr.is_ipv4()
    }

    /// The host side, as error 100 names it: `hostPort 8080/tcp on 203.0.113.1`.
    pub fn host_side(&self) -> String {
        format!(
            "hostPort {}/{}{}",
            self.host_port,
            self.protocol,
            self.host_addr
                .map(|addr| format!(" on {addr}"))
                .unwrap_or_default()
        )
    }

    /// Whether the two could both take one packet: same family and [`host_ports_overlap`].
    pub fn overlaps(&self, other: &Self) -> bool {
        self.is_ipv4() == other.is_ipv4()
            && host_ports_overlap(
                (self.protocol, self.host_addr, self.host_port),
                (other.protocol, other.host_addr, other.host_port),
            )
    }
}

/// As people write it: `tcp 0.0.0.0:8080 -> 10.22.0.2:80`.
impl fmt::Display for ResolvedMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let host = match self.host_addr {
            Some(IpAddr::V6(addr)) => format!("[{addr}]"),
            Some(addr) => addr.to_string(),
            None if self.is_ipv4() => "0.0.0.0".to_owned(),
            None => "[::]".to_owned(),
        };
        let container = match self.container_addr {
            IpAddr::V6(addr) => format!("[{addr}]"),
            addr => addr.to_string(),
        };
        write!(
            f,
            "{} {host}:{} -> {container}:{}",
            self.protocol, self.host_port, self.container_port
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MappingError {
    #[error(
        "runtimeConfig.portMappings[{position}]: hostIP {host_ip} is IPv{family} but the container has no IPv{family} address in prevResult"
    )]
    NoContainerAddress {
        position: usize,
        host_ip: IpAddr,
        family: u8,
    },
    #[error(
        "runtimeConfig.portMappings: the container has no address in prevResult to map ports to"
    )]
    NoAddresses,
}

/// One entry per mapping and family: a mapping applies to each family the container has an
/// address in, unless its hostIP names one family.
pub fn resolve_mappings(
    mappings: &[PortMapping],
    container_addresses: &[IpNet],
) -> Result<Vec<ResolvedMapping>, MappingError> {
    if !mappings.is_empty() && container_addresses.is_empty() {
        return Err(MappingError::NoAddresses);
    }
    let mut resolved = Vec::new();
    for (position, mapping) in mappings.iter().enumerate() {
        let families: &[bool] = match mapping.host_ip {
            Some(IpAddr::V4(_)) => &[true],
            Some(IpAddr::V6(_)) => &[false],
            None => &[true, false],
        };
        for &ipv4 in families {
            let container_address = container_addresses
                .iter()
                .map(IpNet::addr)
                .find(|addr| addr.is_ipv4() == ipv4);
            match container_address {
                Some(container_addr) => resolved.push(ResolvedMapping {
                    protocol: mapping.protocol,
                    host_addr: mapping.host_ip,
                    host_port: mapping.host_port,
                    container_addr,
                    container_port: mapping.container_port,
                }),
                None => {
                    if let Some(host_ip) = mapping.host_ip {
                        return Err(MappingError::NoContainerAddress {
                            position,
                            host_ip,
                            family: if ipv4 { 4 } else { 6 },
                        });
                    }
                }
            }
        }
    }
    Ok(resolved)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapping(host_addr: Option<&str>, container: &str) -> ResolvedMapping {
        ResolvedMapping {
            protocol: Protocol::Tcp,
            host_addr: host_addr.map(|addr| addr.parse().expect("literal")),
            host_port: 8080,
            container_addr: container.parse().expect("literal"),
            container_port: 80,
        }
    }

    #[test]
    fn overlap_rule() {
        let any = None;
        let one = Some("10.0.0.1".parse().expect("literal"));
        let two = Some("10.0.0.2".parse().expect("literal"));
        assert!(host_ports_overlap(
            (Protocol::Tcp, any, 80),
            (Protocol::Tcp, one, 80)
        ));
        assert!(host_ports_overlap(
            (Protocol::Tcp, one, 80),
            (Protocol::Tcp, one, 80)
        ));
        assert!(!host_ports_overlap(
            (Protocol::Tcp, one, 80),
            (Protocol::Tcp, two, 80)
        ));
        assert!(!host_ports_overlap(
            (Protocol::Tcp, any, 80),
            (Protocol::Udp, any, 80)
        ));
        assert!(!host_ports_overlap(
            (Protocol::Tcp, any, 80),
            (Protocol::Tcp, any, 81)
        ));
        // Resolved mappings of different families never overlap.
        assert!(!mapping(None, "10.22.0.2").overlaps(&mapping(None, "fd00::2")));
        assert!(mapping(None, "10.22.0.2").overlaps(&mapping(Some("203.0.113.1"), "10.22.0.3")));
    }

    #[test]
    fn mappings_resolve_per_family_unless_the_host_ip_names_one() {
        let addresses: Vec<IpNet> = ["10.22.0.5/16", "fd00::5/64"]
            .iter()
            .map(|net| net.parse().expect("literal"))
            .collect();
        let wildcard = PortMapping {
            host_port: 8080,
            container_port: 80,
            protocol: Protocol::Tcp,
            host_ip: None,
        };
        let resolved = resolve_mappings(&[wildcard], &addresses).expect("resolves");
        assert_eq!(resolved.len(), 2);
        assert_eq!(resolved[0].to_string(), "tcp 0.0.0.0:8080 -> 10.22.0.5:80");
        assert_eq!(resolved[1].to_string(), "tcp [::]:8080 -> [fd00::5]:80");
        let v6_only = PortMapping {
            host_ip: Some("2001:db8::1".parse().expect("literal")),
            ..wildcard
        };
        assert_eq!(
            resolve_mappings(&[v6_only], &addresses[..1])
                .expect_err("no IPv6 address")
                .to_string(),
            "runtimeConfig.portMappings[0]: hostIP 2001:db8::1 is IPv6 but the container has no IPv6 address in prevResult"
        );
        assert!(resolve_mappings(&[wildcard], &[]).is_err());
    }
}
