//! The kernel's connection tracking entries towards hostPorts that changed hands: after an
//! operation adds, moves or removes a hostPort, the connections the kernel tracked to it go,
//! so that the next packet meets the mappings as they are now (a UDP client is never kept on
//! the old container, nor on none — the reference portmap's UDP bug). One dump of the table per
//! operation, over ctnetlink, however many hostPorts changed, and none when the namespace
//! tracks nothing.

use std::{io, net::IpAddr, ops::ControlFlow};

use super::NftablesError;
use crate::{
    backend::BackendError,
    model::ResolvedMapping,
    netlink,
    nfnetlink::{Connection, Request, attribute, attributes},
    paths,
};

const NFNL_SUBSYS_CTNETLINK: u8 = 1;
const IPCTNL_MSG_CT_GET: u8 = 1;
const IPCTNL_MSG_CT_DELETE: u8 = 2;
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_ZONE: u16 = 18;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_DST_PORT: u16 = 3;
const NLA_F_NESTED: u16 = 0x8000;

/// Whether the kernel tracks any connection in this network namespace: a dump walks the
/// whole (global) table, milliseconds even when it finds nothing. Without connection tracking
/// loaded (no such file) nothing is tracked.
pub fn tracking_any() -> io::Result<bool> {
    match std::fs::read_to_string(paths::CONNTRACK_COUNT) {
        Ok(count) => Ok(count.trim() != "0"),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(error) => Err(error),
    }
}

/// The connections the kernel tracks and how many it may (`nf_conntrack_max`); `None` without
/// connection tracking loaded.
pub fn fill() -> io::Result<Option<(u64, u64)>> {
    let read = |path: &str| match std::fs::read_to_string(path) {
        Ok(text) => text.trim().parse::<u64>().map(Some).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{path} holds {text:?}, not a number"),
            )
        }),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(error) => Err(error),
    };
    Ok(read(paths::CONNTRACK_COUNT)?.zip(read(paths::CONNTRACK_MAX)?))
}

/// Where a tracked connection was first sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Destination {
    addr: IpAddr,
    protocol: u8,
    port: u16,
}

/// Deletes the tracked connections sent to one of `mappings`' hostPorts: to its hostIP, or for
/// a wildcard mapping to any of `host_addresses`. Returns how many went.
pub fn forget(mappings: &[ResolvedMapping], host_addresses: &[IpAddr]) -> io::Result<usize> {
    if mappings.is_empty() {
        return Ok(0);
    }
    let targeted = |destination: &Destination| {
        mappings.iter().any(|mapping| {
            mapping.protocol.number() == destination.protocol
                && mapping.host_port == destination.port
                && mapping.is_ipv4() == destination.addr.is_ipv4()
                && match mapping.host_addr {
                    Some(addr) => addr == destination.addr,
                    None => host_addresses.contains(&destination.addr),
                }
        })
    };
    let mut connection = Connection::open()?;
    // (family, the entry's original tuple and zone as the kernel sent them)
    let mut doomed: Vec<(u8, Vec<u8>, Option<Vec<u8>>)> = Vec::new();
    connection.exchange(
        Request::new(
            NFNL_SUBSYS_CTNETLINK,
            IPCTNL_MSG_CT_GET,
            libc::AF_UNSPEC as u8,
            true,
        ),
        |_, entry| {
            if let Some(tuple) = attribute(entry, CTA_TUPLE_ORIG)
                && let Some(destination) = destination_of(tuple)
                && targeted(&destination)
            {
                let family = if destination.addr.is_ipv4() {
                    libc::AF_INET
                } else {
                    libc::AF_INET6
                };
                doomed.push((
                    family as u8,
                    tuple.to_vec(),
                    attribute(entry, CTA_ZONE).map(<[u8]>::to_vec),
                ));
            }
            ControlFlow::Continue(())
        },
    )?;
    let mut forgotten = 0;
    for (family, tuple, zone) in doomed {
        let mut request = Request::new(NFNL_SUBSYS_CTNETLINK, IPCTNL_MSG_CT_DELETE, family, false)
            .attribute(CTA_TUPLE_ORIG | NLA_F_NESTED, &tuple);
        if let Some(zone) = zone {
            request = request.attribute(CTA_ZONE, &zone);
        }
        match connection.exchange(request, |_, _| ControlFlow::Continue(())) {
            Ok(()) => forgotten += 1,
            // Gone meanwhile (it expired or closed): what this wanted.
            Err(error) if error.raw_os_error() == Some(libc::ENOENT) => {}
            Err(error) => return Err(error),
        }
    }
    Ok(forgotten)
}

/// The destination of an original tuple (`CTA_TUPLE_ORIG`'s payload).
fn destination_of(tuple: &[u8]) -> Option<Destination> {
    let ip = attribute(tuple, CTA_TUPLE_IP)?;
    let proto = attribute(tuple, CTA_TUPLE_PROTO)?;
    let addr = attributes(ip).find_map(|(kind, value)| match kind {
        // fail-closed: decoding a reply; an address of another size is no address.
        CTA_IP_V4_DST => <[u8; 4]>::try_from(value).ok().map(IpAddr::from),
        // fail-closed: as above.
        CTA_IP_V6_DST => <[u8; 16]>::try_from(value).ok().map(IpAddr::from),
        _ => None,
    })?;
    let protocol = *attribute(proto, CTA_PROTO_NUM)?.first()?;
    // fail-closed: a reply without a port is no hostPort connection.
    let port = u16::from_be_bytes(attribute(proto, CTA_PROTO_DST_PORT)?.try_into().ok()?);
    Some(Destination {
        addr,
        protocol,
        port,
    })
}

/// Removes the kernel's tracked connections to the hostPorts of `changed`.
pub(super) fn forget_connections(changed: &[ResolvedMapping]) -> Result<(), BackendError> {
    if changed.is_empty() || !tracking_any().map_err(NftablesError::Conntrack)? {
        return Ok(());
    }
    let addresses = host_addresses()?;
    forget(changed, &addresses)
        .map(drop)
        .map_err(|error| NftablesError::Conntrack(error).into())
}

/// The host's addresses, loopback included: where a wildcard hostPort's connections went.
pub(super) fn host_addresses() -> Result<Vec<IpAddr>, BackendError> {
    let mut addresses: Vec<IpAddr> = netlink::addresses()
        .map_err(|source| BackendError::HostAddresses(Box::new(source)))?
        .into_iter()
        .map(|(_, addr)| addr)
        .collect();
    addresses.extend([
        IpAddr::from([127, 0, 0, 1]),
        IpAddr::from(std::net::Ipv6Addr::LOCALHOST),
    ]);
    Ok(addresses)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(kind: u16, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(
            u16::try_from(4 + payload.len())
                .expect("short")
                .to_ne_bytes(),
        );
        out.extend(kind.to_ne_bytes());
        out.extend(payload);
        out.resize(out.len().next_multiple_of(4), 0);
        out
    }

    #[test]
    fn a_tuple_reads_as_its_destination() {
        let ip = [
            attr(1, &[10, 22, 0, 5]),
            attr(CTA_IP_V4_DST, &[203, 0, 113, 1]),
        ]
        .concat();
        let proto = [
            attr(CTA_PROTO_NUM, &[17]),
            attr(2, &40_000u16.to_be_bytes()),
            attr(CTA_PROTO_DST_PORT, &8080u16.to_be_bytes()),
        ]
        .concat();
        let tuple = [
            attr(CTA_TUPLE_IP | NLA_F_NESTED, &ip),
            attr(CTA_TUPLE_PROTO | NLA_F_NESTED, &proto),
        ]
        .concat();
        assert_eq!(
            destination_of(&tuple),
            Some(Destination {
                addr: "203.0.113.1".parse().expect("literal"),
                protocol: 17,
                port: 8080,
            })
        );
        assert_eq!(
            destination_of(&tuple[..8]),
            None,
            "a tuple without its protocol"
        );
    }
}
