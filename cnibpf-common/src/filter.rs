//! `filters`: each filtered attachment's rules, in evaluation order.
//!
//! Key: `u32` ifindex of the container's host-side veth (the interface every filtered packet
//! is attributed to). Value: [`FilterSet`] — the rules sorted by ascending `index`, the default
//! verdict and a generation. Written whole by the CNI plugin on ADD (an update of a hash map
//! created with `BPF_F_NO_PREALLOC` swaps the element under RCU: a packet sees the old set or
//! the new one, never a mix), removed on DEL and GC and when an ADD leaves the attachment
//! unfiltered (no rules, default ALLOW): an attachment without an entry is not filtered at all.
//! Read by every program that delivers a packet to or takes one from a container.

use crate::impl_pod;

pub const MAP_NAME: &str = "filters";
pub const MAX_ENTRIES: u32 = 4_096;
/// Rules one attachment may have.
pub const MAX_RULES: usize = 256;

/// [`FilterRule::target`] and [`FilterSet::default_target`].
pub const TARGET_ALLOW: u8 = 1;
pub const TARGET_DROP: u8 = 2;

/// [`FilterRule::direction`] bits, and the direction of a packet: towards the container
/// (ingress) or from it (egress).
pub const DIRECTION_INGRESS: u8 = 1;
pub const DIRECTION_EGRESS: u8 = 2;

/// [`FilterRule::connstate`] bits.
pub const CONNSTATE_NEW: u8 = 1;
pub const CONNSTATE_ESTABLISHED: u8 = 2;

/// [`FilterRule::src_prefix`] / [`FilterRule::dst_prefix`] of a rule that names no address.
pub const NO_PREFIX: u8 = u8::MAX;

/// One rule. Addresses are stored masked, with their masks, so that matching is four word
/// compares; a rule without `src` (`dst`) has an all-zero address and mask there, which every
/// address matches. Ports are host byte order, `0..=65535` when the rule names none.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FilterRule {
    pub src_addr: [u8; 16],
    pub src_mask: [u8; 16],
    pub dst_addr: [u8; 16],
    pub dst_mask: [u8; 16],
    /// The rule's `index` in the configuration (shown in events and by inspect).
    pub index: u32,
    pub sport_low: u16,
    pub sport_high: u16,
    pub dport_low: u16,
    pub dport_high: u16,
    /// `FAMILY_IPV4`, `FAMILY_IPV6`, or 0 for a rule that names no address nor ICMP version.
    pub family: u8,
    /// IANA protocol number, 0 for any.
    pub protocol: u8,
    /// `CONNSTATE_*` bits the rule matches.
    pub connstate: u8,
    /// `DIRECTION_*` bits the rule matches.
    pub direction: u8,
    /// `TARGET_*`.
    pub target: u8,
    /// Prefix length of `src` as configured, [`NO_PREFIX`] for a rule without `src` (for
    /// people and userspace; the programs match on the mask).
    pub src_prefix: u8,
    pub dst_prefix: u8,
    pub _pad: u8,
}
const _: () = assert!(size_of::<FilterRule>() == 84);

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FilterSet {
    /// Owner id of the attachment.
    pub owner: u64,
    /// Changes whenever the rules do (CLOCK_MONOTONIC nanoseconds of the write): verdicts
    /// cached in `filter_flows` under another generation are evaluated again.
    pub generation: u64,
    /// Rules in use, from the start of `rules`.
    pub rule_count: u32,
    /// `TARGET_*` when no rule matches.
    pub default_target: u8,
    pub _pad: [u8; 3],
    pub rules: [FilterRule; MAX_RULES],
}
const _: () = assert!(size_of::<FilterSet>() == 24 + 84 * MAX_RULES);

impl Default for FilterSet {
    fn default() -> Self {
        Self {
            owner: 0,
            generation: 0,
            rule_count: 0,
            default_target: TARGET_ALLOW,
            _pad: [0; 3],
            rules: [FilterRule::default(); MAX_RULES],
        }
    }
}

impl_pod!(FilterRule, FilterSet);
