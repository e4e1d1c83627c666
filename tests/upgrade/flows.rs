//! A pod's masqueraded connections as any layout keeps them — `masq_flows` (eBPF layouts 6 to
//! 9) or the masquerade parts of `connections` (10) — to compare them across an upgrade.

use cnibpf_common::{
    address::Address,
    connections::{Connection, ConnectionKey, PART_SNAT},
};
use cnibpf_tests::SimHost;

/// Layouts 6 to 9's table of masqueraded connections (which the releases of the supported
/// window migrate into `connections`), read to compare them across a pass-through upgrade.
const MASQ_FLOWS: &str = "masq_flows";

/// `masq_flows`' key: the connection as its container sends it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct FlowKeyV9 {
    src_addr: [u8; 16],
    dst_addr: [u8; 16],
    src_port: u16,
    dst_port: u16,
    protocol: u8,
    family: u8,
    _pad: [u8; 2],
}
const _: () = assert!(size_of::<FlowKeyV9>() == 40);

/// `masq_flows`' value, up to what the comparison reads.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct MasqFlowV9 {
    nat_addr: [u8; 16],
    owner: u64,
    last_seen_ns: u64,
    uplink_ifindex: u32,
    nat_port: u16,
    state: u8,
    fin: u8,
}
const _: () = assert!(size_of::<MasqFlowV9>() == 40);

// SAFETY: repr(C), integers and byte arrays only, every padding byte a field.
unsafe impl aya::Pod for FlowKeyV9 {}
// SAFETY: as above.
unsafe impl aya::Pod for MasqFlowV9 {}

impl FlowKeyV9 {
    /// The same connection's key in `connections`.
    const fn connection(&self) -> ConnectionKey {
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

/// A masqueraded connection: its tuple from the container's side, its translation, its owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Masqueraded {
    container: (Address, u16),
    remote: (Address, u16),
    protocol: u8,
    family: u8,
    translated: (Address, u16),
    owner: u64,
}

impl Masqueraded {
    fn new(key: &ConnectionKey, translated: (Address, u16), owner: u64) -> Self {
        Self {
            container: (key.container_addr, key.container_port),
            remote: (key.remote_addr, key.remote_port),
            protocol: key.protocol,
            family: key.family,
            translated,
            owner,
        }
    }
}

/// The masqueraded connections the host's datapath holds, sorted.
pub fn masqueraded(sim: &SimHost) -> Vec<Masqueraded> {
    let mut connections: Vec<Masqueraded> = if sim.pin_path.join("connections").exists() {
        sim.pinned_hash_map::<ConnectionKey, Connection>("connections")
            .iter()
            .map(|entry| entry.expect("read connections"))
            .filter(|(_, connection)| connection.parts & PART_SNAT != 0)
            .map(|(key, connection)| {
                Masqueraded::new(
                    &key,
                    (connection.nat_addr, connection.nat_port),
                    connection.owner,
                )
            })
            .collect()
    } else {
        sim.pinned_hash_map::<FlowKeyV9, MasqFlowV9>(MASQ_FLOWS)
            .iter()
            .map(|entry| entry.expect("read masq_flows"))
            .map(|(key, flow)| {
                Masqueraded::new(
                    &key.connection(),
                    (Address::from_bytes(flow.nat_addr), flow.nat_port),
                    flow.owner,
                )
            })
            .collect()
    };
    connections.sort_unstable();
    connections
}
