//! `uplinks`: the address each uplink masquerades to.
//!
//! Key: `u32` ifindex of an uplink. Value: [`UplinkInfo`]. Written by the CNI plugin on every
//! ADD and CHECK (and by `cnibpf refresh`) from the uplink's current addresses; read by
//! `from_container` and `uplink_egress` to pick the masquerade address of the uplink a packet
//! leaves through. An uplink without an address of a family drops masqueraded packets of that
//! family, as the kernel's MASQUERADE does.

use crate::map_spec::{MapKind, MapSpec};
use crate::{address::Address, impl_pod};

pub const UPLINKS: MapSpec = MapSpec::new::<u32, UplinkInfo>("uplinks", MapKind::Hash, 256);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UplinkInfo {
    /// The uplink's primary global IPv6 address, all zero when it has none.
    pub addr_v6: Address,
    /// The uplink's primary IPv4 address, all zero when it has none.
    pub addr_v4: [u8; 4],
    pub _pad: u32,
}
const _: () = assert!(size_of::<UplinkInfo>() == 24);

impl_pod!(UplinkInfo);
