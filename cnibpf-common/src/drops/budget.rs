//! `drop_event_budget`: how many drop events each CPU may still write into `filter_events`,
//! so that a flood of dropped packets cannot fill the ring and starve `cnibpf monitor` of the
//! events that matter (a token bucket per CPU; the counts in `drop_stats` are never limited).
//!
//! A per-CPU array. Key: `u32` index 0. Value: [`DropEventBudget`]. Written by the programs
//! whenever they drop a packet; `suppressed` read by `cnibpf inspect` and `cnibpf metrics`.

use crate::impl_pod;
use crate::map_spec::{MapKind, MapSpec};

pub const EVENT_BUDGET: MapSpec =
    MapSpec::new::<u32, DropEventBudget>("drop_event_budget", MapKind::PerCpuArray, 1);

/// Events a CPU may write in a burst, and the bucket's size.
pub const BURST: u64 = 256;
/// A CPU earns one event per this many nanoseconds: 1,000 events a second per CPU, well
/// below what a reader drains and a quarter of the ring every second on a two-CPU host.
pub const NS_PER_EVENT: u64 = 1_000_000;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DropEventBudget {
    /// Events this CPU may write now.
    pub tokens: u64,
    /// CLOCK_MONOTONIC (coarse) of the last refill.
    pub refilled_ns: u64,
    /// Drop events not written because the budget was spent.
    pub suppressed: u64,
}
const _: () = assert!(size_of::<DropEventBudget>() == 24);

impl_pod!(DropEventBudget);

/// Whether one event may be written at `now_ns` (CLOCK_MONOTONIC, coarse): refills `budget`
/// for the time passed, then spends one event or counts it suppressed. A budget never used
/// (zero) starts full. In place: the programs call it on their map value.
#[inline(always)]
pub fn spend(budget: &mut DropEventBudget, now_ns: u64) -> bool {
    let spent = take(
        &mut budget.tokens,
        &mut budget.refilled_ns,
        now_ns,
        BURST,
        NS_PER_EVENT,
    );
    if !spent {
        budget.suppressed += 1;
    }
    spent
}

/// A token bucket of `burst` tokens earning one per `ns_per_token`: refilled for the time
/// passed since `refilled_ns`, then one token taken if there is one. A bucket never used
/// (`refilled_ns` zero) starts full. Every rate limit of the datapath is one of these.
#[inline(always)]
pub fn take(
    tokens: &mut u64,
    refilled_ns: &mut u64,
    now_ns: u64,
    burst: u64,
    ns_per_token: u64,
) -> bool {
    if *refilled_ns == 0 {
        *tokens = burst;
        *refilled_ns = now_ns;
    } else if now_ns > *refilled_ns {
        let earned = (now_ns - *refilled_ns) / ns_per_token;
        if earned > 0 {
            *tokens = if *tokens + earned > burst {
                burst
            } else {
                *tokens + earned
            };
            *refilled_ns += earned * ns_per_token;
        }
    }
    if *tokens == 0 {
        return false;
    }
    *tokens -= 1;
    true
}

#[cfg(test)]
mod tests {
    use super::{BURST, DropEventBudget, NS_PER_EVENT, spend};

    #[test]
    fn a_burst_then_one_event_per_interval() {
        let mut budget = DropEventBudget::default();
        let start = 5_000_000_000;
        let written = (0..1_000).filter(|_| spend(&mut budget, start)).count() as u64;
        assert_eq!(written, BURST);
        assert_eq!(budget.suppressed, 1_000 - BURST);
        // Half an interval earns nothing; a whole one earns one event.
        assert!(!spend(&mut budget, start + NS_PER_EVENT / 2));
        assert!(spend(&mut budget, start + NS_PER_EVENT));
        // A long pause refills the bucket to its size, not beyond.
        assert!(spend(&mut budget, start + 1_000 * NS_PER_EVENT));
        assert_eq!(budget.tokens, BURST - 1);
    }
}
