//! The container's veth as cnibpf needs it: its host side, and the MAC addresses of the
//! container and of its gateway.

use std::path::Path;

use super::result::PrevResult;
use crate::{
    netlink::{self, Link, NetlinkError},
    netns::{NetnsError, NetnsGuard},
};

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
