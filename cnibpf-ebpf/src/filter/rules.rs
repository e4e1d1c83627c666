//! The rule search: one pass over an attachment's rules in order, `bpf_loop` driven.

use aya_ebpf::{cty::c_void, helpers::bpf_loop};
use cnibpf_common::{
    address::Address,
    filter::{FilterRule, FilterSet, FirstMatches, MAX_RULES, RulePacket},
};

use super::Subject;
use crate::maps;

/// The `bpf_loop` context of [`evaluate`] (which must be on the stack): the rules and the
/// packet.
#[repr(C)]
struct RuleSearch {
    set: *const FilterSet,
    subject: *mut Subject,
}

/// One pass over the rules in order, stopping once the first matches for both a first and a
/// later packet are known; the answers are left in `subject.answers`.
#[inline(never)]
pub(super) fn evaluate(subject: &mut Subject, set: &FilterSet) {
    subject.answers = FirstMatches::NONE;
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
    let packet = RulePacket {
        direction: subject.direction,
        family: subject.key.family,
        protocol: subject.key.protocol,
        source: &subject.source,
        destination: &subject.destination,
        source_port: subject.source_port,
        destination_port: subject.destination_port,
    };
    if !rule.matches(&packet) || !in_networks(rule, subject) {
        return 0;
    }
    i64::from(subject.answers.record(position as u16, rule.connstate))
}

/// Whether the packet's source and destination are addresses of the networks the rule names
/// (a lookup each; a rule that names none pays nothing).
#[inline(always)]
fn in_networks(rule: &FilterRule, subject: &Subject) -> bool {
    let family = subject.key.family;
    (rule.src_network == 0
        || maps::is_network_member(
            rule.src_network,
            &Address::from_words(subject.source),
            family,
        ))
        && (rule.dst_network == 0
            || maps::is_network_member(
                rule.dst_network,
                &Address::from_words(subject.destination),
                family,
            ))
}

/// The rule at `position`; `None` past the rules (`RULE_DEFAULT` is).
#[inline(always)]
pub(super) fn rule_at(set: &FilterSet, position: usize) -> Option<&FilterRule> {
    if position >= MAX_RULES {
        return None;
    }
    // Through black_box past the check: LLVM would otherwise compute the rule's address
    // before the check, from a register the verifier has not bounded yet.
    set.rules.get(core::hint::black_box(position))
}

/// The target of the rule at `position`, or the default.
pub(super) fn target(set: &FilterSet, position: u16) -> u8 {
    rule_at(set, usize::from(position)).map_or(set.default_target, |rule| rule.target)
}
