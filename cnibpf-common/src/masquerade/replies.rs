//! `masq_replies`: masqueraded connections by the tuple their replies arrive with.
//!
//! Key: [`ReplyKey`] — the 5-tuple of a reply at the uplink (remote address and port to the
//! masquerade address and port; ICMP echo replies: source port 0, the identifier as destination
//! port). Value: [`MasqReply`] — the container's address and port (with the key's remote, the
//! connection's `connections` key), and how to hand it the packet. Written with the
//! connection's masquerade (an exclusive insert: that is how a masquerade port is claimed);
//! read by `uplink_ingress` for replies and for ICMP errors about masqueraded packets; deleted
//! with the connection's masquerade. An LRU map, as `connections`.

use core::mem::offset_of;

use crate::map_spec::{Dimension, MapKind, MapSpec, OwnerField, Sizing};
use crate::{address::Address, impl_pod};

pub const REPLIES: MapSpec =
    MapSpec::new::<ReplyKey, MasqReply>("masq_replies", MapKind::LruHash, 65_536)
        .sized(Sizing::Measure(Dimension::Flows))
        .owned(OwnerField::Value(offset_of!(MasqReply, owner)));

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ReplyKey {
    pub src_addr: Address,
    pub dst_addr: Address,
    /// Host byte order.
    pub src_port: u16,
    pub dst_port: u16,
    pub protocol: u8,
    pub family: u8,
    pub _pad: u16,
}
const _: () = assert!(size_of::<ReplyKey>() == 40);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MasqReply {
    /// The container's address (the reply's new destination).
    pub container_addr: Address,
    /// Owner id of the attachment the flow belongs to.
    pub owner: u64,
    /// The container's host-side veth: the reply is handed to its peer. Zero for a host flow
    /// moved to another port (owner `connections::HOST`): the reply goes to the host stack,
    /// with `container_addr` and `container_port` the host socket's own.
    pub host_ifindex: u32,
    /// The container's own source port (ICMP echo: identifier).
    pub container_port: u16,
    pub _pad: u16,
    pub container_mac: [u8; 6],
    pub gateway_mac: [u8; 6],
    /// When the flow claimed the reply tuple: CLOCK_MONOTONIC's second plus one (zero: claimed
    /// by a build that did not say; such a claim is old). A claim younger than
    /// [`CLAIM_GRACE_SECONDS`] is never taken over for want of its flow's connection state,
    /// which its flow writes right after claiming.
    pub claimed_at: u32,
}
const _: () = assert!(size_of::<MasqReply>() == 48);

/// How long a fresh claim of a reply tuple holds even without its flow's connection state.
pub const CLAIM_GRACE_SECONDS: u32 = 2;

impl_pod!(ReplyKey, MasqReply);
