//! The container's veth as cnibpf needs it: its host side, the MAC addresses of the
//! container and of its gateway, and the container side's IPv6 link-local addresses.

use std::{
    net::{IpAddr, Ipv6Addr},
    path::Path,
};

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
    #[error("could not read {path}")]
    Setting {
        path: String,
        #[source]
        source: std::io::Error,
    },
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
    // Exactly one veth names the host side; none or several leave it to the peer's index.
    let from_prev_result = match <[Link; 1]>::try_from(veths) {
        Ok([only]) => Some(only),
        // fail-closed: a count of interfaces, not an error.
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
            let link = netlink::link_if_there(peer_index)?.ok_or_else(no_peer)?;
            if link.kind.as_deref() != Some("veth") {
                return Err(HostInterfaceError::NotVeth {
                    name: link.name,
                    ifname: ifname.to_owned(),
                    // fail-closed: an Option of the interface, for the message.
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

/// Whether the container behind CNI_NETNS has a veth besides CNI_IFNAME: attached more than
/// once (another network, another interface), so that its source checks admit each other's
/// addresses. A container with one interface has no other attachment to look for.
pub fn has_other_veths(netns: &Path, ifname: &str) -> Result<bool, HostInterfaceError> {
    let _guard = NetnsGuard::enter(netns)?;
    Ok(netlink::links()?
        .iter()
        .any(|link| link.name != ifname && link.kind.as_deref() == Some("veth")))
}

/// `addr_gen_mode` values (`IN6_ADDR_GEN_MODE_*`): how the kernel makes an interface's IPv6
/// link-local address.
const ADDR_GEN_MODE_EUI64: &str = "0";

/// The IPv6 link-local addresses CNI_IFNAME inside CNI_NETNS sends from: those it has now, and
/// the one the kernel derives from its MAC address (`addr_gen_mode` 0, the default) — which a
/// veth whose carrier is not up yet has not been given at ADD. None when IPv6 is off there.
pub fn container_link_locals(
    netns: &Path,
    ifname: &str,
    container_mac: [u8; 6],
) -> Result<Vec<Ipv6Addr>, HostInterfaceError> {
    let _guard = NetnsGuard::enter(netns)?;
    let setting = |name: &str| {
        let path = format!("/proc/sys/net/ipv6/conf/{ifname}/{name}");
        match std::fs::read_to_string(&path) {
            Ok(text) => Ok(Some(text.trim().to_owned())),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(HostInterfaceError::Setting { path, source }),
        }
    };
    let Some(disabled) = setting("disable_ipv6")? else {
        // No IPv6 in the namespace (or on the interface).
        return Ok(Vec::new());
    };
    if disabled != "0" {
        return Ok(Vec::new());
    }
    let index = netlink::link_by_name(ifname)?.index;
    let mut addresses: Vec<Ipv6Addr> = netlink::ipv6_addresses_of(index)?
        .into_iter()
        .filter_map(|address| match address {
            IpAddr::V6(address) if address.is_unicast_link_local() => Some(address),
            IpAddr::V6(_) | IpAddr::V4(_) => None,
        })
        .collect();
    if setting("addr_gen_mode")?.as_deref() == Some(ADDR_GEN_MODE_EUI64) {
        addresses.push(eui64_link_local(container_mac));
    }
    addresses.sort_unstable();
    addresses.dedup();
    Ok(addresses)
}

/// fe80::/64 with the modified EUI-64 interface identifier of `mac` (RFC 4291, appendix A).
fn eui64_link_local(mac: [u8; 6]) -> Ipv6Addr {
    let [a, b, c, d, e, f] = mac;
    Ipv6Addr::from([
        0xfe,
        0x80,
        0,
        0,
        0,
        0,
        0,
        0,
        a ^ 0x02,
        b,
        c,
        0xff,
        0xfe,
        d,
        e,
        f,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eui64_flips_the_universal_bit_and_inserts_fffe() {
        assert_eq!(
            eui64_link_local([0x52, 0x54, 0x00, 0x12, 0x34, 0x56]),
            "fe80::5054:ff:fe12:3456".parse::<Ipv6Addr>().unwrap()
        );
    }
}
