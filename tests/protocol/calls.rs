//! What one call costs the node. The datapath is set up once and stays until `cnibpf
//! uninstall` (or `cnibpf unload`): an ADD on a node whose datapath is in place does its own
//! attachment's work — no program loaded (no verifier), as many `bpf()` calls beside twenty
//! pods as beside one, at most one process started — and so does the ADD after the node's
//! last pod left.

use cnibpf_tests::{
    Container,
    faults::{KernelWork, KernelWorkCounts},
};

use super::*;

/// The chain's ADD of a pod with two hostPorts, cnibpf's part counted.
fn counted_add(sim: &SimHost, name: &str, host_port: u16) -> (Container, KernelWorkCounts) {
    let work = KernelWork::new();
    sim.chain.set_cnibpf_prefix(Some(work.prefix()));
    let added = sim.add_container(
        name,
        port_mappings(&[(host_port, 80, "tcp"), (host_port + 1, 443, "tcp")]),
    );
    sim.chain.set_cnibpf_prefix(None);
    let container = added.unwrap_or_else(|error| panic!("ADD of {name}: {error}"));
    let counts = work.take();
    assert_eq!(
        counts.runs, 1,
        "{name}: one run of cnibpf counted: {counts:?}"
    );
    (container, counts)
}

/// The `bpf()` calls of an ADD of a pod with two hostPorts (four keys: v4 and v6) and
/// masquerade, on a node whose datapath is in place: the stamp, the maps it writes, the
/// container's two hooks, the uplinks' stamp, the conflict check of each key.
const MOST_BPF_CALLS_OF_AN_ADD: u32 = 60;

/// The ADD was its attachment's work alone: nothing loaded, at most one process started.
fn assert_own_work_only(backend: Backend, what: &str, counts: KernelWorkCounts) {
    assert_eq!(
        counts.program_loads, 0,
        "{backend:?}, {what}: no program loaded: {counts:?}"
    );
    assert!(
        counts.bpf_calls <= MOST_BPF_CALLS_OF_AN_ADD,
        "{backend:?}, {what}: at most {MOST_BPF_CALLS_OF_AN_ADD} bpf() calls: {counts:?}"
    );
    assert!(
        counts.processes_started <= 1,
        "{backend:?}, {what}: at most one process started: {counts:?}"
    );
}

fn assert_served(sim: &SimHost, container: &Container, host_port: u16, what: &str) {
    let _server = TcpServer::start(&container.netns, Family::V4.any(80), what);
    assert_eq!(
        tcp_request(&sim.outside, sim.uplink(Family::V4, host_port)).as_deref(),
        Ok(what),
        "{what}: the counted ADD's hostPort is served"
    );
}

#[test]
fn an_add_on_a_node_whose_datapath_is_in_place_does_only_its_own_work() {
    for backend in [Backend::Ebpf, Backend::Nftables] {
        let sim = SimHost::on(backend, "proto-calls", json!({ "ipMasq": true }));
        let mut running = vec![sim.container("r0", port_mappings(&[(20_000, 80, "tcp")]))];
        let (first, beside_one) = counted_add(&sim, "first", 8080);
        assert_own_work_only(backend, "beside one pod", beside_one);
        running.extend((1..20).map(|slot| {
            sim.container(
                &format!("r{slot}"),
                port_mappings(&[(20_000 + slot, 80, "tcp")]),
            )
        }));
        let (second, beside_twenty) = counted_add(&sim, "second", 8090);
        assert_own_work_only(backend, "beside twenty pods", beside_twenty);
        assert!(
            beside_twenty.bpf_calls <= beside_one.bpf_calls,
            "{backend:?}: an ADD's bpf() calls do not grow with the pods beside it: {beside_one:?} beside one pod, {beside_twenty:?} beside twenty"
        );
        assert_served(&sim, &second, 8090, &format!("{backend:?} second"));

        for container in running.iter().chain([&first, &second]) {
            sim.del(container)
                .unwrap_or_else(|error| panic!("{backend:?}: DEL: {error}"));
        }
        let (after, counts) = counted_add(&sim, "after", 8100);
        assert_own_work_only(backend, "after the node's last pod left", counts);
        assert_served(&sim, &after, 8100, &format!("{backend:?} after"));
    }
}
