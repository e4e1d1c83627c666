//! `masq_replies`: the reverse of `masq_flows`, by the tuple replies arrive with.
//!
//! Key: [`NatFlowKey`](crate::nat_flow::NatFlowKey) — the 5-tuple of a reply at the uplink
//! (remote address and port to the masquerade address and port; ICMP echo replies: source port
//! 0, the identifier as destination port). Value: [`MasqReply`] — the container's address and
//! port, and how to hand it the packet. Written together with the `masq_flows` entry (an
//! exclusive insert: that is how a masquerade port is claimed); read by `uplink_ingress` for
//! replies and for ICMP errors about masqueraded packets; deleted with its `masq_flows` entry.
//! An LRU map, as `masq_flows`.

use crate::impl_pod;

pub const MAP_NAME: &str = "masq_replies";
pub const MAX_ENTRIES: u32 = 65_536;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MasqReply {
    /// The container's address (the reply's new destination).
    pub container_addr: [u8; 16],
    /// Owner id of the attachment the flow belongs to.
    pub owner: u64,
    /// The container's host-side veth: the reply is handed to its peer.
    pub host_ifindex: u32,
    /// The container's own source port (ICMP echo: identifier).
    pub container_port: u16,
    pub _pad: [u8; 2],
    pub container_mac: [u8; 6],
    pub gateway_mac: [u8; 6],
    pub _pad2: [u8; 4],
}
const _: () = assert!(size_of::<MasqReply>() == 48);

impl_pod!(MasqReply);
