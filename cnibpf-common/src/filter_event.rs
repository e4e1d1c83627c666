//! `filter_events`: a ring buffer of packets the filter or source address verification
//! dropped, for `cnibpf monitor`.
//!
//! Records: [`FilterEvent`]. Written by the programs for every dropped packet while there is
//! room (when the reader falls behind, records are lost and counted in `filter_stats`); read by
//! `cnibpf monitor`, which resolves the owner to its network, container and interface.

use crate::impl_pod;

pub const MAP_NAME: &str = "filter_events";
/// Bytes of the ring (a power of two of pages): about 3,000 events.
pub const RING_BYTES: u32 = 256 * 1024;

/// [`FilterEvent::reason`]: a rule with [`FilterEvent::rule_index`] dropped the packet.
pub const REASON_RULE: u8 = 1;
/// The default verdict dropped it.
pub const REASON_DEFAULT: u8 = 2;
/// A later fragment whose first fragment was not let through.
pub const REASON_FRAGMENT: u8 = 3;
/// Source address verification dropped it: the container sent it from an address not its own
/// (see `sources`); `protocol` is zero for an ARP packet or a frame that is neither IP nor ARP.
pub const REASON_SPOOFED: u8 = 4;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FilterEvent {
    /// CLOCK_MONOTONIC (coarse) when the packet was dropped.
    pub time_ns: u64,
    /// Owner id of the attachment.
    pub owner: u64,
    pub src_addr: [u8; 16],
    pub dst_addr: [u8; 16],
    /// The container's host-side veth.
    pub ifindex: u32,
    /// `index` of the rule that dropped it (with [`REASON_RULE`]).
    pub rule_index: u32,
    /// Host byte order; an ICMP echo's identifier stands in the port of the side that chose
    /// it, as in `filter_flows`.
    pub src_port: u16,
    pub dst_port: u16,
    pub protocol: u8,
    pub family: u8,
    /// `DIRECTION_*` of the packet.
    pub direction: u8,
    /// `REASON_*`.
    pub reason: u8,
}
const _: () = assert!(size_of::<FilterEvent>() == 64);

impl_pod!(FilterEvent);
