//! `port_claims`: how many address-specific mappings hold each (hostPort, protocol, family).
//!
//! Key: [`PortClaimKey`]. Value: [`PortClaim`]. Written by the CNI plugin, which reads it too:
//! a wildcard mapping overlaps every specific one of the same port, and this count answers "is
//! there any?" without scanning `portmap`. The sendmsg hooks ask the same of the port a
//! wildcard-bound host socket sends from (a host flow then, see `connections`). The count may
//! be too high after a failed ADD, never too low.

use crate::impl_pod;
use crate::map_spec::{Dimension, MapKind, MapSpec, Sizing};

pub const CLAIMS: MapSpec =
    MapSpec::new::<PortClaimKey, PortClaim>("port_claims", MapKind::Hash, 16_384)
        .sized(Sizing::Times(Dimension::HostPorts, 1));

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PortClaimKey {
    pub host_port: u16,
    pub protocol: u8,
    pub family: u8,
}
const _: () = assert!(size_of::<PortClaimKey>() == 4);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortClaim {
    /// Mappings of this port with a specific host address.
    pub specific: u32,
    pub _pad: u32,
}
const _: () = assert!(size_of::<PortClaim>() == 8);

impl_pod!(PortClaimKey, PortClaim);
