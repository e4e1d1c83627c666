//! `filter_flows`: connection tracking of the filter, per attachment.
//!
//! Key: [`FilterFlowKey`] — the attachment's host-side ifindex and the connection's tuple from
//! the container's side (its own address and port, the remote's), the same for packets either
//! way, so one lookup finds a packet's connection. ICMP echo: the identifier is the container's
//! port when the container pings, the remote's when it is pinged. Value: [`FilterFlow`] — who
//! opened it, the verdict of its later packets under the rules of one generation, and its state.
//! Created by the programs when the first packet of a connection is allowed; updated by its
//! later packets; entries of an attachment are deleted by the CNI plugin on DEL and GC, which
//! also sweep expired ones. An LRU map: when full, the least recently used connection goes.
//! Timeouts are those of `masq_flows` ([`crate::masq_flow::timeout_ns`]).

use crate::{impl_pod, masq_flow};

pub const MAP_NAME: &str = "filter_flows";
pub const MAX_ENTRIES: u32 = 65_536;

/// [`FilterFlow::rule`] when the default verdict decided.
pub const RULE_DEFAULT: u16 = u16::MAX;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FilterFlowKey {
    pub container_addr: [u8; 16],
    pub remote_addr: [u8; 16],
    /// The container's host-side veth.
    pub ifindex: u32,
    /// Host byte order.
    pub container_port: u16,
    pub remote_port: u16,
    pub protocol: u8,
    pub family: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(size_of::<FilterFlowKey>() == 44);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FilterFlow {
    /// Owner id of the attachment.
    pub owner: u64,
    /// `generation` of the `filters` entry `verdict` and `rule` were evaluated under.
    pub generation: u64,
    /// CLOCK_MONOTONIC (coarse) of the last packet either way, refreshed at most once a second
    /// unless the state changes.
    pub last_seen_ns: u64,
    /// Position in the rule set of the rule deciding the connection's later packets,
    /// [`RULE_DEFAULT`] for the default verdict.
    pub rule: u16,
    /// `DIRECTION_*` of the connection's first packet.
    pub origin: u8,
    /// `TARGET_*` of the connection's later packets in the originating direction under
    /// `generation`.
    pub verdict: u8,
    /// `masq_flow::STATE_*`.
    pub state: u8,
    /// `masq_flow::FIN_FROM_*` bits, "container" read as the originating side.
    pub fin: u8,
    /// `TARGET_*` of the latest packet in the originating direction: replies, and ICMP errors
    /// about the connection, pass while it is ALLOW.
    pub last_verdict: u8,
    pub _pad: u8,
}
const _: () = assert!(size_of::<FilterFlow>() == 32);

impl FilterFlow {
    pub const fn is_expired(&self, protocol: u8, now_ns: u64) -> bool {
        now_ns.saturating_sub(self.last_seen_ns) > masq_flow::timeout_ns(protocol, self.state)
    }
}

impl_pod!(FilterFlowKey, FilterFlow);
