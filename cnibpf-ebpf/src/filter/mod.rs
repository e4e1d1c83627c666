//! Filter rules (the CNI "filter plugin"), stateful, at every place a packet enters or leaves
//! a container: `from_container` for what it sends (egress) and, for what it receives
//! (ingress), `to_container` plus every path that hands a packet to the container directly
//! (`bpf_redirect_peer` skips `to_container`): hostPort DNAT, hairpin, replies of masqueraded
//! flows and their ICMP errors and later fragments. The filter always sees the container's
//! side of a translation: the container's address and port, before masquerade and after DNAT.
//!
//! The first packet of a connection is evaluated against the attachment's rules (`filters`)
//! in order, first match wins, as `connstate: new`; when allowed, the connection is tracked
//! (the filter's part of its `connections` entry) with the verdict of its later packets
//! (`connstate: established`),
//! evaluated in the same pass and kept until the rules change generation. Later packets in the
//! originating direction take that cached verdict, so they cost the same whatever the number
//! of rules; replies pass while it allows. ICMP errors about a tracked connection pass with it;
//! link-local control traffic (ARP, IPv6 neighbour discovery, MLD, IGMP) always passes.

mod answer;
mod other;
mod rules;

use aya_ebpf::{bindings::BPF_ANY, btf_maps::PerCpuArray, macros::btf_map, programs::TcContext};
use cnibpf_common::{
    address::Address,
    connections::{
        Connection, ConnectionKey, FirstFragment, PART_FILTER,
        conntrack::{self, SIDE_ORIGIN, SIDE_REPLY, STATE_CLOSING},
        fragments::{PASSED_EGRESS, PASSED_INGRESS},
    },
    drops::DropReason,
    filter::{
        DIRECTION_EGRESS, FilterSet, FilterStats, FirstMatches, MatchEvent, RULE_DEFAULT, RULE_LOG,
        TARGET_ALLOW, TARGET_REJECT, hits::DEFAULT_SLOT,
    },
};

use crate::{
    connections, drops, maps,
    packet::{Flow, Fragment},
};

pub use answer::{Way, answer_refused, answered, ends_slot, lets_on, refused};
pub use other::allows_other;
use rules::{evaluate, rule_at, target};

/// IGMP: IPv4's multicast membership, link-local control like MLD.
const PROTO_IGMP: u8 = 2;

/// IPv6 Hop-by-Hop options header (MLD messages carry one, with the router alert).
const IPV6_HOP_BY_HOP: u8 = 0;

/// The filter's view of the packet at hand, and the state of its rule search. Kept in
/// [`filter_scratch`]: on the stack it would push call chains past the verifier's
/// 512 bytes. One packet is judged at a time per CPU.
#[repr(C)]
pub struct Subject {
    /// The packet's connection, the container's side first.
    pub key: ConnectionKey,
    /// The container's host-side veth.
    pub ifindex: u32,
    /// Source and destination as the rules name them, as 32-bit words.
    pub source: [u32; 4],
    pub destination: [u32; 4],
    pub now: u64,
    pub bytes: u32,
    /// Host byte order.
    pub source_port: u16,
    pub destination_port: u16,
    /// `DIRECTION_*` of the packet.
    pub direction: u8,
    /// TCP flags, zero for other protocols.
    pub flags: u8,
    /// [`answer::WANTED`] once a REJECT rule refused the packet, until it is answered.
    pub answer: u8,
    /// Answers of the rule search: the first rule matching a connection's first packet and
    /// its later ones.
    pub answers: FirstMatches,
}

/// Scratch space of the filter (see [`Subject`]); private to each loaded object, not pinned.
#[expect(
    non_upper_case_globals,
    reason = "the static's name is the map's name, like the pinned ones"
)]
#[btf_map]
pub static filter_scratch: PerCpuArray<Subject, 1> = PerCpuArray::new();

impl Subject {
    /// The packet's source and destination addresses, from its connection's key.
    #[inline(always)]
    fn addresses(&self) -> (&Address, &Address) {
        if self.direction == DIRECTION_EGRESS {
            (&self.key.container_addr, &self.key.remote_addr)
        } else {
            (&self.key.remote_addr, &self.key.container_addr)
        }
    }
}

/// A packet's addresses and protocol as the filter reads them (ports in network byte order,
/// zero when the packet has none).
struct Packet {
    family: u8,
    protocol: u8,
    flags: u8,
    source: Address,
    destination: Address,
    source_port: u16,
    destination_port: u16,
    /// The program run's clock read (a flow's, taken when it was parsed).
    now: u64,
}

impl Packet {
    fn of_flow(flow: &Flow) -> Self {
        Self {
            family: flow.family,
            protocol: flow.protocol,
            flags: flow.tcp_flags,
            source: flow.saddr,
            destination: flow.daddr,
            source_port: flow.sport,
            destination_port: flow.dport,
            now: flow.now,
        }
    }
}

/// This CPU's [`Subject`], filled for `packet` on `ifindex` travelling `direction`.
#[inline(never)]
fn subject(ctx: &TcContext, packet: &Packet, ifindex: u32, direction: u8) -> *mut Subject {
    let Some(subject) = filter_scratch.get_ptr_mut(0) else {
        return core::ptr::null_mut();
    };
    // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
    let scratch = unsafe { &mut *subject };
    let egress = direction == DIRECTION_EGRESS;
    let key = &mut scratch.key;
    if egress {
        key.container_addr = packet.source;
        key.remote_addr = packet.destination;
        key.container_port = u16::from_be(packet.source_port);
        key.remote_port = u16::from_be(packet.destination_port);
    } else {
        key.container_addr = packet.destination;
        key.remote_addr = packet.source;
        key.container_port = u16::from_be(packet.destination_port);
        key.remote_port = u16::from_be(packet.source_port);
    }
    scratch.ifindex = ifindex;
    key.protocol = packet.protocol;
    key.family = packet.family;
    key._pad = 0;
    scratch.source = packet.source.words();
    scratch.destination = packet.destination.words();
    scratch.now = packet.now;
    scratch.bytes = ctx.len();
    scratch.source_port = u16::from_be(packet.source_port);
    scratch.destination_port = u16::from_be(packet.destination_port);
    scratch.direction = direction;
    scratch.flags = packet.flags;
    scratch.answer = 0;
    subject
}

/// Whether the filter of the attachment on host-side veth `ifindex` lets `flow` through in
/// `direction` (`DIRECTION_*`), the packet's connection looked up here (see [`allows_in`]).
#[inline(always)]
pub fn allows(ctx: &TcContext, flow: &Flow, ifindex: u32, direction: u8) -> bool {
    let connection = if flow.fragment == Fragment::Later {
        core::ptr::null_mut()
    } else {
        connections::of_packet(flow, direction)
    };
    allows_in(ctx, flow, ifindex, direction, connection)
}

/// Whether the filter of the attachment on host-side veth `ifindex` lets `flow` through in
/// `direction` (`DIRECTION_*`); `connection` is the packet's `connections` entry as its hook
/// found it (`connections::of_packet`), null when it has none. Attachments without a `filters`
/// entry are not filtered. A packet its connection's entry passes is judged from the entry
/// alone; the [`Subject`] is filled for the rules and the reports only.
#[inline(never)]
pub fn allows_in(
    ctx: &TcContext,
    flow: &Flow,
    ifindex: u32,
    direction: u8,
    connection: *mut Connection,
) -> bool {
    let Some(set) = maps::filters.get_ptr(&ifindex) else {
        return true;
    };
    // SAFETY: an element of a hash map without preallocation, which userspace only replaces
    // whole: it stays valid and unchanged while this program runs (RCU).
    let set = unsafe { &*set };
    let packet = Glance {
        now: flow.now,
        ifindex,
        bytes: ctx.len(),
        protocol: flow.protocol,
        flags: flow.tcp_flags,
        direction,
    };
    let verdict = if flow.fragment == Fragment::Later {
        LATER_FRAGMENT
    } else {
        tracked(&packet, set, connection)
    };
    let allowed = verdict == ALLOWED || {
        let subject = subject(ctx, &Packet::of_flow(flow), ifindex, direction);
        if subject.is_null() {
            drops::record_unread(ctx, DropReason::FilterUnreadable, ifindex);
            return false;
        }
        // SAFETY: this CPU's scratch, filled just above.
        let subject = unsafe { &mut *subject };
        if verdict == LATER_FRAGMENT {
            return later_fragment_allowed(subject, set, flow);
        }
        let verdict = if verdict == STALE {
            evaluate_again(subject, set, connection);
            tracked(&packet, set, connection)
        } else {
            verdict
        };
        decide(subject, set, verdict)
    };
    if flow.fragment == Fragment::First {
        mark_first_fragment(flow, direction, allowed);
    }
    allowed
}

/// What [`tracked`] reads of a packet: a tracked connection's packet is judged by its entry,
/// without the rest of the [`Subject`].
struct Glance {
    now: u64,
    ifindex: u32,
    bytes: u32,
    protocol: u8,
    /// TCP flags, zero for other protocols.
    flags: u8,
    /// `DIRECTION_*` of the packet.
    direction: u8,
}

/// The verdict for a packet [`tracked`] did not pass at once (`verdict`, its answer, taken
/// again after a rule change's re-evaluation): a connection's first packet, or one its
/// connection's verdict drops. Its callees are not inlined, this is:
/// the verifier caps the stack of a call chain at 512 bytes, counting every frame as at least
/// 32.
#[inline(always)]
fn decide(subject: &mut Subject, set: &FilterSet, verdict: u32) -> bool {
    match verdict {
        ALLOWED => true,
        UNTRACKED => opens_connection(subject, set),
        rule => {
            report(subject, set, rule as u16);
            false
        }
    }
}

/// [`tracked`]'s answers besides "dropped by the rule at this position".
const ALLOWED: u32 = 0x1_0000;

const UNTRACKED: u32 = 0x1_0001;

/// The rules changed generation since the connection's verdict was cached.
const STALE: u32 = 0x1_0002;

/// Not [`tracked`]'s: a later fragment, judged by its datagram's first.
const LATER_FRAGMENT: u32 = 0x1_0003;

/// A packet of a tracked connection (`connection`, its entry): a reply passes while the
/// connection's latest packet the other way was allowed; a later packet in the originating
/// direction takes the verdict cached for the rules' generation. Answers [`ALLOWED`],
/// [`UNTRACKED`] (no live connection: the packet opens one), [`STALE`] (to be evaluated
/// again) or the position of the rule that drops it — a plain integer: LLVM returns enums
/// with payloads from BPF calls in a form the verifier rejects.
#[inline(never)]
fn tracked(packet: &Glance, set: &FilterSet, connection: *mut Connection) -> u32 {
    // SAFETY: points into `connections`; racing writers write the same fields alike, and an
    // LRU entry recycled under a reader can at worst misjudge the packet at hand.
    let Some(entry) = (unsafe { connection.as_mut() }) else {
        return UNTRACKED;
    };
    let protocol = packet.protocol;
    if !entry.has(set.owner, PART_FILTER) || entry.is_expired(protocol, packet.now) {
        return UNTRACKED;
    }
    if entry.origin != packet.direction {
        conntrack::advance(entry, protocol, packet.flags, SIDE_REPLY, packet.now);
        return if entry.last_verdict == TARGET_ALLOW {
            ALLOWED
        } else {
            u32::from(entry.rule)
        };
    }
    if entry.reopened_by(packet.flags) {
        return UNTRACKED;
    }
    if entry.generation != set.generation {
        return STALE;
    }
    conntrack::advance(entry, protocol, packet.flags, SIDE_ORIGIN, packet.now);
    let (rule, verdict) = (entry.rule, entry.verdict);
    entry.last_verdict = verdict;
    count_hit(packet.ifindex, packet.bytes, rule);
    if verdict == TARGET_ALLOW {
        ALLOWED
    } else {
        u32::from(rule)
    }
}

/// The verdict of the later packets of a connection [`tracked`] found [`STALE`], evaluated
/// again under the rules' generation and cached in its entry, for [`tracked`] to take.
#[inline(never)]
fn evaluate_again(subject: &mut Subject, set: &FilterSet, connection: *mut Connection) {
    // SAFETY: as in `tracked`, which found the entry.
    let Some(entry) = (unsafe { connection.as_mut() }) else {
        return;
    };
    evaluate(subject, set);
    entry.rule = subject.answers.established;
    entry.verdict = target(set, subject.answers.established);
    entry.generation = set.generation;
}

/// A connection's first packet: evaluated as `new`; when allowed, the connection is tracked
/// with the verdict of its later packets, the filter's part of its entry (a new one when the
/// connection has none of the attachment's, or a closed one).
#[inline(never)]
fn opens_connection(subject: &mut Subject, set: &FilterSet) -> bool {
    if !judged_as_new(subject, set) {
        return false;
    }
    let (mut entry, mut fresh) = connections::for_part(
        &subject.key,
        set.owner,
        subject.key.protocol,
        subject.direction,
        subject.flags,
        subject.now,
    );
    // SAFETY: points into `connections`, read at once.
    if !fresh && unsafe { (*entry).state == STATE_CLOSING } {
        // A closed connection's tuple opened again: a connection of its own.
        (entry, fresh) = (
            connections::fresh(
                set.owner,
                subject.key.protocol,
                subject.direction,
                subject.flags,
                subject.now,
            ),
            true,
        );
    }
    // SAFETY: points into `connections` (racing writers write the same), or this CPU's
    // scratch for a new entry.
    let Some(connection) = (unsafe { entry.as_mut() }) else {
        return true;
    };
    connection.generation = set.generation;
    connection.rule = subject.answers.established;
    connection.verdict = target(set, subject.answers.established);
    connection.last_verdict = TARGET_ALLOW;
    connection.parts |= PART_FILTER;
    if fresh {
        connections::insert(&subject.key, entry);
    } else {
        let side = connection.side(subject.direction);
        conntrack::advance(
            connection,
            subject.key.protocol,
            subject.flags,
            side,
            subject.now,
        );
    }
    count(|stats| &mut stats.flows_created);
    true
}

/// A later fragment passes when its datagram's first fragment did, this way (it may carry
/// the first's ports, but is not a packet of its own for the rules or the connection).
#[inline(never)]
fn later_fragment_allowed(subject: &Subject, set: &FilterSet, flow: &Flow) -> bool {
    let passed = passed_bit(subject.direction);
    let first = maps::fragments.get_ptr(&flow.fragment_key());
    // SAFETY: points into `fragments`, read at once.
    if first.is_some_and(|first| unsafe {
        (*first).passed & passed != 0 && (*first).is_live(subject.now)
    }) {
        return true;
    }
    dropped(subject, set, DropReason::FilterFragment, 0);
    false
}

/// Marks on the datagram's `fragments` entry, under its addresses as the filter sees them,
/// whether its first fragment passed `direction`: a datagram whose first was dropped loses
/// the mark an earlier one with its identification left.
#[inline(never)]
fn mark_first_fragment(flow: &Flow, direction: u8, allowed: bool) {
    let passed = passed_bit(direction);
    let key = flow.fragment_key();
    if let Some(first) = maps::fragments.get_ptr_mut(&key) {
        // SAFETY: points into `fragments`; the fragments of one datagram come one at a time.
        let first = unsafe { &mut *first };
        if allowed {
            first.passed |= passed;
        } else {
            first.passed &= !passed;
        }
        return;
    }
    if !allowed {
        return;
    }
    // Translated since the parser saw it: its own entry under the new addresses.
    let first = FirstFragment {
        seen_ns: flow.now,
        src_port: u16::from_be(flow.sport),
        dst_port: u16::from_be(flow.dport),
        passed,
        _pad: 0,
        _pad2: 0,
    };
    let _ = maps::fragments.insert(&key, &first, u64::from(BPF_ANY));
}

fn passed_bit(direction: u8) -> u8 {
    if direction == DIRECTION_EGRESS {
        PASSED_EGRESS
    } else {
        PASSED_INGRESS
    }
}

/// A packet judged as a connection's first (`connstate: new`): the rules evaluated, its match
/// counted and logged; whether the match's target allows it (a refused packet is reported).
#[inline(never)]
pub(super) fn judged_as_new(subject: &mut Subject, set: &FilterSet) -> bool {
    evaluate(subject, set);
    count_hit(subject.ifindex, subject.bytes, subject.answers.new);
    log_decision(subject, set, subject.answers.new);
    if target(set, subject.answers.new) == TARGET_ALLOW {
        return true;
    }
    report(subject, set, subject.answers.new);
    false
}

/// Counts a packet of `bytes` on the rule at `position` (or the default) of the attachment on
/// `ifindex`. Inlined: a tracked connection's packets count on every one.
#[inline(always)]
fn count_hit(ifindex: u32, bytes: u32, position: u16) {
    let Some(hits) = maps::filter_hits.get_ptr_mut(&ifindex) else {
        return;
    };
    let slot = if position == RULE_DEFAULT {
        DEFAULT_SLOT
    } else {
        usize::from(position)
    };
    if slot > DEFAULT_SLOT {
        return;
    }
    // SAFETY: this CPU's copy of the attachment's counters; programs on one CPU do not overlap.
    // (black_box: see `rule_at`.)
    if let Some(hits) = unsafe { &mut *hits }
        .rules
        .get_mut(core::hint::black_box(slot))
    {
        hits.packets += 1;
        hits.bytes += u64::from(bytes);
    }
}

/// Records a packet dropped by the rule at `position` (or the default); a REJECT rule's is
/// to be answered (`answer::answer_refused`).
#[inline(always)]
fn report(subject: &mut Subject, set: &FilterSet, position: u16) {
    match rule_at(set, usize::from(position)) {
        Some(rule) if rule.target == TARGET_REJECT => {
            subject.answer = answer::WANTED;
            dropped(subject, set, DropReason::FilterReject, rule.index);
        }
        Some(rule) => dropped(subject, set, DropReason::FilterRule, rule.index),
        None => dropped(subject, set, DropReason::FilterDefault, 0),
    }
}

/// A connection's first packet decided by the rule at `position`: reported in
/// `filter_matches` when the rule logs, within this CPU's budget. Nothing else happens for a
/// rule without `log`.
#[inline(always)]
fn log_decision(subject: &Subject, set: &FilterSet, position: u16) {
    if let Some(rule) = rule_at(set, usize::from(position))
        && rule.flags & RULE_LOG != 0
    {
        logged(subject, set, rule.index, rule.target);
    }
}

#[inline(never)]
fn logged(subject: &Subject, set: &FilterSet, rule_index: u32, target: u8) {
    let Some(budget) = maps::match_event_budget.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
    if !unsafe { &mut *budget }.spend(subject.now) {
        return;
    }
    let Some(mut entry) = maps::filter_matches.reserve(0) else {
        maps::count_lost_event();
        return;
    };
    let (source, destination) = subject.addresses();
    // SAFETY: the reserved record, which only this program writes until it is submitted;
    // every field is written here.
    unsafe {
        entry.as_mut_ptr().write(MatchEvent {
            time_ns: subject.now,
            owner: set.owner,
            src_addr: *source,
            dst_addr: *destination,
            ifindex: subject.ifindex,
            rule_index,
            src_port: subject.source_port,
            dst_port: subject.destination_port,
            protocol: subject.key.protocol,
            family: subject.key.family,
            direction: subject.direction,
            target,
        });
    }
    entry.submit(0);
}

/// Counts a packet the filter dropped and reports it with its connection's addresses and ports.
#[inline(never)]
fn dropped(subject: &Subject, set: &FilterSet, reason: DropReason, rule_index: u32) {
    drops::count(reason, subject.bytes);
    let key = &subject.key;
    let (source, destination) = subject.addresses();
    drops::report(reason, |event| {
        event.owner = set.owner;
        event.src_addr = *source;
        event.dst_addr = *destination;
        event.ifindex = subject.ifindex;
        event.rule_index = rule_index;
        event.src_port = subject.source_port;
        event.dst_port = subject.destination_port;
        event.protocol = key.protocol;
        event.family = key.family;
        event.direction = subject.direction;
    });
}

fn count(field: impl FnOnce(&mut FilterStats) -> &mut u64) {
    if let Some(stats) = maps::filter_stats.get_ptr_mut(0) {
        // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
        *field(unsafe { &mut *stats }) += 1;
    }
}
