//! The eBPF datapath's maps sized from the configuration (`maxFlows`, `maxAttachments`,
//! `maxHostPorts`): a new datapath takes the sizes asked; a live one is resized — by `cnibpf
//! load` or by an ADD whose network asks for other sizes — with its pods' connections,
//! translations and counters carried over, and a resize killed at any point is completed by the
//! next run; a size smaller than what the maps hold is refused and changes nothing.

use std::process::Command;

use cnibpf_common::map_spec::Dimension;
use cnibpf_tests::{
    SimHost, chain, faults,
    live::{LivePod, pod_keys},
    topology::{cnibpf_binary, port_mappings},
    traffic::{TcpServer, tcp_request},
};
use serde_json::{Value, json};

fn sized_keys(flows: u32, attachments: u32, host_ports: u32) -> Value {
    let mut keys = pod_keys("ebpf");
    keys["maxFlows"] = json!(flows);
    keys["maxAttachments"] = json!(attachments);
    keys["maxHostPorts"] = json!(host_ports);
    keys
}

/// Every sized map has its spec's share of the dimension it follows.
fn assert_sizes(sim: &SimHost, flows: u32, attachments: u32, host_ports: u32, when: &str) {
    for spec in cnibpf_common::maps() {
        let size = match spec.sizing.dimension() {
            None => continue,
            Some(Dimension::Flows) => flows,
            Some(Dimension::Attachments) => attachments,
            Some(Dimension::HostPorts) => host_ports,
        };
        assert_eq!(
            Some(sim.map_size(spec.name)),
            spec.sizing.entries(size),
            "{when}: {}",
            spec.name
        );
    }
    assert!(
        !sim.pin_path.join("resize").exists(),
        "{when}: no resize left half done"
    );
}

/// `cnibpf load` with `args` in the simulated host.
fn load(sim: &SimHost, args: &[&str]) -> std::process::Output {
    let pin_path = sim.pin_path.display().to_string();
    let mut all = vec!["load", "--backend", "ebpf", "--pin-path", &pin_path];
    all.extend_from_slice(args);
    sim.cnibpf(&all)
}

#[test]
fn a_live_datapath_is_resized_with_its_flows_translations_and_counters() {
    let sim = SimHost::new("sz", sized_keys(4_096, 256, 1_024));
    let pod = LivePod::start(&sim);
    assert_sizes(&sim, 4_096, 256, 1_024, "created by the first ADD");
    let inspect = sim.inspect();
    assert_eq!(
        inspect["ebpfMaps"]["maxFlows"], 4_096,
        "inspect: {inspect:#}"
    );
    let flows = sim.flow_counts();
    let dropped = sim.filter_rule_packets(0);
    assert!(dropped > 0, "the filter counted its drops");

    // Grown by `cnibpf load` (what `install --load --max-flows` runs), every dimension: the
    // per-CPU maps (the filter's counters) are copied CPU by CPU.
    let output = load(
        &sim,
        &[
            "--max-flows",
            "131072",
            "--max-attachments",
            "512",
            "--max-host-ports",
            "2048",
        ],
    );
    assert!(output.status.success(), "load: {output:?}");
    let said = String::from_utf8_lossy(&output.stdout);
    assert!(
        said.contains("maxFlows 131072, maxAttachments 512, maxHostPorts 2048"),
        "{said}"
    );
    assert_sizes(&sim, 131_072, 512, 2_048, "after load --max-flows");
    let carried = sim.flow_counts();
    for (before, after) in flows.iter().zip(carried) {
        assert!(
            after >= *before,
            "flows carried over: {flows:?} -> {carried:?}"
        );
    }
    assert!(
        sim.filter_rule_packets(0) >= dropped,
        "counters carried over"
    );
    pod.assert_translations(&sim, "after the resize");

    // Back to the network's own sizes with its next ADD, which also gets its hostPort.
    let second = sim.container("c2", port_mappings(&[(8090, 80, "tcp")]));
    assert_sizes(
        &sim,
        4_096,
        256,
        1_024,
        "after an ADD of the network's sizes",
    );
    let _server = TcpServer::start(&second.netns, second.socket(80), "c2");
    assert_eq!(
        tcp_request(&sim.outside, sim.uplink_target(8090)).as_deref(),
        Ok("c2")
    );
    pod.assert_translations(&sim, "after the ADD's resize");
    let container = pod.assert_carried_on("across two resizes");
    sim.check(&container)
        .unwrap_or_else(|error| panic!("CHECK after the resizes: {error}"));
}

/// `cnibpf load --max-flows`, killed with SIGKILL at ever later points until a run completes;
/// the pod's traffic flows all along.
#[test]
fn killed_resizes_converge() {
    let sim = SimHost::new("szk", sized_keys(4_096, 256, 1_024));
    let pod = LivePod::start(&sim);
    let pin_path = sim.pin_path.display().to_string();
    faults::killed_until_complete(
        "resize",
        || {
            let mut process = Command::new(cnibpf_binary());
            process.args([
                "load",
                "--backend",
                "ebpf",
                "--pin-path",
                &pin_path,
                "--max-flows",
                "262144",
            ]);
            chain::enter_netns_on_exec(&mut process, &sim.host.path());
            process
        },
        || sim.pin_path.join("resize").exists(),
    );
    assert_sizes(&sim, 262_144, 256, 1_024, "after the killed resizes");
    pod.assert_translations(&sim, "after the killed resizes");
    pod.assert_carried_on("across the killed resizes");
}

#[test]
fn a_size_below_what_the_maps_hold_is_refused_and_changes_nothing() {
    let sim = SimHost::new("szs", sized_keys(4_096, 256, 1_024));
    let _container = sim.container("c1", Value::Null);
    // Live masquerade state for 2,000 connections: more than 1,024 flows hold.
    sim.fill_connections(2_000);
    let output = load(&sim, &["--max-flows", "1024"]);
    assert!(
        !output.status.success(),
        "a shrink below the live flows: {output:?}"
    );
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(
        said.contains("maxFlows 1024 is too small")
            && said.contains("map connections would have 1024 entries and holds 2000"),
        "{said}"
    );
    assert_sizes(&sim, 4_096, 256, 1_024, "after the refused shrink");
    let output = load(&sim, &["--max-flows", "100"]);
    assert!(!output.status.success(), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr)
            .contains("--max-flows: must be between 1024 and 4194304, got 100"),
        "{output:?}"
    );
    assert_sizes(&sim, 4_096, 256, 1_024, "after the refused size");
}
