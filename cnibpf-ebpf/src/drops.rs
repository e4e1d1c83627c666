//! Every packet a program drops passes through here: counted by reason in `drop_stats`, and
//! reported in `filter_events` while this CPU's `drop_event_budget` allows. Nothing here runs
//! for a packet that goes on, so counting costs the fast path nothing.

use aya_ebpf::{btf_maps::PerCpuArray, macros::btf_map, programs::TcContext};
use cnibpf_common::{
    drops::{self, DropEventBudget, DropReason, FilterEvent},
    filter::DIRECTION_EGRESS,
};

use crate::{clock, maps, zero::zero};

/// Counts one dropped packet of `bytes` bytes.
#[inline(always)]
pub fn count(reason: DropReason, bytes: u32) {
    if let Some(count) = maps::drop_stats.get_ptr_mut(reason.key()) {
        // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
        let count = unsafe { &mut *count };
        count.packets += 1;
        count.bytes += u64::from(bytes);
    }
}

/// Whether this CPU may write one more drop event at `now`; spends it if so, counts it as
/// suppressed if not.
#[inline(always)]
fn may_report(now: u64) -> bool {
    let Some(budget) = maps::drop_event_budget.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
    let budget: &mut DropEventBudget = unsafe { &mut *budget };
    drops::budget::spend(budget, now)
}

/// The drop event a drop site puts together for [`submit`]: in a map, as a copy on the stack
/// would cost the stack the verifier caps. Private to each loaded object, not pinned.
#[expect(
    non_upper_case_globals,
    reason = "the static's name is the map's name, like the pinned ones"
)]
#[btf_map]
static drop_event: PerCpuArray<FilterEvent, 1> = PerCpuArray::new();

/// Reports a dropped packet in `filter_events` if this CPU's budget allows: this CPU's
/// [`drop_event`] is zeroed and stamped with `reason`, `fill` writes what the caller knows of
/// the packet, and [`submit`] — one copy in a program, however many places drop — sends it.
#[inline(always)]
pub fn report(reason: DropReason, fill: impl FnOnce(&mut FilterEvent)) {
    let Some(event) = drop_event.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
    // Zeroing it first makes every field written.
    let event = unsafe {
        zero(
            event.cast(),
            size_of::<FilterEvent>(),
            align_of::<FilterEvent>(),
        );
        &mut *event
    };
    event.reason = reason as u8;
    event.direction = DIRECTION_EGRESS;
    fill(event);
    submit();
}

/// Copies this CPU's [`drop_event`] into `filter_events`, stamped with the time, if the
/// budget allows.
#[inline(never)]
fn submit() {
    let now = clock::now_ns();
    if !may_report(now) {
        return;
    }
    let Some(event) = drop_event.get_ptr(0) else {
        return;
    };
    let Some(mut entry) = maps::filter_events.reserve(0) else {
        maps::count_lost_event();
        return;
    };
    let words = size_of::<FilterEvent>() / size_of::<u64>();
    let (from, to) = (event.cast::<u64>(), entry.as_mut_ptr().cast::<u64>());
    // SAFETY: `to` is the reserved record, which only this program writes until it is
    // submitted, `from` this CPU's event; both are FilterEvents, 8-byte aligned (the ring
    // aligns records to 8 bytes), copied a word at a time with volatile accesses, which LLVM
    // does not merge into a `memcpy` through the stack.
    unsafe {
        for word in 0..words {
            to.add(word).write_volatile(from.add(word).read_volatile());
        }
        (*entry.as_mut_ptr()).time_ns = now;
    }
    entry.submit(0);
}

/// Counts and reports a packet dropped on `ifindex` before its headers could be read (or
/// after a rewrite failed half way): the event names only the interface (`cnibpf monitor`
/// finds its attachment).
#[inline(never)]
pub fn record_unread(ctx: &TcContext, reason: DropReason, ifindex: u32) {
    count(reason, ctx.len());
    report(reason, |event| event.ifindex = ifindex);
}
