//! `masq_excludes`: destinations an attachment's traffic is never masqueraded towards.
//!
//! An LPM trie. Key: `prefixlen` + [`MasqExcludeKey`], where the prefix covers the owner id and
//! family (72 bits) plus the destination prefix. Value: `u32` [`Reason`] the destination is
//! excluded for. Written by the CNI plugin on ADD (the container's own subnets, 224.0.0.0/4,
//! ff00::/8 and `ipMasqExclude`), removed on DEL and GC; read by `from_container` and
//! `uplink_egress` before they masquerade a packet.

use core::mem::offset_of;

use crate::impl_pod;
use crate::map_spec::{MapSpec, OwnerField};

pub const EXCLUDES: MapSpec = MapSpec::lpm_trie::<MasqExcludeKey, u32>("masq_excludes", 65_536)
    .owned(OwnerField::KeyBigEndian(
        4 + offset_of!(MasqExcludeKey, owner),
    ));

/// Bits of the key before the destination address: the owner id and the family.
pub const OWNER_FAMILY_BITS: u32 = 72;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MasqExcludeKey {
    /// Owner id, big-endian so that it is a prefix of the key's bits.
    pub owner: [u8; 8],
    pub family: u8,
    pub addr: [u8; 16],
    pub _pad: [u8; 3],
}
const _: () = assert!(size_of::<MasqExcludeKey>() == 28);

/// Why a destination is excluded, as stored in the value.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// A subnet of the container's own addresses.
    OwnSubnet = 1,
    /// 224.0.0.0/4 or ff00::/8.
    Multicast = 2,
    /// Listed in `ipMasqExclude`.
    Configured = 3,
}

impl Reason {
    pub const fn from_u32(value: u32) -> Option<Self> {
        match value {
            1 => Some(Self::OwnSubnet),
            2 => Some(Self::Multicast),
            3 => Some(Self::Configured),
            _ => None,
        }
    }
}

impl_pod!(MasqExcludeKey);
