//! The simulated host a table runs on, and running a frame through one of its hooks.

use std::net::IpAddr;

use cnibpf_common::{
    connections::{Connection, ConnectionKey},
    drops::{DropCount, DropReason},
};
use cnibpf_tests::{
    SimHost,
    topology::{BRIDGE, UPLINK},
};
use serde_json::Value;

use super::{Hook, Peer};
use crate::{container_mac, interface_index};

/// A simulated host with two containers attached by the area's configuration.
pub struct Bench {
    pub sim: SimHost,
    pub c1: cnibpf_tests::Container,
    pub c2: cnibpf_tests::Container,
    pub(super) uplink: u32,
    pub(super) veths: [u32; 2],
    pub(super) macs: [[u8; 6]; 2],
    pub(super) uplink_mac: [u8; 6],
    pub(super) gateway_mac: [u8; 6],
}

impl Bench {
    /// `keys` in cnibpf's entry, both containers with `capability_args`.
    pub fn new(id: &str, keys: Value, capability_args: &Value) -> Self {
        let sim = SimHost::new(id, keys);
        let c1 = sim.container("c1", capability_args.clone());
        let c2 = sim.container("c2", Value::Null);
        let uplink = interface_index(&sim, UPLINK);
        let veths =
            [&c1, &c2].map(|container| interface_index(&sim, &sim.host_interface(container)));
        let macs = [&c1, &c2].map(container_mac);
        let (uplink_mac, gateway_mac) = (sim.host.mac(UPLINK), sim.host.mac(BRIDGE));
        Self {
            sim,
            c1,
            c2,
            uplink,
            veths,
            macs,
            uplink_mac,
            gateway_mac,
        }
    }

    /// Runs `frame` through `hook` (on c2's veth when `c2` says so).
    pub(super) fn run(&self, hook: Hook, c2: bool, frame: &[u8]) -> Option<(i32, Vec<u8>)> {
        let veth = self.veths[usize::from(c2)];
        let (program, ifindex) = match hook {
            Hook::FromContainer => ("from_container", veth),
            Hook::ToContainer => ("to_container", veth),
            Hook::UplinkIngress => ("uplink_ingress", self.uplink),
            Hook::UplinkEgress => ("uplink_egress", self.uplink),
        };
        self.sim.test_run(program, ifindex, frame)
    }

    pub(super) fn drops(&self, reason: DropReason) -> u64 {
        let map: aya::maps::PerCpuArray<_, DropCount> =
            aya::maps::PerCpuArray::try_from(self.sim.pinned_map("drop_stats"))
                .expect("drop_stats as a per-CPU array");
        map.get(&reason.key(), 0)
            .expect("read drop_stats")
            .iter()
            .map(|count| count.packets)
            .sum()
    }

    pub(super) fn connection(&self, key: &ConnectionKey) -> Option<Connection> {
        self.sim
            .connections()
            .into_iter()
            .find(|(found, _)| found == key)
            .map(|(_, connection)| connection)
    }

    pub(super) fn is_container(&self, address: IpAddr) -> bool {
        [Peer::C1, Peer::C2].iter().any(|peer| {
            [false, true]
                .iter()
                .any(|v6| self.address(*peer, *v6) == address)
        })
    }
}
