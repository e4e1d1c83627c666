//! Filter rules (the CNI "filter plugin"), stateful, at every place a packet enters or leaves
//! a container: `from_container` for what it sends (egress) and, for what it receives
//! (ingress), `to_container` plus every path that hands a packet to the container directly
//! (`bpf_redirect_peer` skips `to_container`): hostPort DNAT, hairpin, replies of masqueraded
//! flows and their ICMP errors and later fragments. The filter always sees the container's
//! side of a translation: the container's address and port, before masquerade and after DNAT.
//!
//! The first packet of a connection is evaluated against the attachment's rules (`filters`)
//! in order, first match wins, as `connstate: new`; when allowed, the connection is tracked in
//! `filter_flows` together with the verdict of its later packets (`connstate: established`),
//! evaluated in the same pass and kept until the rules change generation. Later packets in the
//! originating direction take that cached verdict, so they cost the same whatever the number
//! of rules; replies pass while it allows. ICMP errors about a tracked connection pass with it;
//! link-local control traffic (ARP, IPv6 neighbour discovery, MLD, IGMP) always passes.

use aya_ebpf::{bindings::BPF_ANY, cty::c_void, helpers::bpf_loop, programs::TcContext};
use cnibpf_common::{
    FAMILY_IPV4, FAMILY_IPV6, PROTO_ICMP, PROTO_ICMPV6,
    drop_stats::DropReason,
    filter::{
        CONNSTATE_ESTABLISHED, CONNSTATE_NEW, DIRECTION_EGRESS, FilterRule, FilterSet, MAX_RULES,
        TARGET_ALLOW,
    },
    filter_flow::{FilterFlow, FilterFlowKey, RULE_DEFAULT},
    filter_fragment::FilterFragmentKey,
    filter_hits::DEFAULT_SLOT,
    filter_stats::FilterStats,
    masq_flow::{STATE_CLOSING, STATE_OPENING},
};

use crate::{
    clock,
    conntrack::{self, SIDE_ORIGIN, SIDE_REPLY},
    drops,
    maps::{self, scratch::Subject},
    packet::{
        DROP, DatapathError, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, Flow, Fragment, IPV6_HLEN, NEXT,
        load_anywhere, widen, words,
    },
};

/// The TC verdict of a filter decision.
pub fn verdict(allowed: bool) -> i32 {
    if allowed { NEXT } else { DROP }
}

/// IGMP: IPv4's multicast membership, link-local control like MLD.
const PROTO_IGMP: u8 = 2;
/// IPv6 Hop-by-Hop options header (MLD messages carry one, with the router alert).
const IPV6_HOP_BY_HOP: u8 = 0;

impl Subject {
    /// The packet's source and destination addresses, from its connection's key.
    #[inline(always)]
    fn addresses(&self) -> (&[u8; 16], &[u8; 16]) {
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
    source: [u8; 16],
    destination: [u8; 16],
    source_port: u16,
    destination_port: u16,
}

impl Packet {
    fn of_flow(flow: &Flow, flags: u8) -> Self {
        Self {
            family: flow.family,
            protocol: flow.protocol,
            flags,
            source: flow.saddr,
            destination: flow.daddr,
            source_port: flow.sport,
            destination_port: flow.dport,
        }
    }
}

/// This CPU's [`Subject`], filled for `packet` on `ifindex` travelling `direction`.
#[inline(never)]
fn subject(ctx: &TcContext, packet: &Packet, ifindex: u32, direction: u8) -> *mut Subject {
    let Some(subject) = maps::filter_scratch.get_ptr_mut(0) else {
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
    key.ifindex = ifindex;
    key.protocol = packet.protocol;
    key.family = packet.family;
    key._pad = [0; 2];
    scratch.source = words(&packet.source);
    scratch.destination = words(&packet.destination);
    scratch.now = clock::now_ns();
    scratch.bytes = ctx.len();
    scratch.source_port = u16::from_be(packet.source_port);
    scratch.destination_port = u16::from_be(packet.destination_port);
    scratch.direction = direction;
    scratch.flags = packet.flags;
    subject
}

/// Whether the filter of the attachment on host-side veth `ifindex` lets `flow` through in
/// `direction` (`DIRECTION_*`). Attachments without a `filters` entry are not filtered.
#[inline(never)]
pub fn allows(ctx: &TcContext, flow: &Flow, ifindex: u32, direction: u8) -> bool {
    let Some(set) = maps::filters.get_ptr(&ifindex) else {
        return true;
    };
    // SAFETY: an element of a hash map without preallocation, which userspace only replaces
    // whole: it stays valid and unchanged while this program runs (RCU).
    let set = unsafe { &*set };
    // A packet whose TCP header cannot be read is not judged by a rule: dropped, fail closed.
    let Ok(flags) = flow.tcp_flags(ctx) else {
        drops::record_unread(ctx, DropReason::FilterUnreadable, ifindex);
        return false;
    };
    let subject = subject(ctx, &Packet::of_flow(flow, flags), ifindex, direction);
    if subject.is_null() {
        drops::record_unread(ctx, DropReason::FilterUnreadable, ifindex);
        return false;
    }
    // SAFETY: this CPU's scratch, filled just above.
    let subject = unsafe { &mut *subject };
    if flow.fragment == Fragment::Later {
        return later_fragment_allowed(subject, set, flow.fragment_id);
    }
    let allowed = decide(subject, set);
    if allowed && flow.fragment == Fragment::First {
        let _ = maps::filter_fragments.insert(
            &fragment_key(flow, ifindex),
            &set.owner,
            u64::from(BPF_ANY),
        );
    }
    allowed
}

/// The verdict for a packet with ports: by its connection's state, or as a connection's first
/// packet. Its callees are not inlined, this is: the verifier caps the stack of a call chain at
/// 512 bytes, counting every frame as at least 32.
#[inline(always)]
fn decide(subject: &mut Subject, set: &FilterSet) -> bool {
    let verdict = tracked(subject, set);
    if verdict == UNTRACKED {
        return opens_connection(subject, set);
    }
    if verdict == ALLOWED {
        return true;
    }
    report(subject, set, verdict as u16);
    false
}

/// [`tracked`]'s answers besides "dropped by the rule at this position".
const ALLOWED: u32 = 0x1_0000;
const UNTRACKED: u32 = 0x1_0001;

/// A packet of a tracked connection: a reply passes while the connection's latest packet the
/// other way was allowed; a later packet in the originating direction takes the verdict cached for the
/// rules' generation, evaluated again when they changed. Answers [`ALLOWED`], [`UNTRACKED`]
/// (no live connection: the packet opens one) or the position of the rule that drops it — a
/// plain integer: LLVM returns enums with payloads from BPF calls in a form the verifier
/// rejects.
#[inline(never)]
fn tracked(subject: &mut Subject, set: &FilterSet) -> u32 {
    let Some(entry) = maps::filter_flows.get_ptr_mut(&subject.key) else {
        return UNTRACKED;
    };
    // SAFETY: points into `filter_flows`; racing writers write the same fields alike, and an
    // LRU entry recycled under a reader can at worst misjudge the packet at hand.
    let entry = unsafe { &mut *entry };
    let protocol = subject.key.protocol;
    if entry.is_expired(protocol, subject.now) {
        return UNTRACKED;
    }
    if entry.origin != subject.direction {
        conntrack::advance(entry, protocol, subject.flags, SIDE_REPLY, subject.now);
        return if entry.last_verdict == TARGET_ALLOW {
            ALLOWED
        } else {
            u32::from(entry.rule)
        };
    }
    // A new connection on the tuple of a closed one.
    if entry.state == STATE_CLOSING && conntrack::is_opening(subject.flags) {
        return UNTRACKED;
    }
    if entry.generation != set.generation {
        evaluate(subject, set);
        entry.rule = subject.established;
        entry.verdict = target(set, subject.established);
        entry.generation = set.generation;
    }
    conntrack::advance(entry, protocol, subject.flags, SIDE_ORIGIN, subject.now);
    let (rule, verdict) = (entry.rule, entry.verdict);
    entry.last_verdict = verdict;
    count_hit(subject, rule);
    if verdict == TARGET_ALLOW {
        ALLOWED
    } else {
        u32::from(rule)
    }
}

/// A connection's first packet: evaluated as `new`; when allowed, the connection is tracked
/// with the verdict of its later packets.
#[inline(never)]
fn opens_connection(subject: &mut Subject, set: &FilterSet) -> bool {
    evaluate(subject, set);
    count_hit(subject, subject.new);
    if target(set, subject.new) != TARGET_ALLOW {
        report(subject, set, subject.new);
        return false;
    }
    let entry = FilterFlow {
        owner: set.owner,
        generation: set.generation,
        last_seen_ns: subject.now,
        rule: subject.established,
        origin: subject.direction,
        verdict: target(set, subject.established),
        state: STATE_OPENING,
        fin: 0,
        last_verdict: TARGET_ALLOW,
        _pad: 0,
    };
    // A full LRU map evicts the least recently used connection; should the insert still fail,
    // the connection's next packet is judged as a first one again.
    let _ = maps::filter_flows.insert(&subject.key, &entry, u64::from(BPF_ANY));
    count(|stats| &mut stats.flows_created);
    true
}

/// Whether a packet without ports or state — an ICMP error, ICMP other than echo, another
/// protocol — passes the filter of the attachment on `ifindex`: link-local control always,
/// an ICMP error about a connection whose packets are allowed with it, anything else by the
/// rules as a first packet (ports zero), without creating state.
#[inline(never)]
pub fn allows_other(ctx: &TcContext, ifindex: u32, direction: u8) -> bool {
    let Some(set) = maps::filters.get_ptr(&ifindex) else {
        return true;
    };
    // SAFETY: see `allows`.
    let set = unsafe { &*set };
    let subject = match classify(ctx, ifindex, direction) {
        JUDGED => maps::filter_scratch.get_ptr_mut(0),
        ICMP_JUDGED if error_of_allowed_connection(ctx, ifindex, direction) => return true,
        ICMP_JUDGED => maps::filter_scratch.get_ptr_mut(0),
        PASSES => return true,
        _ => {
            drops::record_unread(ctx, DropReason::FilterUnreadable, ifindex);
            return false;
        }
    };
    let Some(subject) = subject else {
        drops::record_unread(ctx, DropReason::FilterUnreadable, ifindex);
        return false;
    };
    // SAFETY: this CPU's scratch, filled by `classify`.
    let subject = unsafe { &mut *subject };
    evaluate(subject, set);
    count_hit(subject, subject.new);
    if target(set, subject.new) == TARGET_ALLOW {
        return true;
    }
    report(subject, set, subject.new);
    false
}

/// [`classify`]'s answers: the packet always passes, it is to be judged by the rules (an
/// ICMP packet maybe by its connection first), or it could not be read.
const PASSES: u32 = 0;
const JUDGED: u32 = 1;
const ICMP_JUDGED: u32 = 2;
const MALFORMED: u32 = 3;

/// Reads a packet without ports into this CPU's [`Subject`]. Anything but IP, and
/// link-local control, passes. Not inlined: it must not share a stack frame with
/// `error_of_allowed_connection`'s callees.
#[inline(never)]
fn classify(ctx: &TcContext, ifindex: u32, direction: u8) -> u32 {
    match read_other(ctx) {
        Ok(Some(packet)) => {
            if subject(ctx, &packet, ifindex, direction).is_null() {
                MALFORMED
            } else if matches!(packet.protocol, PROTO_ICMP | PROTO_ICMPV6) {
                ICMP_JUDGED
            } else {
                JUDGED
            }
        }
        Ok(None) => PASSES,
        Err(_) => MALFORMED,
    }
}

#[inline(always)]
fn read_other(ctx: &TcContext) -> Result<Option<Packet>, DatapathError> {
    let ethertype: u16 = load_anywhere(ctx, 12)?;
    let (family, protocol, source, destination) = if ethertype == ETH_P_IP.to_be() {
        let protocol: u8 = load_anywhere(ctx, ETH_HLEN + 9)?;
        if protocol == PROTO_IGMP {
            return Ok(None);
        }
        let source: [u8; 4] = load_anywhere(ctx, ETH_HLEN + 12)?;
        let destination: [u8; 4] = load_anywhere(ctx, ETH_HLEN + 16)?;
        (FAMILY_IPV4, protocol, widen(source), widen(destination))
    } else if ethertype == ETH_P_IPV6.to_be() {
        let mut protocol: u8 = load_anywhere(ctx, ETH_HLEN + 6)?;
        let mut l4_off = ETH_HLEN + IPV6_HLEN;
        if protocol == IPV6_HOP_BY_HOP {
            let header: [u8; 2] = load_anywhere(ctx, l4_off)?;
            protocol = header[0];
            l4_off += (usize::from(header[1]) + 1) * 8;
        }
        if protocol == PROTO_ICMPV6 {
            let icmp_type: u8 = load_anywhere(ctx, l4_off)?;
            // MLD (130-132, 143), router and neighbour discovery, redirect (133-137).
            if matches!(icmp_type, 130..=137 | 143) {
                return Ok(None);
            }
        }
        (
            FAMILY_IPV6,
            protocol,
            load_anywhere::<[u8; 16]>(ctx, ETH_HLEN + 8)?,
            load_anywhere::<[u8; 16]>(ctx, ETH_HLEN + 24)?,
        )
    } else {
        return Ok(None);
    };
    Ok(Some(Packet {
        family,
        protocol,
        flags: 0,
        source,
        destination,
        source_port: 0,
        destination_port: 0,
    }))
}

/// Whether the packet is an ICMP error about a live connection of the attachment whose
/// packets are allowed (the quoted packet is one of the connection's).
#[inline(never)]
fn error_of_allowed_connection(ctx: &TcContext, ifindex: u32, direction: u8) -> bool {
    let Some(error) = maps::icmp_error_scratch.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
    let error = unsafe { &mut *error };
    if !matches!(error.parse(ctx), Ok(true)) {
        return false;
    }
    // The quoted packet was sent by the container when the error travels towards it, and
    // to it when the container reports the error.
    let (container, remote) = if direction == DIRECTION_EGRESS {
        (
            (error.inner_daddr, error.inner_dport),
            (error.inner_saddr, error.inner_sport),
        )
    } else {
        (
            (error.inner_saddr, error.inner_sport),
            (error.inner_daddr, error.inner_dport),
        )
    };
    let key = FilterFlowKey {
        container_addr: container.0,
        remote_addr: remote.0,
        ifindex,
        container_port: u16::from_be(container.1),
        remote_port: u16::from_be(remote.1),
        protocol: error.inner_protocol,
        family: error.family,
        _pad: [0; 2],
    };
    let Some(entry) = maps::filter_flows.get_ptr(&key) else {
        return false;
    };
    // SAFETY: points into `filter_flows`, read at once.
    let entry = unsafe { &*entry };
    let now = clock::now_ns();
    entry.last_verdict == TARGET_ALLOW && !entry.is_expired(key.protocol, now)
}

/// A later fragment passes when its datagram's first fragment did (it carries no ports for
/// the rules, nor for finding the connection).
#[inline(never)]
fn later_fragment_allowed(subject: &Subject, set: &FilterSet, fragment_id: u32) -> bool {
    let key = &subject.key;
    let (source, destination) = subject.addresses();
    let fragment = FilterFragmentKey {
        src_addr: *source,
        dst_addr: *destination,
        id: fragment_id,
        ifindex: key.ifindex,
        protocol: key.protocol,
        family: key.family,
        _pad: [0; 6],
    };
    if maps::filter_fragments.get_ptr(&fragment).is_some() {
        return true;
    }
    dropped(subject, set, DropReason::FilterFragment, 0);
    false
}

fn fragment_key(flow: &Flow, ifindex: u32) -> FilterFragmentKey {
    FilterFragmentKey {
        src_addr: flow.saddr,
        dst_addr: flow.daddr,
        id: flow.fragment_id,
        ifindex,
        protocol: flow.protocol,
        family: flow.family,
        _pad: [0; 6],
    }
}

/// The `bpf_loop` context of [`evaluate`] (which must be on the stack): the rules and the
/// packet.
#[repr(C)]
struct RuleSearch {
    set: *const FilterSet,
    subject: *mut Subject,
}

/// One pass over the rules in order, stopping once the first matches for both a first and a
/// later packet are known; the answers are left in `subject.new` / `subject.established`.
#[inline(never)]
fn evaluate(subject: &mut Subject, set: &FilterSet) {
    subject.new = RULE_DEFAULT;
    subject.established = RULE_DEFAULT;
    let mut search = RuleSearch {
        set,
        subject: core::ptr::from_mut(subject),
    };
    // bpf_loop: the verifier checks the callback once instead of every rule.
    // SAFETY: the callback has the signature bpf_loop expects; its context is `search`, which
    // outlives the call.
    unsafe {
        bpf_loop(
            set.rule_count.min(MAX_RULES as u32),
            match_rule as *mut c_void,
            (&raw mut search).cast(),
            0,
        )
    };
}

/// One rule of [`evaluate`] (`bpf_loop` callback); returns 1 to stop.
extern "C" fn match_rule(position: u64, context: *mut c_void) -> i64 {
    // SAFETY: `evaluate` passes its `RuleSearch`, alive for the whole loop; `set` is the
    // `filters` element and `subject` this CPU's scratch, both valid for the program run.
    let (set, subject) = unsafe {
        let search = &*context.cast::<RuleSearch>();
        (&*search.set, &mut *search.subject)
    };
    let Some(rule) = usize::try_from(position)
        .ok()
        .and_then(|position| rule_at(set, position))
    else {
        return 1;
    };
    let matches = rule.direction & subject.direction != 0
        && (rule.family == 0 || rule.family == subject.key.family)
        && (rule.protocol == 0 || rule.protocol == subject.key.protocol)
        && masked_equal(&subject.source, &rule.src_mask, &rule.src_addr)
        && masked_equal(&subject.destination, &rule.dst_mask, &rule.dst_addr)
        && (rule.sport_low..=rule.sport_high).contains(&subject.source_port)
        && (rule.dport_low..=rule.dport_high).contains(&subject.destination_port);
    if !matches {
        return 0;
    }
    let position = position as u16;
    if subject.new == RULE_DEFAULT && rule.connstate & CONNSTATE_NEW != 0 {
        subject.new = position;
    }
    if subject.established == RULE_DEFAULT && rule.connstate & CONNSTATE_ESTABLISHED != 0 {
        subject.established = position;
    }
    i64::from(subject.new != RULE_DEFAULT && subject.established != RULE_DEFAULT)
}

/// Whether `addr` masked with `mask` equals `expected` (already masked).
#[inline(always)]
fn masked_equal(addr: &[u32; 4], mask: &[u8; 16], expected: &[u8; 16]) -> bool {
    // SAFETY: rule addresses and masks are 16-byte fields at multiples of four bytes into
    // `FilterRule`, which has the alignment of its `u32` fields: read as words, they are
    // aligned (byte-wise reads would cost 32 loads a rule).
    let (mask, expected) = unsafe {
        (
            mask.as_ptr().cast::<[u32; 4]>().read(),
            expected.as_ptr().cast::<[u32; 4]>().read(),
        )
    };
    addr[0] & mask[0] == expected[0]
        && addr[1] & mask[1] == expected[1]
        && addr[2] & mask[2] == expected[2]
        && addr[3] & mask[3] == expected[3]
}

/// The rule at `position`; `None` past the rules (`RULE_DEFAULT` is).
#[inline(always)]
fn rule_at(set: &FilterSet, position: usize) -> Option<&FilterRule> {
    if position >= MAX_RULES {
        return None;
    }
    // Through black_box past the check: LLVM would otherwise compute the rule's address
    // before the check, from a register the verifier has not bounded yet.
    set.rules.get(core::hint::black_box(position))
}

/// The target of the rule at `position`, or the default.
fn target(set: &FilterSet, position: u16) -> u8 {
    rule_at(set, usize::from(position)).map_or(set.default_target, |rule| rule.target)
}

/// Counts the packet on the rule at `position` (or the default) of the attachment.
#[inline(never)]
fn count_hit(subject: &Subject, position: u16) {
    let Some(hits) = maps::filter_hits.get_ptr_mut(&subject.key.ifindex) else {
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
        hits.bytes += u64::from(subject.bytes);
    }
}

/// Records a packet dropped by the rule at `position` (or the default).
#[inline(always)]
fn report(subject: &Subject, set: &FilterSet, position: u16) {
    match rule_at(set, usize::from(position)) {
        Some(rule) => dropped(subject, set, DropReason::FilterRule, rule.index),
        None => dropped(subject, set, DropReason::FilterDefault, 0),
    }
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
        event.ifindex = key.ifindex;
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
