//! `owners`: the plain-text identity of every attachment.
//!
//! Key: `u64` owner id, a stable hash of (network, CNI_IFNAME, CNI_CONTAINERID). Value:
//! [`OwnerInfo`]. Written by the CNI plugin on ADD, removed on DEL and GC; read by `cnibpf
//! inspect` and `cnibpf monitor` (which name the attachment and its pod) and by GC, which must
//! know every attachment of a network without its config. The eBPF programs only carry the id
//! in the entries they create.

use crate::impl_pod;
use crate::map_spec::{Dimension, MapKind, MapSpec, OwnerField, Sizing};

pub const OWNERS: MapSpec = MapSpec::new::<u64, OwnerInfo>("owners", MapKind::Hash, 4_096)
    .sized(Sizing::Measure(Dimension::Attachments))
    .owned(OwnerField::Key);

/// Longest network name or container id stored, in bytes (the rest is zero).
pub const NAME_LEN: usize = 256;
/// `IFNAMSIZ`.
pub const IFNAME_LEN: usize = 16;
/// Room for a Kubernetes namespace (a DNS label, at most 63 bytes) and its terminating zero.
pub const POD_NAMESPACE_LEN: usize = 64;
/// Room for a Kubernetes pod name (a DNS subdomain, at most 253 bytes) and its zero.
pub const POD_NAME_LEN: usize = 256;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OwnerInfo {
    /// CNI network name, zero padded.
    pub network: [u8; NAME_LEN],
    /// CNI_CONTAINERID, zero padded.
    pub container_id: [u8; NAME_LEN],
    /// CNI_IFNAME (inside the container), zero padded.
    pub ifname: [u8; IFNAME_LEN],
    /// Host-side interface the programs are attached to, zero padded.
    pub host_ifname: [u8; IFNAME_LEN],
    /// Index of `host_ifname` when the attachment was made.
    pub host_ifindex: u32,
    /// Slots of `owner_ports` in use: the attachment's port mappings.
    pub port_count: u32,
    /// Namespace of the pod, when the runtime named it in CNI_ARGS (`K8S_POD_NAMESPACE`);
    /// zero padded, all zero when not named.
    pub pod_namespace: [u8; POD_NAMESPACE_LEN],
    /// Name of the pod (`K8S_POD_NAME`), zero padded.
    pub pod_name: [u8; POD_NAME_LEN],
}
const _: () = assert!(size_of::<OwnerInfo>() == 872);

/// Bytes of [`OwnerInfo`] every layout keeps as they are (layouts only append fields): what
/// a cnibpf meeting a newer layout reads and writes to release an attachment it cannot
/// otherwise read (see `layout`).
pub const STABLE_PREFIX: usize = HOST_IFINDEX_OFFSET + size_of::<u32>();
/// Where `host_ifname` starts in every layout's value.
pub const HOST_IFNAME_OFFSET: usize = 2 * NAME_LEN + IFNAME_LEN;
/// Where `host_ifindex` starts in every layout's value.
pub const HOST_IFINDEX_OFFSET: usize = HOST_IFNAME_OFFSET + IFNAME_LEN;
const _: () = assert!(core::mem::offset_of!(OwnerInfo, host_ifname) == HOST_IFNAME_OFFSET);
const _: () = assert!(core::mem::offset_of!(OwnerInfo, host_ifindex) == HOST_IFINDEX_OFFSET);
const _: () = assert!(STABLE_PREFIX == 548);

impl Default for OwnerInfo {
    fn default() -> Self {
        Self {
            network: [0; NAME_LEN],
            container_id: [0; NAME_LEN],
            ifname: [0; IFNAME_LEN],
            host_ifname: [0; IFNAME_LEN],
            host_ifindex: 0,
            port_count: 0,
            pod_namespace: [0; POD_NAMESPACE_LEN],
            pod_name: [0; POD_NAME_LEN],
        }
    }
}

impl_pod!(OwnerInfo);
