//! Not a map: the connection states the datapath tracks, kept here to be unit-tested on the
//! host. Opening until the other side answers, established, closing after a FIN each way or an
//! RST (TCP); how long each state lives ([`timeout_ns`]).

use crate::{PROTO_TCP, PROTO_UDP};

/// No answer from the other side yet.
pub const STATE_OPENING: u8 = 0;
/// The other side has answered.
pub const STATE_ESTABLISHED: u8 = 1;
/// TCP only: both sides sent FIN, or either sent RST.
pub const STATE_CLOSING: u8 = 2;

const SECOND: u64 = 1_000_000_000;
/// TCP handshake not completed (the kernel uses 120 s for SYN_SENT).
pub const TCP_OPENING_TIMEOUT_NS: u64 = 60 * SECOND;
/// TCP established: 6 hours of silence.
pub const TCP_ESTABLISHED_TIMEOUT_NS: u64 = 6 * 3600 * SECOND;
/// TCP after FIN both ways or an RST.
pub const TCP_CLOSING_TIMEOUT_NS: u64 = 10 * SECOND;
/// UDP before the other side answered (as the kernel's `nf_conntrack_udp_timeout`).
pub const UDP_OPENING_TIMEOUT_NS: u64 = 30 * SECOND;
/// UDP once answered (as the kernel's `nf_conntrack_udp_timeout_stream`).
pub const UDP_ESTABLISHED_TIMEOUT_NS: u64 = 120 * SECOND;
/// ICMP echo and any other protocol.
pub const OTHER_TIMEOUT_NS: u64 = 30 * SECOND;

/// How long a connection in `state` of `protocol` lives without traffic.
pub const fn timeout_ns(protocol: u8, state: u8) -> u64 {
    match (protocol, state) {
        (PROTO_TCP, STATE_OPENING) => TCP_OPENING_TIMEOUT_NS,
        (PROTO_TCP, STATE_ESTABLISHED) => TCP_ESTABLISHED_TIMEOUT_NS,
        (PROTO_TCP, _) => TCP_CLOSING_TIMEOUT_NS,
        (PROTO_UDP, STATE_OPENING) => UDP_OPENING_TIMEOUT_NS,
        (PROTO_UDP, _) => UDP_ESTABLISHED_TIMEOUT_NS,
        _ => OTHER_TIMEOUT_NS,
    }
}

/// TCP header flag bits (the header's byte 13).
pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// The side a packet comes from: the one that opened the connection, or the other. Also the
/// bits of an entry's `fin`.
pub const SIDE_ORIGIN: u8 = 1;
pub const SIDE_REPLY: u8 = 2;

/// How often `last_seen_ns` is refreshed when the state does not change: writing it on every
/// packet would bounce the entry's cache line between CPUs.
pub const REFRESH_NS: u64 = 1_000_000_000;

/// A tracked connection's state fields.
pub trait Tracked {
    /// Its `STATE_*`, `SIDE_*` bits of FINs seen and last-seen time.
    fn fields(&mut self) -> (&mut u8, &mut u8, &mut u64);
}

/// Whether TCP `flags` open a connection (SYN without ACK).
#[inline(always)]
pub const fn is_opening(flags: u8) -> bool {
    flags & TCP_SYN != 0 && flags & TCP_ACK == 0
}

/// Moves the state on for a packet with TCP `flags` (zero for other protocols) from `side`,
/// and refreshes it. A clock read before the entry was last refreshed (on another CPU) leaves
/// the time as it is: an entry's last-seen time never goes back.
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
    let changed = (*state, *fin) != before;
    if now > *last_seen_ns && (changed || now - *last_seen_ns >= REFRESH_NS) {
        *last_seen_ns = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: u64 = 1_000 * REFRESH_NS;

    /// The state fields of an entry, as any tracked type has them.
    #[derive(Clone, Copy, Default)]
    struct Entry {
        state: u8,
        fin: u8,
        last_seen_ns: u64,
    }

    impl Tracked for Entry {
        fn fields(&mut self) -> (&mut u8, &mut u8, &mut u64) {
            (&mut self.state, &mut self.fin, &mut self.last_seen_ns)
        }
    }

    fn opened(protocol: u8) -> Entry {
        let mut flow = Entry {
            last_seen_ns: T0,
            ..Entry::default()
        };
        let flags = if protocol == PROTO_TCP { TCP_SYN } else { 0 };
        advance(&mut flow, protocol, flags, SIDE_ORIGIN, T0);
        flow
    }

    #[test]
    fn a_syn_without_ack_opens() {
        assert!(is_opening(TCP_SYN));
        assert!(!is_opening(TCP_SYN | TCP_ACK));
        assert!(!is_opening(TCP_ACK));
        assert!(!is_opening(TCP_FIN | TCP_ACK));
    }

    #[test]
    fn a_tcp_connection_goes_from_handshake_to_close() {
        let mut flow = opened(PROTO_TCP);
        assert_eq!(flow.state, STATE_OPENING);
        // The container's own ACKs do not establish it: only the other side's answer does.
        advance(&mut flow, PROTO_TCP, TCP_ACK, SIDE_ORIGIN, T0);
        assert_eq!(flow.state, STATE_OPENING);
        advance(&mut flow, PROTO_TCP, TCP_SYN | TCP_ACK, SIDE_REPLY, T0);
        assert_eq!(flow.state, STATE_ESTABLISHED);
        advance(&mut flow, PROTO_TCP, TCP_FIN | TCP_ACK, SIDE_ORIGIN, T0);
        assert_eq!((flow.state, flow.fin), (STATE_ESTABLISHED, SIDE_ORIGIN));
        // The same FIN again (a retransmission) changes nothing.
        advance(&mut flow, PROTO_TCP, TCP_FIN | TCP_ACK, SIDE_ORIGIN, T0);
        assert_eq!((flow.state, flow.fin), (STATE_ESTABLISHED, SIDE_ORIGIN));
        advance(&mut flow, PROTO_TCP, TCP_FIN | TCP_ACK, SIDE_REPLY, T0);
        assert_eq!(flow.state, STATE_CLOSING);
        assert_eq!(timeout_ns(PROTO_TCP, flow.state), TCP_CLOSING_TIMEOUT_NS);
    }

    #[test]
    fn a_reset_from_either_side_closes() {
        for side in [SIDE_ORIGIN, SIDE_REPLY] {
            let mut flow = opened(PROTO_TCP);
            advance(&mut flow, PROTO_TCP, TCP_SYN | TCP_ACK, SIDE_REPLY, T0);
            advance(&mut flow, PROTO_TCP, TCP_RST, side, T0);
            assert_eq!(flow.state, STATE_CLOSING, "RST from side {side}");
        }
    }

    #[test]
    fn a_new_syn_reopens_a_closed_tuple_from_its_origin_only() {
        let mut flow = opened(PROTO_TCP);
        advance(&mut flow, PROTO_TCP, TCP_RST, SIDE_REPLY, T0);
        advance(&mut flow, PROTO_TCP, TCP_SYN, SIDE_REPLY, T0);
        assert_eq!(flow.state, STATE_CLOSING, "the other side cannot reopen it");
        let mut closed = flow;
        closed.fin = SIDE_ORIGIN | SIDE_REPLY;
        advance(&mut closed, PROTO_TCP, TCP_SYN, SIDE_ORIGIN, T0);
        assert_eq!((closed.state, closed.fin), (STATE_OPENING, 0));
    }

    #[test]
    fn other_protocols_are_established_by_any_answer() {
        let mut flow = opened(PROTO_UDP);
        assert_eq!(flow.state, STATE_OPENING);
        advance(&mut flow, PROTO_UDP, 0, SIDE_ORIGIN, T0);
        assert_eq!(flow.state, STATE_OPENING);
        advance(&mut flow, PROTO_UDP, 0, SIDE_REPLY, T0);
        assert_eq!(flow.state, STATE_ESTABLISHED);
        // Flag bits mean nothing outside TCP.
        advance(&mut flow, PROTO_UDP, TCP_RST | TCP_FIN, SIDE_REPLY, T0);
        assert_eq!((flow.state, flow.fin), (STATE_ESTABLISHED, 0));
    }

    #[test]
    fn the_last_seen_time_is_refreshed_once_a_second_or_on_a_change() {
        let mut flow = opened(PROTO_TCP);
        advance(
            &mut flow,
            PROTO_TCP,
            TCP_ACK,
            SIDE_ORIGIN,
            T0 + REFRESH_NS - 1,
        );
        assert_eq!(flow.last_seen_ns, T0, "within a second, no state change");
        advance(&mut flow, PROTO_TCP, TCP_SYN | TCP_ACK, SIDE_REPLY, T0 + 5);
        assert_eq!(
            flow.last_seen_ns,
            T0 + 5,
            "a state change refreshes at once"
        );
        advance(
            &mut flow,
            PROTO_TCP,
            TCP_ACK,
            SIDE_REPLY,
            T0 + 5 + REFRESH_NS,
        );
        assert_eq!(flow.last_seen_ns, T0 + 5 + REFRESH_NS);
    }

    #[test]
    fn a_clock_behind_the_entry_never_moves_it_back() {
        let mut flow = opened(PROTO_TCP);
        advance(&mut flow, PROTO_TCP, TCP_SYN | TCP_ACK, SIDE_REPLY, T0 - 10);
        assert_eq!(flow.state, STATE_ESTABLISHED);
        assert_eq!(flow.last_seen_ns, T0);
    }

    #[test]
    fn timeouts_follow_the_connections_state() {
        assert_eq!(timeout_ns(PROTO_TCP, STATE_OPENING), TCP_OPENING_TIMEOUT_NS);
        assert_eq!(
            timeout_ns(PROTO_TCP, STATE_ESTABLISHED),
            TCP_ESTABLISHED_TIMEOUT_NS
        );
        assert_eq!(timeout_ns(PROTO_UDP, STATE_OPENING), UDP_OPENING_TIMEOUT_NS);
        assert_eq!(
            timeout_ns(PROTO_UDP, STATE_ESTABLISHED),
            UDP_ESTABLISHED_TIMEOUT_NS
        );
        assert_eq!(timeout_ns(1, STATE_ESTABLISHED), OTHER_TIMEOUT_NS);
    }
}
