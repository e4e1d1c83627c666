//! `endpoints`: what the datapath knows about each container's host-side interface.
//!
//! Key: `u32` ifindex of the host-side veth. Value: [`EndpointInfo`]. Written by the CNI plugin
//! on ADD, removed on DEL and GC; read by `from_container`, which learns from it which
//! attachment a packet comes from and the gateway it may translate hairpin traffic to.

use crate::impl_pod;

pub const MAP_NAME: &str = "endpoints";
pub const MAX_ENTRIES: u32 = 16_384;

/// `EndpointInfo::flags`: translated packets of this container go through the host stack
/// instead of straight to their next hop, so that what sits on its interface sees them — the
/// `bandwidth` plugin's shaping (a TBF on the host-side veth, an ingress qdisc redirecting to
/// an ifb) — and the host's firewall chains judge them.
pub const FLAG_VIA_STACK: u32 = 1;
/// `snat: false`: a container reaching its own hostPort keeps its own address as the source.
pub const FLAG_NO_HAIRPIN_SNAT: u32 = 2;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointInfo {
    /// The container's IPv6 gateway, all zero when it has none.
    pub gateway_v6: [u8; 16],
    /// Owner id of the attachment.
    pub owner: u64,
    /// The container's IPv4 gateway, all zero when it has none.
    pub gateway_v4: [u8; 4],
    /// MAC address of the container's interface.
    pub container_mac: [u8; 6],
    /// MAC address of the gateway (the bridge) as the container sees it.
    pub gateway_mac: [u8; 6],
    /// `FLAG_*`.
    pub flags: u32,
    /// Where the container's routed traffic enters the host (the bridge the host-side veth is
    /// enslaved to, else that veth): the input interface of its hairpin traffic, for
    /// `port_conditions`.
    pub gateway_ifindex: u32,
}
const _: () = assert!(size_of::<EndpointInfo>() == 48);

impl_pod!(EndpointInfo);
