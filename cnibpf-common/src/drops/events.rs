//! `filter_events`: a ring buffer of the packets the datapath dropped, for `cnibpf monitor`.
//! (Named for its first writer, the filter: the name is part of the pinned layout.)
//!
//! Records: [`FilterEvent`]. Written by the programs for a dropped packet while their CPU's
//! `drop_event_budget` allows (what it holds back is counted there) and the ring has room (when
//! the reader falls behind, records are lost and counted in `filter_stats`); read by `cnibpf
//! monitor`, which resolves the owner to its network, container and interface.

#[cfg(doc)]
use crate::drops::DropReason;
use crate::{
    address::Address,
    impl_pod,
    map_spec::{MapKind, MapSpec},
};

/// A ring of 256 KiB (its `max_entries` are bytes, a power of two of pages): about 3,000
/// events.
pub const EVENTS: MapSpec =
    MapSpec::new::<(), FilterEvent>("filter_events", MapKind::RingBuf, 256 * 1024);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FilterEvent {
    /// CLOCK_MONOTONIC (coarse) when the packet was dropped.
    pub time_ns: u64,
    /// Owner id of the attachment; zero when the packet could not be tied to one (a rewrite
    /// that failed on an uplink).
    pub owner: u64,
    pub src_addr: Address,
    pub dst_addr: Address,
    /// The container's host-side veth, or the uplink where it was dropped.
    pub ifindex: u32,
    /// `index` of the rule that dropped it (with [`DropReason::FilterRule`]).
    pub rule_index: u32,
    /// Host byte order; an ICMP echo's identifier stands in the port of the side that chose
    /// it, as in `connections`.
    pub src_port: u16,
    pub dst_port: u16,
    pub protocol: u8,
    pub family: u8,
    /// `DIRECTION_*` of the packet.
    pub direction: u8,
    /// A [`DropReason`] value. Addresses, ports and protocol are zero where the packet could
    /// not be read (`FilterUnreadable`, `RewriteFailed`, `SourceCheckNotIp`).
    pub reason: u8,
}
const _: () = assert!(size_of::<FilterEvent>() == 64);

impl_pod!(FilterEvent);
