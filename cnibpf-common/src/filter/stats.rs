//! `filter_stats`: per-CPU counters of the filter.
//!
//! A per-CPU array. Key: `u32` index 0. Value: [`FilterStats`]. Written by the programs only;
//! `cnibpf inspect` sums the CPUs.

use crate::impl_pod;
use crate::map_spec::{MapKind, MapSpec};

pub const STATS: MapSpec =
    MapSpec::new::<u32, FilterStats>("filter_stats", MapKind::PerCpuArray, 1);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FilterStats {
    /// Connections whose tracking entry was created.
    pub flows_created: u64,
    /// Drop events that found `filter_events` full.
    pub events_lost: u64,
}
const _: () = assert!(size_of::<FilterStats>() == 16);

impl_pod!(FilterStats);
