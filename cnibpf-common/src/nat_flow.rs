//! `nat_flows`: translated connections, for reversing the translation on replies.
//!
//! Key: [`NatFlowKey`] — the 5-tuple of a reply as the container sends it.
//! Value: [`NatFlowValue`] — what the reply's source and destination become, and where it goes.
//! Written by `uplink_ingress` and `from_container` when they translate a packet to a hostPort;
//! read by `from_container` (and `uplink_egress`, the fallback when the host stack routed the
//! reply) to rewrite replies; entries of an attachment are deleted by the CNI plugin on DEL and
//! GC. An LRU map: when full, the least recently used flow is evicted rather than new flows
//! failing. Entries idle longer than [`idle_timeout_ns`] are swept by the CNI plugin's GC.

use crate::{PROTO_SCTP, PROTO_TCP, PROTO_UDP, impl_pod, masq_flow};

pub const MAP_NAME: &str = "nat_flows";
pub const MAX_ENTRIES: u32 = 65_536;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NatFlowKey {
    pub src_addr: [u8; 16],
    pub dst_addr: [u8; 16],
    pub src_port: u16,
    pub dst_port: u16,
    pub protocol: u8,
    pub family: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(size_of::<NatFlowKey>() == 40);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NatFlowValue {
    /// Address the client sent to (the reply's new source).
    pub orig_addr: [u8; 16],
    /// The client's own address (the reply's new destination); differs from the key's
    /// destination only for hairpin traffic a container sent to its own hostPort, whose source
    /// was translated to the gateway.
    pub peer_addr: [u8; 16],
    /// Owner id of the attachment whose mapping translated the flow.
    pub owner: u64,
    /// CLOCK_MONOTONIC (coarse) of the last packet either way, refreshed at most once a second.
    pub last_seen_ns: u64,
    /// For hairpin traffic, the client container's host-side veth: the reply is handed to its
    /// peer directly. Zero: the reply is routed (to an uplink).
    pub peer_ifindex: u32,
    /// Port the client sent to (the reply's new source port).
    pub orig_port: u16,
    /// The client's own port (the reply's new destination port).
    pub peer_port: u16,
    /// For hairpin traffic: the client container's MAC address.
    pub peer_mac: [u8; 6],
    /// For hairpin traffic: the gateway MAC the client container expects replies from.
    pub gateway_mac: [u8; 6],
    pub _pad: [u8; 4],
}
const _: () = assert!(size_of::<NatFlowValue>() == 72);

/// How long a translated flow may stay silent before GC sweeps it: the established timeouts of
/// `masq_flows` (the port-mapping path keeps no TCP state).
pub const fn idle_timeout_ns(protocol: u8) -> u64 {
    match protocol {
        PROTO_TCP | PROTO_SCTP => masq_flow::TCP_ESTABLISHED_TIMEOUT_NS,
        PROTO_UDP => masq_flow::UDP_ESTABLISHED_TIMEOUT_NS,
        _ => masq_flow::OTHER_TIMEOUT_NS,
    }
}

impl NatFlowValue {
    pub const fn is_expired(&self, protocol: u8, now_ns: u64) -> bool {
        now_ns.saturating_sub(self.last_seen_ns) > idle_timeout_ns(protocol)
    }
}

impl_pod!(NatFlowKey, NatFlowValue);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn translations_expire_after_their_protocols_idle_timeout() {
        let flow = NatFlowValue {
            last_seen_ns: 1_000,
            ..NatFlowValue::default()
        };
        let udp = idle_timeout_ns(PROTO_UDP);
        assert!(!flow.is_expired(PROTO_UDP, 1_000 + udp));
        assert!(flow.is_expired(PROTO_UDP, 1_000 + udp + 1));
        assert!(
            !flow.is_expired(PROTO_TCP, 1_000 + udp + 1),
            "TCP lives longer"
        );
        assert_eq!(idle_timeout_ns(PROTO_SCTP), idle_timeout_ns(PROTO_TCP));
        // A clock read before the entry was refreshed (another CPU) is no expiry.
        assert!(!flow.is_expired(PROTO_UDP, 0));
    }
}
