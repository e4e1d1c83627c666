//! `masq_host_clashes`: how many of the host's own flows were moved to another source port.
//!
//! An array of one entry, shared by every CPU. Key: `u32` index 0. Value: [`HostClashes`].
//! Written by `uplink_egress` (an atomic add) when a host socket's connection would leave with
//! the tuple a container's masqueraded connection holds on the wire: the later flow, the
//! host's, is moved to another port and translated back, as conntrack does. Read by the
//! programs to skip looking for moved host flows while there never was one, and by `cnibpf
//! inspect` and `cnibpf metrics`.

use crate::impl_pod;
use crate::map_spec::{MapKind, MapSpec};

pub const HOST_CLASHES: MapSpec =
    MapSpec::new::<u32, HostClashes>("masq_host_clashes", MapKind::Array, 1);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostClashes {
    /// Host flows moved off the port a container's masqueraded flow held.
    pub moved: u64,
}
const _: () = assert!(size_of::<HostClashes>() == 8);

impl_pod!(HostClashes);
