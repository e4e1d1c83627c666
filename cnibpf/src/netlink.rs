//! Blocking rtnetlink dumps of links, addresses and routes in the current thread's network
//! namespace. A one-shot CNI plugin needs a handful of dumps, not an async runtime.

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_DUMP, NLM_F_ECHO, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use std::net::IpAddr;

use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    address::{AddressAttribute, AddressMessage},
    link::{
        InfoBridge, InfoBridgePort, InfoData, InfoKind, InfoPortData, InfoPortKind, LinkAttribute,
        LinkInfo, LinkMessage,
    },
    route::{RouteAttribute, RouteHeader, RouteMessage, RouteType},
    tc::{TcAttribute, TcHandle, TcMessage},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("netlink socket")]
    Socket(#[source] std::io::Error),
    #[error("netlink {request} request failed")]
    Request {
        request: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("undecodable netlink {request} reply: {reason}")]
    Decode {
        request: &'static str,
        reason: String,
    },
    #[error("no interface named {0:?}")]
    NoSuchName(String),
    #[error("no interface with index {0}")]
    NoSuchIndex(u32),
}

/// What cnibpf needs to know about an interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    /// `veth`, `bridge`, ... as the kernel reports it; `None` for plain devices.
    pub kind: Option<String>,
    /// `IFLA_LINK`: for a veth, the peer's index (in the peer's namespace).
    pub peer_index: Option<u32>,
    /// Index of the bridge (or other master) the interface is enslaved to.
    pub master: Option<u32>,
    pub mac: Option<[u8; 6]>,
}

/// One interface by name, asked of the kernel directly (a dump of every link costs
/// milliseconds on a host with a thousand containers).
pub fn link_by_name(name: &str) -> Result<Link, NetlinkError> {
    let mut message = LinkMessage::default();
    message
        .attributes
        .push(LinkAttribute::IfName(name.to_owned()));
    get_link(message).map_err(|error| match error {
        NetlinkError::Request { ref source, .. } if source.raw_os_error() == Some(libc::ENODEV) => {
            NetlinkError::NoSuchName(name.to_owned())
        }
        other => other,
    })
}

/// One interface by index.
pub fn link_by_index(index: u32) -> Result<Link, NetlinkError> {
    let mut message = LinkMessage::default();
    message.header.index = index;
    get_link(message).map_err(|error| match error {
        NetlinkError::Request { ref source, .. } if source.raw_os_error() == Some(libc::ENODEV) => {
            NetlinkError::NoSuchIndex(index)
        }
        other => other,
    })
}

/// The interface `index`; `None` when the kernel says there is none (ENODEV), the only answer
/// that means gone.
pub fn link_if_there(index: u32) -> Result<Option<Link>, NetlinkError> {
    match link_by_index(index) {
        Ok(link) => Ok(Some(link)),
        Err(NetlinkError::NoSuchIndex(_)) => Ok(None),
        Err(error) => Err(error),
    }
}

/// The interface `name`; `None` when the kernel says there is none.
pub fn link_if_there_by_name(name: &str) -> Result<Option<Link>, NetlinkError> {
    match link_by_name(name) {
        Ok(link) => Ok(Some(link)),
        Err(NetlinkError::NoSuchName(_)) => Ok(None),
        Err(error) => Err(error),
    }
}

/// The index of interface `name`; `None` when the kernel says there is none.
pub fn index_of(name: &str) -> Result<Option<u32>, NetlinkError> {
    Ok(link_if_there_by_name(name)?.map(|link| link.index))
}

fn get_link(message: LinkMessage) -> Result<Link, NetlinkError> {
    let request = RouteNetlinkMessage::GetLink(message);
    let links = exchange("link", request, NLM_F_ACK, |message| match message {
        RouteNetlinkMessage::NewLink(link) => Some(link_from_message(link)),
        _ => None,
    })?;
    links
        .into_iter()
        .next()
        .ok_or_else(|| NetlinkError::Decode {
            request: "link",
            reason: "no link in the reply".to_owned(),
        })
}

/// Every interface of the current namespace.
pub fn links() -> Result<Vec<Link>, NetlinkError> {
    let request = RouteNetlinkMessage::GetLink(LinkMessage::default());
    dump("link", request, |message| match message {
        RouteNetlinkMessage::NewLink(link) => Some(link_from_message(link)),
        _ => None,
    })
}

/// Whether the bridge `index` hands its bridged IPv4 and IPv6 traffic to the IP hooks
/// (`nf_call_iptables`, `nf_call_ip6tables`; br_netfilter must be loaded for either to matter).
pub fn bridge_netfilter(index: u32) -> Result<(bool, bool), NetlinkError> {
    let mut message = LinkMessage::default();
    message.header.index = index;
    let request = RouteNetlinkMessage::GetLink(message);
    let found = exchange("link", request, NLM_F_ACK, |message| match message {
        RouteNetlinkMessage::NewLink(link) => Some(link.attributes),
        _ => None,
    })?;
    let mut settings = (false, false);
    for attribute in found.into_iter().flatten() {
        let LinkAttribute::LinkInfo(infos) = attribute else {
            continue;
        };
        for info in infos {
            if let LinkInfo::Data(InfoData::Bridge(options)) = info {
                for option in options {
                    match option {
                        InfoBridge::NfCallIpTables(on) => settings.0 = on,
                        InfoBridge::NfCallIp6Tables(on) => settings.1 = on,
                        _ => {}
                    }
                }
            }
        }
    }
    Ok(settings)
}

/// Switches both of [`bridge_netfilter`]'s settings of bridge `index`.
pub fn set_bridge_netfilter(index: u32, on: bool) -> Result<(), NetlinkError> {
    let mut message = LinkMessage::default();
    message.header.index = index;
    message.attributes.push(LinkAttribute::LinkInfo(vec![
        LinkInfo::Kind(InfoKind::Bridge),
        LinkInfo::Data(InfoData::Bridge(vec![
            InfoBridge::NfCallIpTables(on),
            InfoBridge::NfCallIp6Tables(on),
        ])),
    ]));
    // RTM_NEWLINK on an existing interface, without NLM_F_CREATE, changes its kind's settings
    // (as `ip link set … type bridge …` does); RTM_SETLINK ignores them.
    let request = RouteNetlinkMessage::NewLink(message);
    exchange("link settings", request, NLM_F_ACK, |_| None::<()>).map(|_| ())
}

/// Switches hairpin mode on (or off) for the bridge port `index`: frames may then be sent back
/// out of the port they came in by (as `ip link set … type bridge_slave hairpin on`).
pub fn set_bridge_port_hairpin(index: u32, on: bool) -> Result<(), NetlinkError> {
    let mut message = LinkMessage::default();
    message.header.index = index;
    message.attributes.push(LinkAttribute::LinkInfo(vec![
        LinkInfo::PortKind(InfoPortKind::Bridge),
        LinkInfo::PortData(InfoPortData::BridgePort(vec![InfoBridgePort::HairpinMode(
            on,
        )])),
    ]));
    // RTM_NEWLINK on an existing interface changes its port settings (RTM_SETLINK ignores them).
    let request = RouteNetlinkMessage::NewLink(message);
    exchange("bridge port settings", request, NLM_F_ACK, |_| None::<()>).map(|_| ())
}

/// Every address of every interface, with the interface's index.
pub fn addresses() -> Result<Vec<(u32, IpAddr)>, NetlinkError> {
    let request = RouteNetlinkMessage::GetAddress(AddressMessage::default());
    let all = dump("address", request, |message| match message {
        RouteNetlinkMessage::NewAddress(message) => Some(address_from_message(&message)),
        _ => None,
    })?;
    Ok(all.into_iter().flatten().collect())
}

/// The IPv6 addresses of interface `index` alone: the kernel filters the dump (strict
/// checking), so a namespace with many interfaces costs no more than one with a few.
pub fn ipv6_addresses_of(index: u32) -> Result<Vec<IpAddr>, NetlinkError> {
    let mut message = AddressMessage::default();
    message.header.family = AddressFamily::Inet6;
    message.header.index = index;
    let all = exchange_with(
        "address",
        RouteNetlinkMessage::GetAddress(message),
        NLM_F_DUMP,
        true,
        |message| match message {
            RouteNetlinkMessage::NewAddress(message) => address_from_message(&message),
            _ => None,
        },
    )?;
    Ok(all
        .into_iter()
        .filter(|(owner, _)| *owner == index)
        .map(|(_, address)| address)
        .collect())
}

/// IFA_LOCAL is the interface's own address on point-to-point links, IFA_ADDRESS otherwise.
fn address_from_message(message: &AddressMessage) -> Option<(u32, IpAddr)> {
    let local = message
        .attributes
        .iter()
        .find_map(|attribute| match attribute {
            AddressAttribute::Local(addr) => Some(*addr),
            _ => None,
        });
    let address = message
        .attributes
        .iter()
        .find_map(|attribute| match attribute {
            AddressAttribute::Address(addr) => Some(*addr),
            _ => None,
        });
    Some((message.header.index, local.or(address)?))
}

/// Indexes of the devices of the default routes (IPv4 and IPv6) in the main table.
pub fn default_route_links() -> Result<Vec<u32>, NetlinkError> {
    let mut indexes = Vec::new();
    for family in [AddressFamily::Inet, AddressFamily::Inet6] {
        let mut message = RouteMessage::default();
        message.header.address_family = family;
        let request = RouteNetlinkMessage::GetRoute(message);
        let routes = dump("route", request, |message| match message {
            RouteNetlinkMessage::NewRoute(route) => Some(route),
            _ => None,
        })?;
        for route in routes {
            let is_default = route.header.destination_prefix_length == 0
                && route.header.kind == RouteType::Unicast
                && route_table(&route) == u32::from(RouteHeader::RT_TABLE_MAIN);
            if !is_default {
                continue;
            }
            for attribute in &route.attributes {
                match attribute {
                    RouteAttribute::Oif(index) => indexes.push(*index),
                    RouteAttribute::MultiPath(hops) => {
                        indexes.extend(hops.iter().map(|hop| hop.interface_index));
                    }
                    _ => {}
                }
            }
        }
    }
    indexes.sort_unstable();
    indexes.dedup();
    Ok(indexes)
}

fn route_table(route: &RouteMessage) -> u32 {
    route
        .attributes
        .iter()
        .find_map(|attribute| match attribute {
            RouteAttribute::Table(table) => Some(*table),
            _ => None,
        })
        // fail-closed: decoding a reply: without the attribute the header holds the table.
        .unwrap_or(u32::from(route.header.table))
}

fn link_from_message(message: LinkMessage) -> Link {
    let mut link = Link {
        index: message.header.index,
        name: String::new(),
        kind: None,
        peer_index: None,
        master: None,
        mac: None,
    };
    for attribute in message.attributes {
        match attribute {
            LinkAttribute::IfName(name) => link.name = name,
            LinkAttribute::Link(peer) => link.peer_index = Some(peer),
            LinkAttribute::Controller(master) => link.master = Some(master),
            // fail-closed: decoding a reply: an address not 6 bytes long is no MAC.
            LinkAttribute::Address(bytes) => link.mac = <[u8; 6]>::try_from(bytes.as_slice()).ok(),
            LinkAttribute::LinkInfo(infos) => {
                link.kind = infos.into_iter().find_map(|info| match info {
                    LinkInfo::Kind(InfoKind::Veth) => Some("veth".to_owned()),
                    LinkInfo::Kind(InfoKind::Bridge) => Some("bridge".to_owned()),
                    LinkInfo::Kind(kind) => Some(kind.to_string()),
                    _ => None,
                });
            }
            _ => {}
        }
    }
    link
}

/// The qdiscs someone put on an interface (its default root qdisc, `noqueue`, and the
/// placeholder `noop` aside), by kind (`tbf`, `ingress`, `clsact`, …): its root and its
/// ingress qdisc, asked for by name. A dump
/// would carry every qdisc of the host (the kernel does not limit it to one interface).
pub fn added_qdiscs(ifindex: u32) -> Result<Vec<String>, NetlinkError> {
    let index = ifindex_i32(ifindex);
    let mut kinds = Vec::new();
    for parent in [TcHandle::ROOT, TcHandle::INGRESS] {
        let mut message = TcMessage::with_index(index);
        message.header.parent = parent;
        let request = RouteNetlinkMessage::GetQueueDiscipline(message);
        // The kernel sends a qdisc it was asked for to its multicast group, and to the asker
        // only when asked to echo.
        let found = exchange(
            "qdisc",
            request,
            NLM_F_ACK | NLM_F_ECHO,
            |message| match message {
                RouteNetlinkMessage::NewQueueDiscipline(qdisc) if qdisc.header.index == index => {
                    qdisc
                        .attributes
                        .iter()
                        .find_map(|attribute| match attribute {
                            TcAttribute::Kind(kind) if kind != "noqueue" && kind != "noop" => {
                                Some(kind.clone())
                            }
                            _ => None,
                        })
                }
                _ => None,
            },
        );
        match found {
            Ok(found) => kinds.extend(found),
            // No ingress qdisc, or the interface is gone: nothing is there.
            Err(NetlinkError::Request { source, .. })
                if matches!(source.raw_os_error(), Some(libc::ENOENT | libc::ENODEV)) => {}
            Err(error) => return Err(error),
        }
    }
    Ok(kinds)
}

fn ifindex_i32(ifindex: u32) -> i32 {
    // fail-closed: no kernel result; interface indexes are positive i32s.
    i32::try_from(ifindex).unwrap_or(i32::MAX)
}

fn dump<T>(
    request_name: &'static str,
    request: RouteNetlinkMessage,
    keep: impl FnMut(RouteNetlinkMessage) -> Option<T>,
) -> Result<Vec<T>, NetlinkError> {
    exchange(request_name, request, NLM_F_DUMP, keep)
}

/// Sends one request and collects what `keep` takes from the replies, until the dump's end or
/// the request's acknowledgement.
fn exchange<T>(
    request_name: &'static str,
    request: RouteNetlinkMessage,
    flags: u16,
    keep: impl FnMut(RouteNetlinkMessage) -> Option<T>,
) -> Result<Vec<T>, NetlinkError> {
    exchange_with(request_name, request, flags, false, keep)
}

/// [`exchange`], with the kernel's strict checking of the request when `strict` (which makes
/// it honour a dump's filter fields).
fn exchange_with<T>(
    request_name: &'static str,
    request: RouteNetlinkMessage,
    flags: u16,
    strict: bool,
    mut keep: impl FnMut(RouteNetlinkMessage) -> Option<T>,
) -> Result<Vec<T>, NetlinkError> {
    let io_error = |source| NetlinkError::Request {
        request: request_name,
        source,
    };
    let mut socket = Socket::new(NETLINK_ROUTE).map_err(NetlinkError::Socket)?;
    if strict {
        socket
            .set_netlink_get_strict_chk(true)
            .map_err(NetlinkError::Socket)?;
    }
    socket.bind_auto().map_err(NetlinkError::Socket)?;
    socket
        .connect(&SocketAddr::new(0, 0))
        .map_err(NetlinkError::Socket)?;

    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | flags;
    header.sequence_number = 1;
    let mut message = NetlinkMessage::new(header, NetlinkPayload::from(request));
    message.finalize();
    let mut buffer = vec![0; message.buffer_len()];
    message.serialize(&mut buffer);
    socket.send(&buffer, 0).map_err(io_error)?;

    let mut out = Vec::new();
    loop {
        let (reply, _) = socket.recv_from_full().map_err(io_error)?;
        let mut offset = 0;
        while offset < reply.len() {
            let message = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&reply[offset..])
                .map_err(|error| NetlinkError::Decode {
                    request: request_name,
                    reason: error.to_string(),
                })?;
            let length = message.header.length as usize;
            if length == 0 {
                return Err(NetlinkError::Decode {
                    request: request_name,
                    reason: "zero-length message".to_owned(),
                });
            }
            offset += length;
            match message.payload {
                NetlinkPayload::Done(_) => return Ok(out),
                NetlinkPayload::Error(error) => match error.code {
                    Some(code) => {
                        return Err(io_error(std::io::Error::from_raw_os_error(-code.get())));
                    }
                    // The acknowledgement of a request that is not a dump.
                    None => return Ok(out),
                },
                NetlinkPayload::InnerMessage(inner) => out.extend(keep(inner)),
                _ => {}
            }
        }
    }
}
