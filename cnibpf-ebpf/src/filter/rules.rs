//! The rule search: one pass over an attachment's rules in order, `bpf_loop` driven.

use aya_ebpf::{cty::c_void, helpers::bpf_loop};
use cnibpf_common::{
    filter::{CONNSTATE_ESTABLISHED, CONNSTATE_NEW, FilterRule, FilterSet, MAX_RULES},
    filter_flow::RULE_DEFAULT,
};

use super::Subject;

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
pub(super) fn evaluate(subject: &mut Subject, set: &FilterSet) {
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
