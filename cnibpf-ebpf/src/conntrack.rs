//! The connection states masquerade and the filter track alike: opening until the other side
//! answers, established, closing after FIN both ways or an RST (TCP); timeouts per state in
//! `cnibpf_common::masq_flow::timeout_ns`.

use cnibpf_common::{
    PROTO_TCP,
    filter_flow::FilterFlow,
    masq_flow::{MasqFlow, STATE_CLOSING, STATE_ESTABLISHED, STATE_OPENING},
};

use crate::packet::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};

/// The side a packet comes from: the one that opened the connection, or the other.
pub const SIDE_ORIGIN: u8 = cnibpf_common::masq_flow::FIN_FROM_CONTAINER;
pub const SIDE_REPLY: u8 = cnibpf_common::masq_flow::FIN_FROM_REMOTE;

/// How often `last_seen_ns` is refreshed when the state does not change: writing it on every
/// packet would bounce the entry's cache line between CPUs.
const REFRESH_NS: u64 = 1_000_000_000;

/// A tracked connection's state fields.
pub trait Tracked {
    fn fields(&mut self) -> (&mut u8, &mut u8, &mut u64);
}

impl Tracked for MasqFlow {
    fn fields(&mut self) -> (&mut u8, &mut u8, &mut u64) {
        (&mut self.state, &mut self.fin, &mut self.last_seen_ns)
    }
}

impl Tracked for FilterFlow {
    fn fields(&mut self) -> (&mut u8, &mut u8, &mut u64) {
        (&mut self.state, &mut self.fin, &mut self.last_seen_ns)
    }
}

/// Whether TCP `flags` open a connection (SYN without ACK).
pub fn is_opening(flags: u8) -> bool {
    flags & TCP_SYN != 0 && flags & TCP_ACK == 0
}

/// Moves the state on for a packet with TCP `flags` (zero for other protocols) from `side`,
/// and refreshes it.
#[inline(always)]
pub fn advance(entry: &mut impl Tracked, protocol: u8, flags: u8, side: u8, now: u64) {
    let (state, fin, last_seen_ns) = entry.fields();
    let before = (*state, *fin);
    if protocol == PROTO_TCP {
        if side == SIDE_ORIGIN && is_opening(flags) {
            // The tuple is reused for a new connection (after TIME_WAIT).
            if *state == STATE_CLOSING {
                *state = STATE_OPENING;
                *fin = 0;
            }
        } else if flags & TCP_RST != 0 {
            *state = STATE_CLOSING;
        } else {
            if flags & TCP_FIN != 0 {
                *fin |= side;
            }
            if *fin == SIDE_ORIGIN | SIDE_REPLY {
                *state = STATE_CLOSING;
            } else if side == SIDE_REPLY && *state == STATE_OPENING {
                *state = STATE_ESTABLISHED;
            }
        }
    } else if side == SIDE_REPLY && *state == STATE_OPENING {
        *state = STATE_ESTABLISHED;
    }
    if (*state, *fin) != before || now.wrapping_sub(*last_seen_ns) >= REFRESH_NS {
        *last_seen_ns = now;
    }
}
