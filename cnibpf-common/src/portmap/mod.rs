//! `portmap`: the port mappings of every attachment.
//!
//! Key: [`PortMapKey`] — (host address, hostPort, protocol, family); an all-zero address is the
//! wildcard that matches any address the host owns. Value: [`PortMapValue`] — where the traffic
//! goes and which attachment owns the mapping. Written by the CNI plugin (ADD, DEL, GC), read by
//! `uplink_ingress` for traffic from outside, by `from_container` for hairpin traffic and by the
//! socket hooks for connections of host processes.

pub mod claims;
pub mod conditions;
pub mod host_addrs;
pub mod host_sockets;
pub mod owner_ports;

pub use claims::{CLAIMS, PortClaim, PortClaimKey};
pub use conditions::{CONDITIONS, ConditionTerm, PortConditions, PortConditionsKey};
pub use host_addrs::{HOST_ADDRS, HostAddrKey};
pub use host_sockets::{HOST_SOCKETS, SockRevKey, SockRevValue};
pub use owner_ports::{OWNER_PORTS, OwnerPortKey};

use core::mem::offset_of;

use crate::map_spec::{Dimension, MapKind, MapSpec, OwnerField, Sizing};
use crate::{address::Address, impl_pod};

pub const MAPPINGS: MapSpec =
    MapSpec::new::<PortMapKey, PortMapValue>("portmap", MapKind::Hash, 16_384)
        .sized(Sizing::Measure(Dimension::HostPorts))
        .owned(OwnerField::Value(offset_of!(PortMapValue, owner)));

/// The maps of port mapping.
pub const MAPS: [MapSpec; 6] = [
    MAPPINGS,
    CONDITIONS,
    CLAIMS,
    OWNER_PORTS,
    HOST_SOCKETS,
    HOST_ADDRS,
];

/// `PortMapValue::flags`: the attachment's `port_conditions` gate the mapping.
pub const FLAG_CONDITIONED: u8 = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PortMapKey {
    /// Host address the client connects to; all zero for "any address of the host".
    pub host_addr: Address,
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
    pub container_addr: Address,
    /// Owner id of the attachment (key of the `owners` map).
    pub owner: u64,
    /// Index of the container's host-side veth: translated packets are handed straight to its
    /// peer inside the container (`bpf_redirect_peer`), past the bridge and the host stack.
    pub host_ifindex: u32,
    /// containerPort.
    pub container_port: u16,
    /// MAC address of the container's interface (destination of redirected frames).
    pub container_mac: [u8; 6],
    /// MAC address of the container's gateway (source of redirected frames).
    pub gateway_mac: [u8; 6],
    /// `FLAG_*`.
    pub flags: u8,
    pub _pad: u8,
    pub _pad2: u32,
}
const _: () = assert!(size_of::<PortMapValue>() == 48);

impl_pod!(PortMapKey, PortMapValue);
