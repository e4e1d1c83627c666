//! `owner_ports`: which `portmap` keys each attachment owns.
//!
//! Key: [`OwnerPortKey`] — (owner id, slot 0..n). Value: the `PortMapKey` in that slot; the
//! owner's `OwnerInfo.port_count` says how many slots are in use. Written and read by the CNI
//! plugin only, so that ADD, DEL and CHECK touch an attachment's own mappings without scanning
//! everyone's.

use crate::impl_pod;
use crate::map_spec::{Dimension, MapKind, MapSpec, Sizing};

pub const OWNER_PORTS: MapSpec =
    MapSpec::new::<OwnerPortKey, crate::portmap::PortMapKey>("owner_ports", MapKind::Hash, 16_384)
        .sized(Sizing::Times(Dimension::HostPorts, 1));

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct OwnerPortKey {
    pub owner: u64,
    pub slot: u32,
    pub _pad: u32,
}
const _: () = assert!(size_of::<OwnerPortKey>() == 16);

impl_pod!(OwnerPortKey);
