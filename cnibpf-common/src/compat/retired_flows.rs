//! The connection tables of eBPF layouts 6 to 9, retired by layout 10's `connections`:
//! `masq_flows`, `nat_flows` (both keyed by [`FlowKeyV9`]) and `filter_flows`. Only userspace
//! reads them — the migration that merges them into `connections`, and the upgrade test that
//! compares a pod's connections across it.

use crate::{address::Address, connections::ConnectionKey, impl_pod};

pub const MASQ_FLOWS: &str = "masq_flows";
pub const NAT_FLOWS: &str = "nat_flows";
pub const FILTER_FLOWS: &str = "filter_flows";

/// The key of `masq_flows` (a connection as its container sends it) and `nat_flows` (a
/// hostPort connection's reply as its container sends it): the container's side first.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowKeyV9 {
    pub src_addr: [u8; 16],
    pub dst_addr: [u8; 16],
    pub src_port: u16,
    pub dst_port: u16,
    pub protocol: u8,
    pub family: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(size_of::<FlowKeyV9>() == 40);

impl FlowKeyV9 {
    /// The same connection's key in `connections`.
    pub const fn connection(&self) -> ConnectionKey {
        ConnectionKey {
            container_addr: Address::from_bytes(self.src_addr),
            remote_addr: Address::from_bytes(self.dst_addr),
            container_port: self.src_port,
            remote_port: self.dst_port,
            protocol: self.protocol,
            family: self.family,
            _pad: 0,
        }
    }
}

/// `masq_flows`' value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MasqFlowV9 {
    pub nat_addr: [u8; 16],
    pub owner: u64,
    pub last_seen_ns: u64,
    pub uplink_ifindex: u32,
    pub nat_port: u16,
    pub state: u8,
    /// Bit 1: the container sent a FIN, bit 2: the remote did (the container opened it).
    pub fin: u8,
}
const _: () = assert!(size_of::<MasqFlowV9>() == 40);

/// `nat_flows`' value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NatFlowV9 {
    pub orig_addr: [u8; 16],
    pub peer_addr: [u8; 16],
    pub owner: u64,
    pub last_seen_ns: u64,
    pub peer_ifindex: u32,
    pub orig_port: u16,
    pub peer_port: u16,
    pub peer_mac: [u8; 6],
    pub gateway_mac: [u8; 6],
    pub _pad: [u8; 4],
}
const _: () = assert!(size_of::<NatFlowV9>() == 72);

/// `filter_flows`' key: a connection from its container's side, on its host-side veth.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FilterFlowKeyV9 {
    pub container_addr: [u8; 16],
    pub remote_addr: [u8; 16],
    pub ifindex: u32,
    pub container_port: u16,
    pub remote_port: u16,
    pub protocol: u8,
    pub family: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(size_of::<FilterFlowKeyV9>() == 44);

/// `filter_flows`' value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FilterFlowV9 {
    pub owner: u64,
    pub generation: u64,
    pub last_seen_ns: u64,
    pub rule: u16,
    pub origin: u8,
    pub verdict: u8,
    pub state: u8,
    /// `SIDE_*` bits, as this layout's.
    pub fin: u8,
    pub last_verdict: u8,
    pub _pad: u8,
}
const _: () = assert!(size_of::<FilterFlowV9>() == 32);

impl_pod!(
    FlowKeyV9,
    MasqFlowV9,
    NatFlowV9,
    FilterFlowKeyV9,
    FilterFlowV9
);
