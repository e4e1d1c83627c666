//! `connections`: every connection the datapath tracks, one entry each, holding what each
//! feature keeps of it — its masquerade (SNAT), its hostPort translation (DNAT), the filter's
//! verdict — and the one state machine they share ([`conntrack`]).
//!
//! Key: [`ConnectionKey`] — the connection's tuple from its container's side: the container's
//! address and port, the remote's, the same for packets either way (ICMP echo: the identifier
//! is the container's port when it pings, the remote's when it is pinged; a masqueraded echo
//! has remote port 0). Value: [`Connection`] — who owns it, which parts it has
//! ([`PART_SNAT`], [`PART_DNAT`], [`PART_FILTER`], [`PART_HOST_FLOW`]) and each part's fields.
//! Written by the programs: `from_container` and `uplink_egress` when they masquerade,
//! `uplink_ingress` and `from_container` when they translate to a hostPort, the filter when it
//! allows a connection's first packet, the sendmsg hooks when a host socket sends from a
//! hostPort's number; each adds its part to the entry its owner already has. A packet
//! of an established connection finds everything in one lookup. Entries of an attachment are
//! deleted by the CNI plugin on DEL and GC (a part at a time when one capability goes), which
//! also sweep expired ones. An LRU map: when full, the least recently used connection goes.
//!
//! Masquerade replies arrive with another tuple (the uplink's address and port): `masq_replies`
//! finds their connection's key.

pub mod conntrack;
pub mod fragments;

pub use fragments::{FRAGMENTS, FirstFragment, FragmentKey};

use core::mem::offset_of;

use crate::map_spec::{Dimension, MapKind, MapSpec, OwnerField, Sizing};
use crate::{address::Address, impl_pod};

pub const CONNECTIONS: MapSpec =
    MapSpec::new::<ConnectionKey, Connection>("connections", MapKind::LruHash, 65_536)
        .sized(Sizing::Times(Dimension::Flows, 1))
        .owned(OwnerField::Value(offset_of!(Connection, owner)));

/// The maps of connection tracking.
pub const MAPS: [MapSpec; 2] = [CONNECTIONS, FRAGMENTS];

/// [`Connection::parts`]: the container's side is masqueraded (the `nat_*` and
/// `uplink_ifindex` fields).
pub const PART_SNAT: u8 = 1;
/// The remote side reached the container through a hostPort (the `orig_*`, `peer_*` and
/// `gateway_mac` fields).
pub const PART_DNAT: u8 = 2;
/// The filter tracks the connection (`generation`, `rule`, `verdict`, `last_verdict`).
pub const PART_FILTER: u8 = 4;
/// A flow of the host's own ([`HOST`]): an unconnected UDP socket of the host sent a datagram
/// from a port that is a hostPort's number (the key's container side is the socket's address,
/// all zero when it is bound to the wildcard, and its port), so the answers from that remote
/// are the host's, not the hostPort's, as conntrack matches a connection before a DNAT rule.
/// Only the state fields are used.
pub const PART_HOST_FLOW: u8 = 8;

/// [`Connection::flags`]: the connection's packets cross the host stack both ways, where the
/// node's netfilter keeps translating them (it translated the connection's first packet — a
/// Service's `dnat` — or it cannot be asked about the protocol); cnibpf masquerades them at the
/// uplink only. Its owner is the attachment, or [`HOST`] for a host flow moved off a port.
pub const FLAG_THROUGH_STACK: u8 = 1;

/// [`Connection::owner`] of a connection of the host's own (a local socket's): one cnibpf moved
/// to another source port, because a container's masqueraded connection held its own towards
/// the same remote ([`PART_SNAT`]: `nat_*` is the port it leaves with), or one whose answers
/// are the host's although they come to a hostPort's number ([`PART_HOST_FLOW`]). No
/// attachment's owner id is zero.
pub const HOST: u64 = 0;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ConnectionKey {
    pub container_addr: Address,
    pub remote_addr: Address,
    /// Host byte order.
    pub container_port: u16,
    pub remote_port: u16,
    pub protocol: u8,
    pub family: u8,
    pub _pad: u16,
}
const _: () = assert!(size_of::<ConnectionKey>() == 40);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Connection {
    /// Owner id of the attachment on the connection's container side.
    pub owner: u64,
    /// CLOCK_MONOTONIC (coarse) of the last packet either way, refreshed at most once a second
    /// unless the state changes.
    pub last_seen_ns: u64,
    /// Filter: the `generation` of the `filters` entry `verdict` and `rule` were evaluated
    /// under.
    pub generation: u64,
    /// SNAT: the address the container's side is masqueraded to (its uplink's).
    pub nat_addr: Address,
    /// DNAT: the address the client sent to (the replies' new source).
    pub orig_addr: Address,
    /// DNAT: the client's own address (the replies' new destination); differs from the key's
    /// remote only for hairpin traffic a container sent to its own hostPort, whose source was
    /// translated to the gateway.
    pub peer_addr: Address,
    /// SNAT: the uplink the connection leaves through.
    pub uplink_ifindex: u32,
    /// DNAT, hairpin traffic: the client container's host-side veth, the replies are handed
    /// to its peer; zero: the replies are routed.
    pub peer_ifindex: u32,
    /// SNAT: the translated source port (ICMP echo: identifier).
    pub nat_port: u16,
    /// DNAT: the port the client sent to, the replies' new source port.
    pub orig_port: u16,
    /// DNAT: the client's own port, the replies' new destination port.
    pub peer_port: u16,
    /// Filter: the position of the rule deciding the connection's later packets,
    /// `filter::RULE_DEFAULT` for the default verdict.
    pub rule: u16,
    /// DNAT, hairpin traffic: the client container's MAC address.
    pub peer_mac: [u8; 6],
    /// DNAT, hairpin traffic: the gateway MAC the client container expects replies from.
    pub gateway_mac: [u8; 6],
    /// `PART_*` bits.
    pub parts: u8,
    /// The `DIRECTION_*` (`crate::filter`) of the connection's first packet: egress, the
    /// container opened it; ingress, the remote side did.
    pub origin: u8,
    /// `conntrack::STATE_*`.
    pub state: u8,
    /// `conntrack::SIDE_*` bits: which side sent a FIN.
    pub fin: u8,
    /// Filter: `TARGET_*` of the connection's later packets in the originating direction
    /// under `generation`.
    pub verdict: u8,
    /// Filter: `TARGET_*` of the latest packet in the originating direction: replies, and ICMP
    /// errors about the connection, pass while it is ALLOW.
    pub last_verdict: u8,
    /// `FLAG_*` bits.
    pub flags: u8,
    pub _pad: u8,
    pub _pad2: u32,
}
const _: () = assert!(size_of::<Connection>() == 112);

impl Connection {
    pub const fn is_expired(&self, protocol: u8, now_ns: u64) -> bool {
        now_ns.saturating_sub(self.last_seen_ns) > conntrack::timeout_ns(protocol, self.state)
    }

    /// The `conntrack::SIDE_*` of a packet travelling `direction` (`DIRECTION_*`).
    pub const fn side(&self, direction: u8) -> u8 {
        if direction == self.origin {
            conntrack::SIDE_ORIGIN
        } else {
            conntrack::SIDE_REPLY
        }
    }

    /// Whether the entry holds `part` of attachment `owner`.
    pub const fn has(&self, owner: u64, part: u8) -> bool {
        self.owner == owner && self.parts & part != 0
    }

    /// Whether attachment `owner` adds a part to this entry, as a packet with TCP `flags`
    /// (zero for other protocols) found it: its own and live, and not a closed connection
    /// whose tuple opens again — a new connection, which gets an entry of its own.
    pub const fn takes_part(&self, owner: u64, protocol: u8, flags: u8, now_ns: u64) -> bool {
        self.owner == owner && !self.is_expired(protocol, now_ns) && !self.reopened_by(flags)
    }

    /// Whether a packet with TCP `flags` (zero for other protocols) opens a new connection on
    /// the tuple of this closed one.
    pub const fn reopened_by(&self, flags: u8) -> bool {
        self.state == conntrack::STATE_CLOSING && conntrack::is_opening(flags)
    }
}

impl conntrack::Tracked for Connection {
    #[inline(always)]
    fn fields(&mut self) -> (&mut u8, &mut u8, &mut u64) {
        (&mut self.state, &mut self.fin, &mut self.last_seen_ns)
    }
}

impl_pod!(ConnectionKey, Connection);

#[cfg(test)]
mod tests {
    use super::conntrack::{
        SIDE_ORIGIN, SIDE_REPLY, STATE_CLOSING, STATE_ESTABLISHED, STATE_OPENING, TCP_ACK, TCP_SYN,
        UDP_ESTABLISHED_TIMEOUT_NS, UDP_OPENING_TIMEOUT_NS,
    };
    use super::*;
    use crate::{
        PROTO_TCP, PROTO_UDP,
        filter::{DIRECTION_EGRESS, DIRECTION_INGRESS},
    };

    #[test]
    fn a_packets_side_is_told_by_the_connections_origin() {
        let opened_by_container = Connection {
            origin: DIRECTION_EGRESS,
            ..Connection::default()
        };
        assert_eq!(opened_by_container.side(DIRECTION_EGRESS), SIDE_ORIGIN);
        assert_eq!(opened_by_container.side(DIRECTION_INGRESS), SIDE_REPLY);
        let through_a_host_port = Connection {
            origin: DIRECTION_INGRESS,
            ..Connection::default()
        };
        assert_eq!(through_a_host_port.side(DIRECTION_INGRESS), SIDE_ORIGIN);
        assert_eq!(through_a_host_port.side(DIRECTION_EGRESS), SIDE_REPLY);
    }

    #[test]
    fn a_part_is_an_owners() {
        let connection = Connection {
            owner: 7,
            parts: PART_SNAT | PART_FILTER,
            ..Connection::default()
        };
        assert!(connection.has(7, PART_SNAT) && connection.has(7, PART_FILTER));
        assert!(!connection.has(7, PART_DNAT));
        assert!(!connection.has(8, PART_SNAT), "another attachment's");
    }

    #[test]
    fn a_part_joins_its_owners_live_entry_unless_a_closed_tuple_opens_again() {
        let live = Connection {
            owner: 7,
            last_seen_ns: 5,
            state: STATE_ESTABLISHED,
            ..Connection::default()
        };
        assert!(live.takes_part(7, PROTO_TCP, TCP_ACK, 6));
        assert!(
            live.takes_part(7, PROTO_TCP, TCP_SYN, 6),
            "a SYN on a live connection"
        );
        assert!(
            !live.takes_part(8, PROTO_TCP, TCP_ACK, 6),
            "another attachment's"
        );
        assert!(
            !live.takes_part(7, PROTO_UDP, 0, 5 + UDP_ESTABLISHED_TIMEOUT_NS + 1),
            "expired"
        );
        let closed = Connection {
            state: STATE_CLOSING,
            ..live
        };
        assert!(
            closed.takes_part(7, PROTO_TCP, TCP_ACK, 6),
            "the last ACK of a close"
        );
        assert!(
            !closed.takes_part(7, PROTO_TCP, TCP_SYN, 6),
            "a new connection"
        );
        assert!(closed.takes_part(7, PROTO_TCP, TCP_SYN | TCP_ACK, 6));
        assert!(closed.reopened_by(TCP_SYN) && !live.reopened_by(TCP_SYN));
        assert!(!closed.reopened_by(TCP_SYN | TCP_ACK) && !closed.reopened_by(0));
    }

    #[test]
    fn a_connection_expires_by_its_state() {
        let connection = Connection {
            last_seen_ns: 5,
            state: STATE_OPENING,
            ..Connection::default()
        };
        assert!(!connection.is_expired(PROTO_UDP, 5 + UDP_OPENING_TIMEOUT_NS));
        assert!(connection.is_expired(PROTO_UDP, 5 + UDP_OPENING_TIMEOUT_NS + 1));
        assert!(!connection.is_expired(PROTO_TCP, 5 + UDP_OPENING_TIMEOUT_NS + 1));
        // A clock read before the entry was refreshed (another CPU) is no expiry.
        assert!(!connection.is_expired(PROTO_UDP, 0));
    }
}
