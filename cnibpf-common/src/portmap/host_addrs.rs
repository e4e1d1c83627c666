//! `host_addrs`: the node's own addresses, those a wildcard hostPort listens on.
//!
//! Key: [`HostAddrKey`]. Value: `u32` index of the interface holding the address. Written by
//! the CNI plugin, which replaces the set with the node's current addresses on every ADD and
//! CHECK, and by `cnibpf install --watch` as they change: every address of the host but the
//! link-local ones and those of `serviceInterfaces` (Service addresses such as the ClusterIPs
//! kube-proxy's IPVS mode binds to `kube-ipvs0`: local, but not the node's). Read by the TC
//! programs and the socket hooks to decide whether a packet or connection to a wildcard
//! hostPort is addressed to the node; the FIB cannot tell a Service's local address from the
//! node's.

use crate::map_spec::{MapKind, MapSpec};
use crate::{address::Address, impl_pod};

pub const HOST_ADDRS: MapSpec =
    MapSpec::new::<HostAddrKey, u32>("host_addrs", MapKind::Hash, 4_096);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct HostAddrKey {
    pub addr: Address,
    pub family: u8,
    pub _pad: u8,
    pub _pad2: u16,
}
const _: () = assert!(size_of::<HostAddrKey>() == 20);

impl_pod!(HostAddrKey);
