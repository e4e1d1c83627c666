//! `filter_hits`: per-rule packet and byte counters of each filtered attachment.
//!
//! A per-CPU hash map (`BPF_F_NO_PREALLOC`: only filtered attachments cost memory). Key: `u32`
//! ifindex of the host-side veth, as `filters`. Value: [`FilterHits`] — one counter pair per
//! rule position and one for the default verdict. Created zeroed by the CNI plugin whenever it
//! writes different rules, removed with the `filters` entry; incremented by the programs for
//! every packet a rule (or the default) decides — the first packet of a connection and its
//! later packets in the originating direction; replies pass by state and count nowhere.

use crate::map_spec::{Dimension, MapKind, MapSpec, Sizing};
use crate::{filter::MAX_RULES, impl_pod};

pub const HITS: MapSpec =
    MapSpec::new::<u32, FilterHits>("filter_hits", MapKind::PerCpuHash, 4_096)
        .sized(Sizing::Times(Dimension::Attachments, 1));
/// Position of the default verdict's counters.
pub const DEFAULT_SLOT: usize = MAX_RULES;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleHits {
    pub packets: u64,
    pub bytes: u64,
}
const _: () = assert!(size_of::<RuleHits>() == 16);

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FilterHits {
    /// By rule position in the `filters` entry; `[DEFAULT_SLOT]` for the default verdict.
    pub rules: [RuleHits; MAX_RULES + 1],
}
const _: () = assert!(size_of::<FilterHits>() == 16 * (MAX_RULES + 1));

impl Default for FilterHits {
    fn default() -> Self {
        Self {
            rules: [RuleHits::default(); MAX_RULES + 1],
        }
    }
}

impl_pod!(RuleHits, FilterHits);
