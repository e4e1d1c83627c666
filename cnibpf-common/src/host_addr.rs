//! `host_addrs`: the addresses of the host, for the socket hooks.
//!
//! Key: [`HostAddrKey`]. Value: `u32` index of the interface holding the address. Written by
//! the CNI plugin, which replaces the set with the host's current addresses on every call (the
//! hooks cannot ask the FIB); read by the socket hooks to decide whether a connection to a
//! wildcard hostPort is addressed to this host. TC programs ask the FIB instead.

use crate::impl_pod;

pub const MAP_NAME: &str = "host_addrs";
pub const MAX_ENTRIES: u32 = 4_096;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct HostAddrKey {
    pub addr: [u8; 16],
    pub family: u8,
    pub _pad: [u8; 3],
}
const _: () = assert!(size_of::<HostAddrKey>() == 20);

impl_pod!(HostAddrKey);
