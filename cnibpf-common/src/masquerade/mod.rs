//! `masq_sources`: the container addresses whose traffic is masqueraded.
//!
//! Key: [`MasqSourceKey`] — a container address. Value: [`MasqSource`] — its attachment and how
//! to hand it packets. Written by the CNI plugin on ADD for each address of an attachment with
//! `ipMasq: true`, removed on DEL and GC (and on an ADD that turns `ipMasq` off); read by
//! `from_container` and `uplink_egress`, which masquerade only packets whose source is listed
//! here and that arrive from the interface recorded with it.

pub mod excludes;
pub mod host_clashes;
pub mod replies;
pub mod stats;
pub mod uplinks;

pub use excludes::{EXCLUDES, MasqExcludeKey};
pub use host_clashes::{HOST_CLASHES, HostClashes};
pub use replies::{CLAIM_GRACE_SECONDS, MasqReply, REPLIES, ReplyKey};
pub use stats::{MasqStats, STATS};
pub use uplinks::{UPLINKS, UplinkInfo};

use core::mem::offset_of;

use crate::map_spec::{Dimension, MapKind, MapSpec, OwnerField, Sizing};
use crate::{address::Address, impl_pod};

pub const SOURCES: MapSpec =
    MapSpec::new::<MasqSourceKey, MasqSource>("masq_sources", MapKind::Hash, 8_192)
        .sized(Sizing::Times(Dimension::Attachments, 2))
        .owned(OwnerField::Value(offset_of!(MasqSource, owner)));

/// The maps of masquerade.
pub const MAPS: [MapSpec; 6] = [SOURCES, EXCLUDES, REPLIES, STATS, UPLINKS, HOST_CLASHES];

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MasqSourceKey {
    pub addr: Address,
    pub family: u8,
    pub _pad: u8,
    pub _pad2: u16,
}
const _: () = assert!(size_of::<MasqSourceKey>() == 20);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MasqSource {
    /// Owner id of the attachment; also selects its entries in `masq_excludes`.
    pub owner: u64,
    /// Index of the container's host-side veth: translated replies are handed to its peer.
    pub host_ifindex: u32,
    /// MAC address of the container's interface.
    pub container_mac: [u8; 6],
    /// MAC address the container expects its gateway's packets from.
    pub gateway_mac: [u8; 6],
}
const _: () = assert!(size_of::<MasqSource>() == 24);

impl_pod!(MasqSourceKey, MasqSource);
