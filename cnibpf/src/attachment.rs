//! An attachment is one (network name, CNI_IFNAME, CNI_CONTAINERID): the unit that ADD creates
//! and DEL and GC remove. Its owner id tags every piece of state it creates.

use std::{net::IpAddr, path::Path};

use cnibpf_common::owner::{IFNAME_LEN, NAME_LEN, OwnerInfo};

use crate::{
    cni::{args::Pod, result::PrevResult},
    config::{PortMapping, Protocol},
    netlink::{self, Link, NetlinkError},
    netns::{NetnsError, NetnsGuard},
};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attachment {
    pub network: String,
    pub container_id: String,
    pub ifname: String,
}

impl Attachment {
    pub fn new(network: &str, container_id: &str, ifname: &str) -> Self {
        Self {
            network: network.to_owned(),
            container_id: container_id.to_owned(),
            ifname: ifname.to_owned(),
        }
    }

    /// 64-bit FNV-1a of the three names, NUL separated: stable across invocations and hosts,
    /// so every run of the plugin finds the same attachment's state without a lookup table.
    pub fn owner_id(&self) -> u64 {
        const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
        const PRIME: u64 = 0x0000_0100_0000_01b3;
        [&self.network, &self.ifname, &self.container_id]
            .iter()
            .flat_map(|part| part.bytes().chain([0]))
            .fold(OFFSET_BASIS, |hash, byte| {
                (hash ^ u64::from(byte)).wrapping_mul(PRIME)
            })
    }

    pub fn to_owner_info(&self, host: &Link, pod: Option<&Pod>) -> OwnerInfo {
        let mut info = OwnerInfo::default();
        copy_name(&mut info.network, &self.network);
        copy_name(&mut info.container_id, &self.container_id);
        copy_name(&mut info.ifname, &self.ifname);
        copy_name(&mut info.host_ifname, &host.name);
        info.host_ifindex = host.index;
        if let Some(pod) = pod {
            copy_name(&mut info.pod_namespace, &pod.namespace);
            copy_name(&mut info.pod_name, &pod.name);
        }
        info
    }

    /// The pod an `owners` entry names, if any.
    pub fn pod_of_owner_info(info: &OwnerInfo) -> Option<Pod> {
        let namespace = read_name(&info.pod_namespace);
        let name = read_name(&info.pod_name);
        (!namespace.is_empty() && !name.is_empty()).then_some(Pod { namespace, name })
    }

    pub fn from_owner_info(info: &OwnerInfo) -> Self {
        Self {
            network: read_name(&info.network),
            container_id: read_name(&info.container_id),
            ifname: read_name(&info.ifname),
        }
    }
}

impl std::fmt::Display for Attachment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "network {:?}, container {:?}, ifname {:?}",
            self.network, self.container_id, self.ifname
        )
    }
}

/// Copies a name into a zero-padded field. Names are validated shorter than the field, so the
/// last byte always stays zero and the field always reads back as the same name.
fn copy_name<const N: usize>(field: &mut [u8; N], name: &str) {
    let length = name.len().min(N - 1);
    field[..length].copy_from_slice(&name.as_bytes()[..length]);
}

pub fn read_name(field: &[u8]) -> String {
    let end = field
        .iter()
        .position(|byte| *byte == 0)
        .unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end]).into_owned()
}

const _: () = assert!(NAME_LEN > 64 && IFNAME_LEN == 16);

#[derive(Debug, thiserror::Error)]
pub enum HostInterfaceError {
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("interface {ifname:?} in {netns} is not a veth: cannot find its host side")]
    NoPeer { ifname: String, netns: String },
    #[error("interface {0:?} has no MAC address")]
    NoMac(String),
    #[error("host-side interface {name:?} of {ifname:?} is a {kind}, not a veth")]
    NotVeth {
        name: String,
        ifname: String,
        kind: String,
    },
}

/// Both ends of the container's veth as cnibpf needs them.
#[derive(Clone, Debug)]
pub struct ContainerLink {
    /// The host-side interface.
    pub host: Link,
    /// MAC address of the container-side interface.
    pub container_mac: [u8; 6],
    /// MAC address the container's gateway answers with: the bridge the host side is enslaved
    /// to, or the host side itself (routed setups such as ptp).
    pub gateway_mac: [u8; 6],
}

/// The host side of the container's interface: the one veth among prevResult's host
/// interfaces, or else the peer of CNI_IFNAME inside CNI_NETNS. The container's MAC comes from
/// prevResult or, failing that, from CNI_IFNAME itself.
pub fn find_container_link(
    prev: &PrevResult,
    netns: &Path,
    ifname: &str,
) -> Result<ContainerLink, HostInterfaceError> {
    let mut veths = Vec::new();
    for name in &prev.host_interfaces {
        match netlink::link_by_name(name) {
            Ok(link) if link.kind.as_deref() == Some("veth") => veths.push(link),
            Ok(_) | Err(NetlinkError::NoSuchName(_)) => {}
            Err(error) => return Err(error.into()),
        }
    }
    let from_prev_result = match <[Link; 1]>::try_from(veths) {
        Ok([only]) => Some(only),
        Err(_) => None,
    };
    let inside = match (&from_prev_result, prev.container_mac) {
        (Some(_), Some(_)) => None,
        _ => {
            let _guard = NetnsGuard::enter(netns)?;
            Some(netlink::link_by_name(ifname)?)
        }
    };
    let no_peer = || HostInterfaceError::NoPeer {
        ifname: ifname.to_owned(),
        netns: netns.display().to_string(),
    };
    let host = match from_prev_result {
        Some(host) => host,
        None => {
            let peer_index = inside
                .as_ref()
                .and_then(|link| link.peer_index)
                .ok_or_else(no_peer)?;
            let link = netlink::link_by_index(peer_index).map_err(|_| no_peer())?;
            if link.kind.as_deref() != Some("veth") {
                return Err(HostInterfaceError::NotVeth {
                    name: link.name,
                    ifname: ifname.to_owned(),
                    kind: link.kind.unwrap_or_else(|| "plain device".to_owned()),
                });
            }
            link
        }
    };
    let container_mac = prev
        .container_mac
        .or_else(|| inside.as_ref().and_then(|link| link.mac))
        .ok_or_else(|| HostInterfaceError::NoMac(ifname.to_owned()))?;
    let gateway = match host.master {
        Some(master) => netlink::link_by_index(master)?,
        None => host.clone(),
    };
    let gateway_mac = gateway
        .mac
        .ok_or_else(|| HostInterfaceError::NoMac(gateway.name.clone()))?;
    Ok(ContainerLink {
        host,
        container_mac,
        gateway_mac,
    })
}

/// A port mapping for one family, with the container address it leads to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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
    prev: &PrevResult,
) -> Result<Vec<ResolvedMapping>, MappingError> {
    if !mappings.is_empty() && prev.container_addresses.is_empty() {
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
            match prev.container_address(ipv4) {
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

    #[test]
    fn owner_id_is_stable_and_separates_fields() {
        let a = Attachment::new("net", "abc", "eth0");
        assert_eq!(
            a.owner_id(),
            Attachment::new("net", "abc", "eth0").owner_id()
        );
        // Moving a byte between fields must change the id: the separator sees to that.
        assert_ne!(
            a.owner_id(),
            Attachment::new("ne", "tabc", "eth0").owner_id()
        );
        assert_ne!(
            a.owner_id(),
            Attachment::new("net", "abc", "eth1").owner_id()
        );
    }

    #[test]
    fn owner_info_round_trips_names() {
        let a = Attachment::new("mynet", "0123456789abcdef", "eth0");
        let host = Link {
            index: 7,
            name: "veth1234".to_owned(),
            kind: Some("veth".to_owned()),
            peer_index: None,
            master: None,
            mac: None,
        };
        let pod = Pod {
            namespace: "default".to_owned(),
            name: "web-0".to_owned(),
        };
        let info = a.to_owner_info(&host, Some(&pod));
        assert_eq!(Attachment::from_owner_info(&info), a);
        assert_eq!(read_name(&info.host_ifname), "veth1234");
        assert_eq!(Attachment::pod_of_owner_info(&info), Some(pod));
        assert_eq!(
            Attachment::pod_of_owner_info(&a.to_owner_info(&host, None)),
            None
        );
    }
}
