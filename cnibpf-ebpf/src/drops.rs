//! Every packet a program drops passes through here: counted by reason in `drop_stats`, and
//! reported in `filter_events` while this CPU's `drop_event_budget` allows. Nothing here runs
//! for a packet that goes on, so counting costs the fast path nothing.

use aya_ebpf::programs::TcContext;
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

/// Whether this CPU may write one more drop event now; spends it if so, counts it as
/// suppressed if not.
#[inline(always)]
fn may_report() -> bool {
    let Some(budget) = maps::drop_event_budget.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
    let budget: &mut DropEventBudget = unsafe { &mut *budget };
    drops::budget::spend(budget, clock::now_ns())
}

/// Reports a dropped packet in `filter_events` if this CPU's budget allows: the record is
/// zeroed, stamped with the time and `reason`, then `fill` writes what the caller knows of the
/// packet — straight into the ring, as a copy on the stack would cost the stack the verifier
/// caps.
#[inline(always)]
pub fn report(reason: DropReason, fill: impl FnOnce(&mut FilterEvent)) {
    if !may_report() {
        return;
    }
    let Some(mut entry) = maps::filter_events.reserve(0) else {
        maps::count_lost_event();
        return;
    };
    let event = entry.as_mut_ptr();
    // SAFETY: `event` points to the reserved record, which only this program writes until it
    // is submitted (the ring aligns records to 8 bytes); zeroing it first makes every field
    // written.
    let event = unsafe {
        zero(
            event.cast(),
            size_of::<FilterEvent>(),
            align_of::<FilterEvent>(),
        );
        &mut *event
    };
    event.time_ns = clock::now_ns();
    event.reason = reason as u8;
    event.direction = DIRECTION_EGRESS;
    fill(event);
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
