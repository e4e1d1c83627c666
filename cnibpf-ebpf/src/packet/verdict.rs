//! What a feature answers its hook about a packet, and what the hook answers the kernel.

use aya_ebpf::{
    bindings::{TC_ACT_SHOT, TC_ACT_UNSPEC},
    programs::TcContext,
};
use cnibpf_common::drops::DropReason;

use super::skb::ifindex;
use crate::drops;
use crate::zero::Zeroable;

/// The verdict for a packet cnibpf leaves alone, or rewrote and leaves to the stack: on to the
/// next tcx program or tc filter, then the stack (`TCX_NEXT`, `TC_ACT_UNSPEC`). Never
/// `TC_ACT_OK`, which would end tc processing for every program and filter after cnibpf's:
/// an operator's own filters and other plugins' programs on the same hooks must keep seeing
/// what cnibpf does not take.
pub const NEXT: i32 = TC_ACT_UNSPEC;
/// The verdict for a packet cnibpf drops (the filter, or a rewrite that failed half way).
pub const DROP: i32 = TC_ACT_SHOT;

/// A feature's answer to the hook that asked it about a packet: a TC verdict the hook returns
/// as it is ([`Answer::NEXT`], a drop, a redirect), or one of two answers only a
/// hook reads — [`Answer::TO_CONTAINER`] (translated: hand it to the container the
/// [`Handover`] names, filter first) and [`Answer::NOT_MINE`] (none of this feature's business:
/// ask the next one). Transparent over the verdict's integer: the verifier sees the register
/// it always saw, the compiler sees two kinds of answer no TC verdict can be taken for.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Answer(i32);

impl Answer {
    pub const NEXT: Self = Self(NEXT);
    /// Values no TC verdict takes.
    pub const TO_CONTAINER: Self = Self(i32::MIN + 1);
    pub const NOT_MINE: Self = Self(i32::MIN);

    /// A TC verdict (from a helper such as `bpf_redirect_peer`) as a feature's answer.
    pub const fn verdict(verdict: i32) -> Self {
        Self(verdict)
    }

    /// The TC verdict of an answer a hook takes as final; a packet no feature wanted goes on.
    pub const fn tc_verdict(self) -> i32 {
        if self.0 == Self::NOT_MINE.0 {
            NEXT
        } else {
            self.0
        }
    }
}

/// The container a translated packet goes to: its host-side veth and the MAC addresses it
/// expects on its frames (its own, its gateway's).
#[derive(Clone, Copy)]
#[repr(C)]
pub struct Handover {
    pub host_ifindex: u32,
    pub container_mac: [u8; 6],
    pub gateway_mac: [u8; 6],
}
const _: () = assert!(size_of::<Handover>() == 16);
const _: () = assert!(
    core::mem::offset_of!(Handover, gateway_mac)
        == core::mem::offset_of!(Handover, container_mac) + 6
);

impl Handover {
    /// The frame's MAC addresses as the container expects them, destination then source, in
    /// place: written to the packet from here, with no copy put together first.
    pub fn frame_macs(&self) -> &[u8; 12] {
        // SAFETY: `repr(C)` puts `gateway_mac` right after `container_mac` (asserted above):
        // twelve initialised bytes, of an alignment of one.
        unsafe { &*(&raw const self.container_mac).cast::<[u8; 12]>() }
    }
}

// SAFETY: an integer and two byte arrays.
unsafe impl Zeroable for Handover {}

/// The value of a `Result` step, or a return of its error's verdict: for functions that
/// return verdicts rather than a `Result` — LLVM packs an early `Ok` with whatever a register
/// holds (a map or packet pointer), and the verifier refuses the unused bits it builds from it.
macro_rules! or_verdict {
    ($ctx:expr, $step:expr) => {
        match $step {
            Ok(value) => value,
            Err(error) => {
                return $crate::packet::verdict::Fate::of($crate::packet::DatapathError::verdict(
                    error, $ctx,
                ));
            }
        }
    };
}
pub(crate) use or_verdict;

/// What a function deciding a packet's fate returns: a TC verdict, or a feature's [`Answer`].
pub trait Fate {
    fn of(verdict: i32) -> Self;
}

impl Fate for i32 {
    fn of(verdict: i32) -> Self {
        verdict
    }
}

impl Fate for Answer {
    fn of(verdict: i32) -> Self {
        Self::verdict(verdict)
    }
}

/// Why a program stopped early, and what that means for the packet.
#[derive(Clone, Copy)]
pub enum DatapathError {
    /// The packet was shorter than its headers claim: not ours to judge, the stack drops it.
    Truncated,
    /// A rewrite helper failed after the packet was partly changed: passing it on would deliver
    /// a packet with a wrong address or checksum, so it is dropped.
    RewriteFailed,
}

impl DatapathError {
    /// The packet's verdict; a drop is counted and reported (`drops`).
    pub fn verdict(self, ctx: &TcContext) -> i32 {
        match self {
            Self::Truncated => NEXT,
            Self::RewriteFailed => {
                drops::record_unread(ctx, DropReason::RewriteFailed, ifindex(ctx));
                DROP
            }
        }
    }

    /// [`Self::verdict`] as a feature's answer.
    pub fn answer(self, ctx: &TcContext) -> Answer {
        Answer::verdict(self.verdict(ctx))
    }
}
