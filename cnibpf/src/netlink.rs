//! Blocking rtnetlink dumps of links, addresses and routes in the current thread's network
//! namespace. A one-shot CNI plugin needs a handful of dumps, not an async runtime.

use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use std::net::IpAddr;

use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    address::{AddressAttribute, AddressMessage},
    link::{InfoKind, LinkAttribute, LinkInfo, LinkMessage},
    route::{RouteAttribute, RouteHeader, RouteMessage, RouteType},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("netlink socket")]
    Socket(#[source] std::io::Error),
    #[error("netlink {request} dump failed")]
    Dump {
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

pub fn links() -> Result<Vec<Link>, NetlinkError> {
    let request = RouteNetlinkMessage::GetLink(LinkMessage::default());
    dump("link", request, |message| match message {
        RouteNetlinkMessage::NewLink(link) => Some(link_from_message(link)),
        _ => None,
    })
}

pub fn link_by_name(name: &str) -> Result<Link, NetlinkError> {
    links()?
        .into_iter()
        .find(|link| link.name == name)
        .ok_or_else(|| NetlinkError::NoSuchName(name.to_owned()))
}

pub fn link_by_index(index: u32) -> Result<Link, NetlinkError> {
    links()?
        .into_iter()
        .find(|link| link.index == index)
        .ok_or(NetlinkError::NoSuchIndex(index))
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

fn dump<T>(
    request_name: &'static str,
    request: RouteNetlinkMessage,
    mut keep: impl FnMut(RouteNetlinkMessage) -> Option<T>,
) -> Result<Vec<T>, NetlinkError> {
    let io_error = |source| NetlinkError::Dump {
        request: request_name,
        source,
    };
    let mut socket = Socket::new(NETLINK_ROUTE).map_err(NetlinkError::Socket)?;
    socket.bind_auto().map_err(NetlinkError::Socket)?;
    socket
        .connect(&SocketAddr::new(0, 0))
        .map_err(NetlinkError::Socket)?;

    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_DUMP;
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
                NetlinkPayload::Error(error) => {
                    if let Some(code) = error.code {
                        return Err(io_error(std::io::Error::from_raw_os_error(-code.get())));
                    }
                }
                NetlinkPayload::InnerMessage(inner) => out.extend(keep(inner)),
                _ => {}
            }
        }
    }
}
