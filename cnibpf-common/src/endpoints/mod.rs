//! `endpoints`: what the datapath knows about each container's host-side interface.
//!
//! Key: `u32` ifindex of the host-side veth. Value: [`EndpointInfo`]. Written by the CNI plugin
//! on ADD (and by the filter's setup, which clears [`FLAG_UNFILTERED`] before it adds rules,
//! and the source check's, which writes `sources` before the interface is hooked), always whole
//! (the map is not preallocated, so a packet reads the old record or the new one, never a mix),
//! removed on DEL and GC; read by `from_container`, which learns from it the addresses the
//! container may send from, which attachment a packet comes from, what it need not look up, and
//! the gateway it may translate hairpin traffic to, and by every hook that hands a packet to a
//! container.

pub mod owners;

pub use owners::{OWNERS, OwnerInfo};

use core::mem::offset_of;

use crate::map_spec::{Dimension, MapKind, MapSpec, OwnerField, Sizing};
use crate::{address::Address, impl_pod, sources::SourceSet};

pub const ENDPOINTS: MapSpec = MapSpec::new::<u32, EndpointInfo>("endpoints", MapKind::Hash, 4_096)
    .sized(Sizing::Times(Dimension::Attachments, 1))
    .owned(OwnerField::Value(offset_of!(EndpointInfo, owner)));

/// The maps of the endpoints and their attachments.
pub const MAPS: [MapSpec; 2] = [ENDPOINTS, OWNERS];

/// `EndpointInfo::flags`: what this container sends goes through its veth's qdiscs and the
/// host stack, and what is translated for it through that veth's egress, so that what sits on
/// its interface sees both — the `bandwidth` plugin's shaping (a TBF on the host-side veth, an
/// ingress qdisc redirecting to an ifb).
pub const FLAG_VIA_STACK: u32 = 1;
/// `snat: false`: a container reaching its own hostPort keeps its own address as the source.
pub const FLAG_NO_HAIRPIN_SNAT: u32 = 2;
/// `hostFirewall`: what this container sends goes through the host stack, and what is
/// translated for it is handed to the stack where it was translated, so that the host's
/// forward and input chains judge both ways (translated in BPF, routed by the kernel).
pub const FLAG_HOST_FIREWALL: u32 = 4;
/// The attachment has no filter: the datapath does not look for one in `filters`.
pub const FLAG_UNFILTERED: u32 = 8;
/// The container's traffic is masqueraded (`ipMasq`): a packet of a connection `connections`
/// masquerades for `owner` is translated without asking `masq_sources` first.
pub const FLAG_MASQUERADED: u32 = 16;
/// The container's traffic is not masqueraded: the datapath does not look for its source in
/// `masq_sources`.
pub const FLAG_UNMASQUERADED: u32 = 32;
/// The flags that only spare the datapath a lookup, whose answer they carry. A record made by
/// a cnibpf that knew none of them has none: the datapath then looks, with the same outcome,
/// and CHECK accepts it until the attachment's next ADD.
pub const HINT_FLAGS: u32 = FLAG_UNFILTERED | FLAG_MASQUERADED | FLAG_UNMASQUERADED;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointInfo {
    /// The container's IPv6 gateway, all zero when it has none.
    pub gateway_v6: Address,
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
    /// The addresses the container may send from (see `source`); its own `owner` may name
    /// another attachment than the record's for a moment: an ADD writes it before the rest.
    pub sources: SourceSet,
}
const _: () = assert!(size_of::<EndpointInfo>() == 48 + size_of::<SourceSet>());

impl_pod!(EndpointInfo);
