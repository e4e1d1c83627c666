//! `filter_matches`: a ring buffer of the connections rules with `log` decided, for `cnibpf
//! monitor --matches`; `match_event_budget` limits how many each CPU writes.
//!
//! Records: [`MatchEvent`], one per new connection (not per packet) a rule with `log` decides,
//! whatever its verdict. Written by the programs while their CPU's [`MatchEventBudget`] allows
//! (what it holds back is counted there) and the ring has room (records the reader did not
//! take in time are counted as lost in `filter_stats`); read by `cnibpf monitor --matches`.

use crate::{
    address::Address,
    impl_pod,
    map_spec::{MapKind, MapSpec},
};

/// A ring of 256 KiB (its `max_entries` are bytes): about 3,000 events.
pub const MATCH_EVENTS: MapSpec =
    MapSpec::new::<(), MatchEvent>("filter_matches", MapKind::RingBuf, 256 * 1024);

pub const MATCH_EVENT_BUDGET: MapSpec =
    MapSpec::new::<u32, MatchEventBudget>("match_event_budget", MapKind::PerCpuArray, 1);

/// Events a CPU may write in a burst, and one more per this many nanoseconds: 1,000 a second.
pub const MATCH_BURST: u64 = 256;
pub const NS_PER_MATCH: u64 = 1_000_000;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MatchEvent {
    /// CLOCK_MONOTONIC (coarse) of the connection's first packet.
    pub time_ns: u64,
    /// Owner id of the attachment.
    pub owner: u64,
    pub src_addr: Address,
    pub dst_addr: Address,
    /// The container's host-side veth.
    pub ifindex: u32,
    /// `index` of the rule.
    pub rule_index: u32,
    /// Host byte order.
    pub src_port: u16,
    pub dst_port: u16,
    pub protocol: u8,
    pub family: u8,
    /// `DIRECTION_*` of the connection's first packet.
    pub direction: u8,
    /// The rule's `TARGET_*`.
    pub target: u8,
}
const _: () = assert!(size_of::<MatchEvent>() == 64);

/// A per-CPU array. Key: `u32` index 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MatchEventBudget {
    pub tokens: u64,
    pub refilled_ns: u64,
    /// Match events not written because the budget was spent.
    pub suppressed: u64,
}
const _: () = assert!(size_of::<MatchEventBudget>() == 24);

impl MatchEventBudget {
    /// Whether one event may be written at `now_ns`; counts it suppressed if not.
    #[inline(always)]
    pub fn spend(&mut self, now_ns: u64) -> bool {
        let spent = crate::drops::budget::take(
            &mut self.tokens,
            &mut self.refilled_ns,
            now_ns,
            MATCH_BURST,
            NS_PER_MATCH,
        );
        if !spent {
            self.suppressed += 1;
        }
        spent
    }
}

impl_pod!(MatchEvent, MatchEventBudget);
