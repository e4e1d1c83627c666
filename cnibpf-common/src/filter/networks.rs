//! `network_members`: the addresses of every attachment on the node, by CNI network — what a
//! filter rule's `srcNetwork` and `dstNetwork` match.
//!
//! Key: [`NetworkMemberKey`] — (network id, family, address); the network id is 64-bit FNV-1a
//! of the network's name (userspace `model::NetworkName::id`). Value: [`NetworkMember`] — the
//! attachment holding the address. Written by the CNI plugin for every attachment, filtered
//! or not, with its endpoint record (ADD) and removed with it (DEL, GC): a pod's start or end
//! changes what every rule naming its network matches at once, with no call for the pods whose
//! rules they are. Read by the filter for each rule that names a network.

use core::mem::offset_of;

use crate::map_spec::{Dimension, MapKind, MapSpec, OwnerField, Sizing};
use crate::{address::Address, impl_pod};

/// Room for four addresses per attachment (most have one of each family).
pub const NETWORK_MEMBERS: MapSpec =
    MapSpec::new::<NetworkMemberKey, NetworkMember>("network_members", MapKind::Hash, 16_384)
        .sized(Sizing::Times(Dimension::Attachments, 4))
        .owned(OwnerField::Value(offset_of!(NetworkMember, owner)));

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NetworkMemberKey {
    pub network: u64,
    pub addr: Address,
    /// `FAMILY_IPV4` or `FAMILY_IPV6`.
    pub family: u8,
    pub _pad: u8,
    pub _pad2: u16,
    pub _pad3: u32,
}
const _: () = assert!(size_of::<NetworkMemberKey>() == 32);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetworkMember {
    /// Owner id of the attachment whose address it is.
    pub owner: u64,
}
const _: () = assert!(size_of::<NetworkMember>() == 8);

impl_pod!(NetworkMemberKey, NetworkMember);

/// `network_names`: the name of each network a filter rule names, by id, so that the rules
/// read back as configured (`cnibpf filter show`, `inspect`, a live change). Key: `u64`
/// network id. Value: [`NetworkName`]. Written by the CNI plugin with the rules that name it;
/// read by the plugin only.
pub const NETWORK_NAMES: MapSpec =
    MapSpec::new::<u64, NetworkName>("network_names", MapKind::Hash, 4_096);

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NetworkName {
    /// NUL-padded.
    pub name: [u8; crate::endpoints::owners::NAME_LEN],
}
const _: () = assert!(size_of::<NetworkName>() == crate::endpoints::owners::NAME_LEN);

impl Default for NetworkName {
    fn default() -> Self {
        Self {
            name: [0; crate::endpoints::owners::NAME_LEN],
        }
    }
}

impl_pod!(NetworkName);
