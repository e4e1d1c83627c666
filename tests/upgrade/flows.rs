//! A pod's masqueraded connections as any layout keeps them — `masq_flows` (eBPF layouts 6 to
//! 9) or the masquerade parts of `connections` (10) — to compare them across an upgrade.

use cnibpf_common::connection::{Connection, ConnectionKey, PART_SNAT};
use cnibpf_tests::SimHost;

/// A masqueraded connection: its tuple from the container's side, its translation, its owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Masqueraded {
    container: ([u8; 16], u16),
    remote: ([u8; 16], u16),
    protocol: u8,
    family: u8,
    translated: ([u8; 16], u16),
    owner: u64,
}

/// `masq_flows`' key in layouts 6 to 9: the connection as the container sends it.
#[repr(C)]
#[derive(Clone, Copy)]
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
// SAFETY: repr(C), integers and byte arrays only, no padding (asserted size).
unsafe impl aya::Pod for FlowKeyV9 {}

/// `masq_flows`' value in layouts 6 to 9.
#[repr(C)]
#[derive(Clone, Copy)]
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
// SAFETY: as above.
unsafe impl aya::Pod for MasqFlowV9 {}

/// The masqueraded connections the host's datapath holds, sorted.
pub fn masqueraded(sim: &SimHost) -> Vec<Masqueraded> {
    let mut connections: Vec<Masqueraded> = if sim.pin_path.join("connections").exists() {
        sim.pinned_hash_map::<ConnectionKey, Connection>("connections")
            .iter()
            .map(|entry| entry.expect("read connections"))
            .filter(|(_, connection)| connection.parts & PART_SNAT != 0)
            .map(|(key, connection)| Masqueraded {
                container: (key.container_addr, key.container_port),
                remote: (key.remote_addr, key.remote_port),
                protocol: key.protocol,
                family: key.family,
                translated: (connection.nat_addr, connection.nat_port),
                owner: connection.owner,
            })
            .collect()
    } else {
        sim.pinned_hash_map::<FlowKeyV9, MasqFlowV9>("masq_flows")
            .iter()
            .map(|entry| entry.expect("read masq_flows"))
            .map(|(key, flow)| Masqueraded {
                container: (key.src_addr, key.src_port),
                remote: (key.dst_addr, key.dst_port),
                protocol: key.protocol,
                family: key.family,
                translated: (flow.nat_addr, flow.nat_port),
                owner: flow.owner,
            })
            .collect()
    };
    connections.sort_unstable();
    connections
}
