//! `portmap`: the port mappings of every attachment.
//!
//! Key: [`PortMapKey`] — (host address, hostPort, protocol, family); an all-zero address is the
//! wildcard that matches any address the host owns. Value: [`PortMapValue`] — where the traffic
//! goes and which attachment owns the mapping. Written by the CNI plugin (ADD, DEL, GC), read by
//! `uplink_ingress` for every packet that arrives from outside.

use crate::impl_pod;

pub const MAP_NAME: &str = "portmap";
pub const MAX_ENTRIES: u32 = 65_536;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PortMapKey {
    /// Host address the client connects to; all zero for "any address of the host".
    pub host_addr: [u8; 16],
    /// hostPort.
    pub host_port: u16,
    /// IANA protocol number.
    pub protocol: u8,
    /// `FAMILY_IPV4` or `FAMILY_IPV6`.
    pub family: u8,
}
const _: () = assert!(size_of::<PortMapKey>() == 20);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortMapValue {
    /// Container address the traffic is translated to (same family as the key).
    pub container_addr: [u8; 16],
    /// Owner id of the attachment (key of the `owners` map).
    pub owner: u64,
    /// containerPort.
    pub container_port: u16,
    pub _pad: [u8; 6],
}
const _: () = assert!(size_of::<PortMapValue>() == 32);

impl_pod!(PortMapKey, PortMapValue);
