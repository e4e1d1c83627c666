//! `masq_flows`: connection tracking of masqueraded flows, by the container's own tuple.
//!
//! Key: [`NatFlowKey`](crate::nat_flow::NatFlowKey) — the 5-tuple as the container sends it
//! (ICMP echo: the identifier as source port, destination port 0). Value: [`MasqFlow`] — the
//! address and port it is translated to, its TCP state and when it was last seen. Written by
//! `from_container` and `uplink_egress` when they masquerade a packet, updated by
//! `uplink_ingress` on replies; entries of an attachment are deleted by the CNI plugin on DEL
//! and GC, which also sweep expired entries. An LRU map: when full, the least recently used flow
//! is evicted, so new flows always get through.
//!
//! An entry expires when it has not been seen for its state's timeout ([`timeout_ns`]);
//! whoever meets an expired entry (a packet, or a DEL/GC sweep) treats it as gone.

use crate::{PROTO_TCP, PROTO_UDP, impl_pod};

pub const MAP_NAME: &str = "masq_flows";
pub const MAX_ENTRIES: u32 = 65_536;

/// [`MasqFlow::state`]: no reply seen yet.
pub const STATE_OPENING: u8 = 0;
/// [`MasqFlow::state`]: the remote side has answered.
pub const STATE_ESTABLISHED: u8 = 1;
/// [`MasqFlow::state`]: TCP only, both sides sent FIN, or either sent RST.
pub const STATE_CLOSING: u8 = 2;

/// [`MasqFlow::fin`] bits: which side sent a FIN.
pub const FIN_FROM_CONTAINER: u8 = 1;
pub const FIN_FROM_REMOTE: u8 = 2;

const SECOND: u64 = 1_000_000_000;
/// TCP handshake not completed (the kernel uses 120 s for SYN_SENT).
pub const TCP_OPENING_TIMEOUT_NS: u64 = 60 * SECOND;
/// TCP established: 6 hours of silence.
pub const TCP_ESTABLISHED_TIMEOUT_NS: u64 = 6 * 3600 * SECOND;
/// TCP after FIN both ways or an RST.
pub const TCP_CLOSING_TIMEOUT_NS: u64 = 10 * SECOND;
/// UDP before the remote side answered (as the kernel's `nf_conntrack_udp_timeout`).
pub const UDP_OPENING_TIMEOUT_NS: u64 = 30 * SECOND;
/// UDP once answered (as the kernel's `nf_conntrack_udp_timeout_stream`).
pub const UDP_ESTABLISHED_TIMEOUT_NS: u64 = 120 * SECOND;
/// ICMP echo and any other protocol.
pub const OTHER_TIMEOUT_NS: u64 = 30 * SECOND;

/// How long an entry in `state` of `protocol` lives without traffic.
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

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MasqFlow {
    /// The address the flow is masqueraded to (its uplink's).
    pub nat_addr: [u8; 16],
    /// Owner id of the attachment the flow belongs to.
    pub owner: u64,
    /// CLOCK_MONOTONIC (coarse) of the last packet either way, refreshed at most
    /// once a second unless the state changes.
    pub last_seen_ns: u64,
    /// The uplink the flow leaves through.
    pub uplink_ifindex: u32,
    /// The translated source port (ICMP echo: identifier).
    pub nat_port: u16,
    /// `STATE_*`.
    pub state: u8,
    /// `FIN_FROM_*` bits.
    pub fin: u8,
}
const _: () = assert!(size_of::<MasqFlow>() == 40);

impl MasqFlow {
    pub const fn is_expired(&self, protocol: u8, now_ns: u64) -> bool {
        now_ns.saturating_sub(self.last_seen_ns) > timeout_ns(protocol, self.state)
    }
}

impl_pod!(MasqFlow);

#[cfg(test)]
mod tests {
    use super::*;

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
        let flow = MasqFlow {
            last_seen_ns: 5,
            state: STATE_OPENING,
            ..MasqFlow::default()
        };
        assert!(flow.is_expired(PROTO_UDP, 5 + UDP_OPENING_TIMEOUT_NS + 1));
        assert!(!flow.is_expired(PROTO_UDP, 5 + UDP_OPENING_TIMEOUT_NS));
    }
}
