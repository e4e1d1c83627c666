//! `answer_budgets`: how many REJECT answers (a TCP reset, an ICMP "administratively
//! prohibited") each filtered attachment may still send, so that a flood of rejected packets
//! cannot make the node a reflector: a token bucket per attachment and CPU; what it holds back
//! is dropped unanswered and counted.
//!
//! A per-CPU hash map (`BPF_F_NO_PREALLOC`). Key: `u32` ifindex of the host-side veth, as
//! `filters`. Value: [`AnswerBudget`]. Created zeroed by the CNI plugin with the attachment's
//! `filter_hits`, removed with it; spent by the programs for each answer; read by `cnibpf
//! inspect` and `cnibpf metrics`.
//!
//! `answer_programs`: a program array of one, the program that makes and sends the answers
//! (`reject_answer`), which the hooks tail-call for a refused packet whose answer is wanted.
//! Key `u32` 0, value the program (its descriptor when written, its id when read). Written by
//! every load of the programs, after which the kernel's reference keeps the program as long
//! as the pinned map is.

use crate::map_spec::{Dimension, MapKind, MapSpec, Sizing};
use crate::{drops::budget::take, impl_pod};

pub const ANSWER_BUDGETS: MapSpec =
    MapSpec::new::<u32, AnswerBudget>("answer_budgets", MapKind::PerCpuHash, 4_096)
        .sized(Sizing::Times(Dimension::Attachments, 1));

pub const ANSWER_PROGRAMS: MapSpec =
    MapSpec::new::<u32, u32>("answer_programs", MapKind::ProgramArray, 1);

/// Answers an attachment may send at once from one CPU, and the bucket's size.
pub const ANSWER_BURST: u64 = 20;
/// An attachment earns one answer per CPU every this many nanoseconds: 20 a second, what a
/// client's retries need and a flood does not get (the kernel's own ICMP answers are limited
/// to 1,000 a second host-wide).
pub const NS_PER_ANSWER: u64 = 50_000_000;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AnswerBudget {
    /// Answers this CPU may send now.
    pub tokens: u64,
    /// CLOCK_MONOTONIC (coarse) of the last refill.
    pub refilled_ns: u64,
    /// Answers sent.
    pub sent: u64,
    /// Rejected packets left unanswered because the budget was spent.
    pub suppressed: u64,
}
const _: () = assert!(size_of::<AnswerBudget>() == 32);

impl AnswerBudget {
    /// Whether one answer may be sent at `now_ns`; counts it sent or suppressed.
    #[inline(always)]
    pub fn spend(&mut self, now_ns: u64) -> bool {
        let spent = take(
            &mut self.tokens,
            &mut self.refilled_ns,
            now_ns,
            ANSWER_BURST,
            NS_PER_ANSWER,
        );
        if spent {
            self.sent += 1;
        } else {
            self.suppressed += 1;
        }
        spent
    }
}

impl_pod!(AnswerBudget);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_gets_a_burst_then_the_rate() {
        let mut budget = AnswerBudget::default();
        let start = 7_000_000_000;
        let sent = (0..1_000).filter(|_| budget.spend(start)).count() as u64;
        assert_eq!(sent, ANSWER_BURST);
        assert_eq!(
            (budget.sent, budget.suppressed),
            (ANSWER_BURST, 1_000 - ANSWER_BURST)
        );
        assert!(!budget.spend(start + NS_PER_ANSWER / 2));
        assert!(budget.spend(start + NS_PER_ANSWER));
    }
}
