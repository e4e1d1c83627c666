//! A pod's masqueraded connections as any layout keeps them — `masq_flows` (eBPF layouts 6 to
//! 9) or the masquerade parts of `connections` (10) — to compare them across an upgrade.

use cnibpf_common::{
    address::Address,
    compat::retired_flows::{FlowKeyV9, MASQ_FLOWS, MasqFlowV9},
    connections::{Connection, ConnectionKey, PART_SNAT},
};
use cnibpf_tests::SimHost;

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
