//! `filters`: each filtered attachment's rules, in evaluation order.
//!
//! Key: `u32` ifindex of the container's host-side veth (the interface every filtered packet
//! is attributed to). Value: [`FilterSet`] — the rules sorted by ascending `index`, the default
//! verdict and a generation. Version 2: a rule names the networks its source and destination
//! must belong to (`network_members`) and carries flags (`log`). Written whole by the CNI plugin on ADD (an update of a hash map
//! created with `BPF_F_NO_PREALLOC` swaps the element under RCU: a packet sees the old set or
//! the new one, never a mix), removed on DEL and GC and when an ADD leaves the attachment
//! unfiltered (no rules, default ALLOW): an attachment without an entry is not filtered at all.
//! Read by every program that delivers a packet to or takes one from a container.

pub mod answers;
pub mod hits;
pub mod matches;
pub mod networks;
pub mod stats;

pub use answers::{ANSWER_BUDGETS, ANSWER_PROGRAMS, AnswerBudget};
pub use hits::{FilterHits, HITS, RuleHits};
pub use matches::{MATCH_EVENT_BUDGET, MATCH_EVENTS, MatchEvent, MatchEventBudget};
pub use networks::{NETWORK_MEMBERS, NETWORK_NAMES, NetworkMember, NetworkMemberKey, NetworkName};
pub use stats::{FilterStats, STATS};

use core::mem::offset_of;

use crate::map_spec::{Dimension, MapKind, MapSpec, OwnerField, Sizing};
use crate::{address::Address, impl_pod};

pub const FILTERS: MapSpec = MapSpec::new::<u32, FilterSet>("filters", MapKind::Hash, 4_096)
    .sized(Sizing::Times(Dimension::Attachments, 1))
    .owned(OwnerField::Value(offset_of!(FilterSet, owner)))
    .at_version(2);

/// The maps of the filter.
pub const MAPS: [MapSpec; 9] = [
    FILTERS,
    HITS,
    STATS,
    NETWORK_MEMBERS,
    NETWORK_NAMES,
    ANSWER_BUDGETS,
    ANSWER_PROGRAMS,
    MATCH_EVENTS,
    MATCH_EVENT_BUDGET,
];
/// Rules one attachment may have.
pub const MAX_RULES: usize = 256;

/// A connection's rule position (`connections`' `rule`, a drop's) when the default verdict
/// decided.
pub const RULE_DEFAULT: u16 = u16::MAX;

/// [`FilterRule::target`] and [`FilterSet::default_target`].
pub const TARGET_ALLOW: u8 = 1;
pub const TARGET_DROP: u8 = 2;
/// Dropped, and answered: a TCP segment that opens a connection with a reset, anything else
/// with an ICMP or ICMPv6 "administratively prohibited" (see `answers`).
pub const TARGET_REJECT: u8 = 3;

/// [`FilterRule::flags`]: each new connection the rule decides is reported in
/// `filter_matches`.
pub const RULE_LOG: u8 = 1;

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
    pub src_addr: Address,
    pub src_mask: Address,
    pub dst_addr: Address,
    pub dst_mask: Address,
    /// The id of the network (`network_members`) the source must be an address of; 0 for a
    /// rule that names none (`srcNetwork`).
    pub src_network: u64,
    /// The same of the destination (`dstNetwork`).
    pub dst_network: u64,
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
    /// `RULE_*` bits.
    pub flags: u8,
    pub _pad: u32,
}
const _: () = assert!(size_of::<FilterRule>() == 104);
const _: () = assert!(offset_of!(FilterRule, src_network) == 64);
const _: () = assert!(offset_of!(FilterRule, index) == 80);
const _: () = assert!(offset_of!(FilterSet, rules) == 24);

/// A version 1 rule's bytes (84 of them): the addresses and masks, then from `index` to the
/// last byte, where version 2 has the networks between.
pub const RULE_V1_SIZE: usize = 84;

/// [`FilterSet::changed`] of rules a live change set.
pub const CHANGED_LIVE: u8 = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FilterSet {
    /// Owner id of the attachment.
    pub owner: u64,
    /// Changes whenever the rules do (CLOCK_MONOTONIC nanoseconds of the write): verdicts
    /// cached in `connections` under another generation are evaluated again.
    pub generation: u64,
    /// Rules in use, from the start of `rules`.
    pub rule_count: u32,
    /// `TARGET_*` when no rule matches.
    pub default_target: u8,
    /// [`CHANGED_LIVE`] when `cnibpf filter apply` set these rules, which are the attachment's
    /// from then on (CHECK verifies them, not its configuration's); 0 for its configuration's
    /// (and from builds that had padding here).
    pub changed: u8,
    pub _pad2: u16,
    pub rules: [FilterRule; MAX_RULES],
}
const _: () = assert!(size_of::<FilterSet>() == 24 + 104 * MAX_RULES);

impl Default for FilterSet {
    fn default() -> Self {
        Self {
            owner: 0,
            generation: 0,
            rule_count: 0,
            default_target: TARGET_ALLOW,
            changed: 0,
            _pad2: 0,
            rules: [FilterRule::default(); MAX_RULES],
        }
    }
}

/// A packet as the rules read it: addresses as the 32-bit words of their 16-byte form (in
/// memory order, as the programs load them), ports in host byte order.
#[derive(Debug)]
pub struct RulePacket<'a> {
    /// `DIRECTION_*` of the packet.
    pub direction: u8,
    pub family: u8,
    pub protocol: u8,
    pub source: &'a [u32; 4],
    pub destination: &'a [u32; 4],
    pub source_port: u16,
    pub destination_port: u16,
}

impl FilterRule {
    /// Whether the rule matches `packet`, whatever the state of its connection — but for the
    /// networks it names, which the programs ask `network_members` about.
    #[inline(always)]
    pub fn matches(&self, packet: &RulePacket<'_>) -> bool {
        self.direction & packet.direction != 0
            && (self.family == 0 || self.family == packet.family)
            && (self.protocol == 0 || self.protocol == packet.protocol)
            && masked_equal(packet.source, &self.src_mask, &self.src_addr)
            && masked_equal(packet.destination, &self.dst_mask, &self.dst_addr)
            && (self.sport_low..=self.sport_high).contains(&packet.source_port)
            && (self.dport_low..=self.dport_high).contains(&packet.destination_port)
    }
}

/// Whether `addr` masked with `mask` equals `expected` (stored masked): four word compares.
#[inline(always)]
fn masked_equal(addr: &[u32; 4], mask: &Address, expected: &Address) -> bool {
    let (mask, expected) = (mask.words(), expected.words());
    addr[0] & mask[0] == expected[0]
        && addr[1] & mask[1] == expected[1]
        && addr[2] & mask[2] == expected[2]
        && addr[3] & mask[3] == expected[3]
}

/// The answers of one pass over an attachment's rules: the position of the first rule
/// matching a connection's first packet (`connstate: new`) and of the first matching its
/// later ones (`established`), [`RULE_DEFAULT`] while none has.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FirstMatches {
    pub new: u16,
    pub established: u16,
}

impl FirstMatches {
    pub const NONE: Self = Self {
        new: RULE_DEFAULT,
        established: RULE_DEFAULT,
    };

    /// Takes the matching rule at `position` with its `connstate` bits; `true` once both
    /// answers are known and the search can stop.
    #[inline(always)]
    pub fn record(&mut self, position: u16, connstate: u8) -> bool {
        if self.new == RULE_DEFAULT && connstate & CONNSTATE_NEW != 0 {
            self.new = position;
        }
        if self.established == RULE_DEFAULT && connstate & CONNSTATE_ESTABLISHED != 0 {
            self.established = position;
        }
        self.new != RULE_DEFAULT && self.established != RULE_DEFAULT
    }
}

impl_pod!(FilterRule, FilterSet);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FAMILY_IPV4, FAMILY_IPV6, PROTO_TCP, PROTO_UDP};

    /// `addr` masked to `prefix` bits, and the mask, as the plugin stores a rule's address.
    fn prefix(addr: [u8; 16], prefix: u32) -> (Address, Address) {
        let mask = u128::MAX
            .checked_shl(128 - prefix)
            .unwrap_or(0)
            .to_be_bytes();
        let mut masked = addr;
        for (byte, mask) in masked.iter_mut().zip(mask) {
            *byte &= mask;
        }
        (Address::from_bytes(masked), Address::from_bytes(mask))
    }

    fn v4(octets: [u8; 4]) -> [u8; 16] {
        let mut addr = [0; 16];
        addr[..4].copy_from_slice(&octets);
        addr
    }

    /// The words the programs read of an address.
    fn read(addr: [u8; 16]) -> [u32; 4] {
        Address::from_bytes(addr).words()
    }

    fn any_rule() -> FilterRule {
        FilterRule {
            sport_high: u16::MAX,
            dport_high: u16::MAX,
            direction: DIRECTION_INGRESS | DIRECTION_EGRESS,
            connstate: CONNSTATE_NEW | CONNSTATE_ESTABLISHED,
            target: TARGET_DROP,
            src_prefix: NO_PREFIX,
            dst_prefix: NO_PREFIX,
            ..FilterRule::default()
        }
    }

    fn tcp(
        source: [u8; 16],
        destination: [u8; 16],
        ports: (u16, u16),
    ) -> impl Fn(&FilterRule) -> bool {
        move |rule| {
            rule.matches(&RulePacket {
                direction: DIRECTION_EGRESS,
                family: FAMILY_IPV4,
                protocol: PROTO_TCP,
                source: &read(source),
                destination: &read(destination),
                source_port: ports.0,
                destination_port: ports.1,
            })
        }
    }

    #[test]
    fn a_rule_naming_nothing_matches_every_packet_of_its_directions() {
        let packet = tcp(v4([10, 0, 0, 2]), v4([203, 0, 113, 9]), (40_000, 443));
        assert!(packet(&any_rule()));
        let ingress_only = FilterRule {
            direction: DIRECTION_INGRESS,
            ..any_rule()
        };
        assert!(!packet(&ingress_only));
    }

    #[test]
    fn prefixes_match_the_addresses_inside_them_only() {
        let (src_addr, src_mask) = prefix(v4([10, 22, 0, 0]), 16);
        let rule = FilterRule {
            src_addr,
            src_mask,
            src_prefix: 16,
            ..any_rule()
        };
        let to_web = |source| tcp(source, v4([203, 0, 113, 9]), (40_000, 443))(&rule);
        assert!(to_web(v4([10, 22, 0, 5])));
        assert!(to_web(v4([10, 22, 255, 255])));
        assert!(!to_web(v4([10, 23, 0, 5])));
        assert!(!to_web(v4([11, 22, 0, 5])));
        let (dst_addr, dst_mask) = prefix(v4([203, 0, 113, 9]), 32);
        let host = FilterRule {
            dst_addr,
            dst_mask,
            dst_prefix: 32,
            ..any_rule()
        };
        assert!(tcp(v4([1, 1, 1, 1]), v4([203, 0, 113, 9]), (1, 2))(&host));
        assert!(!tcp(v4([1, 1, 1, 1]), v4([203, 0, 113, 8]), (1, 2))(&host));
        let (zero, everything) = prefix(v4([0, 0, 0, 0]), 0);
        let all = FilterRule {
            src_addr: zero,
            src_mask: everything,
            ..any_rule()
        };
        assert!(tcp(v4([192, 0, 2, 1]), v4([1, 2, 3, 4]), (1, 2))(&all));
    }

    #[test]
    fn port_ranges_include_both_ends() {
        let rule = FilterRule {
            dport_low: 8000,
            dport_high: 8080,
            sport_low: 1024,
            ..any_rule()
        };
        let to = |sport, dport| tcp(v4([10, 0, 0, 2]), v4([10, 0, 0, 3]), (sport, dport))(&rule);
        assert!(to(1024, 8000) && to(65_535, 8080) && to(5000, 8040));
        assert!(!to(1024, 7999) && !to(1024, 8081) && !to(1023, 8000));
    }

    #[test]
    fn family_and_protocol_zero_match_any() {
        let packet = |family, protocol, rule: &FilterRule| {
            let addr = read([0xfd; 16]);
            rule.matches(&RulePacket {
                direction: DIRECTION_INGRESS,
                family,
                protocol,
                source: &addr,
                destination: &addr,
                source_port: 53,
                destination_port: 53,
            })
        };
        let any = any_rule();
        assert!(packet(FAMILY_IPV6, PROTO_UDP, &any) && packet(FAMILY_IPV4, PROTO_TCP, &any));
        let udp6 = FilterRule {
            family: FAMILY_IPV6,
            protocol: PROTO_UDP,
            ..any_rule()
        };
        assert!(packet(FAMILY_IPV6, PROTO_UDP, &udp6));
        assert!(!packet(FAMILY_IPV4, PROTO_UDP, &udp6));
        assert!(!packet(FAMILY_IPV6, PROTO_TCP, &udp6));
    }

    #[test]
    fn the_search_keeps_the_first_match_of_each_connection_state() {
        let mut answers = FirstMatches::NONE;
        assert!(!answers.record(3, CONNSTATE_ESTABLISHED));
        assert!(!answers.record(4, CONNSTATE_ESTABLISHED));
        assert_eq!(answers.established, 3);
        assert_eq!(answers.new, RULE_DEFAULT);
        assert!(answers.record(7, CONNSTATE_NEW | CONNSTATE_ESTABLISHED));
        assert_eq!(
            answers,
            FirstMatches {
                new: 7,
                established: 3
            }
        );
        let mut both = FirstMatches::NONE;
        assert!(both.record(0, CONNSTATE_NEW | CONNSTATE_ESTABLISHED));
    }
}
