//! `nat_flows`: translated connections, for reversing the translation on replies.
//!
//! Key: [`NatFlowKey`] — the 5-tuple of a reply as it leaves the host (source = container side).
//! Value: [`NatFlowValue`] — the address and port the client originally talked to, and the owner.
//! Written by `uplink_ingress` when it translates a packet to a hostPort; read by `uplink_egress`
//! to rewrite replies; entries of an attachment are deleted by the CNI plugin on DEL and GC.
//! An LRU map: when full, the least recently used flow is evicted rather than new flows failing.

use crate::impl_pod;

pub const MAP_NAME: &str = "nat_flows";
pub const MAX_ENTRIES: u32 = 262_144;

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
    /// Owner id of the attachment whose mapping translated the flow.
    pub owner: u64,
    /// `bpf_ktime_get_ns` of the last packet from the client, refreshed at most once a second.
    pub last_seen_ns: u64,
    /// Port the client sent to (the reply's new source port).
    pub orig_port: u16,
    pub _pad: [u8; 6],
}
const _: () = assert!(size_of::<NatFlowValue>() == 40);

impl_pod!(NatFlowKey, NatFlowValue);
