//! What no DEL will free: a pod whose network namespace went without a DEL (a lost DEL, a
//! crashed runtime — containerd never calls CNI GC) keeps its hostPorts, masquerade, filter
//! and flows. The next ADD that needs its hostPort reclaims it, and so does `cnibpf gc
//! --stale`; an attachment whose interface exists is never touched, and `gc` without
//! `--stale` touches no attachment at all.

use std::net::SocketAddr;

use cnibpf_tests::{
    SimHost, for_both_backends,
    topology::{Backend, OUTSIDE_ADDR, port_mappings},
    traffic::{TcpServer, tcp_request},
};
use serde_json::json;

fn the_next_add_reclaims_a_host_port_whose_holder_vanished(backend: Backend) {
    let sim = SimHost::on(backend, "rc-add", json!({}));
    let gone = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    sim.vanish(&gone);
    let next = sim
        .add_container("c2", port_mappings(&[(8080, 80, "tcp")]))
        .unwrap_or_else(|error| panic!("{backend:?}: the vanished holder is reclaimed: {error}"));
    let _server = TcpServer::start(&next.netns, next.socket(80), "c2");
    assert_eq!(
        tcp_request(&sim.outside, sim.uplink_target(8080)).as_deref(),
        Ok("c2")
    );
    assert_eq!(
        sim.attached_ids(),
        std::slice::from_ref(&next.attachment.container_id)
    );
    // A live holder is still refused, and named.
    let error = sim
        .add_container("c3", port_mappings(&[(8080, 80, "tcp")]))
        .expect_err("a live holder keeps its hostPort");
    assert_eq!(error.0.error_code(), Some(100), "{error}");
    assert!(
        error.0.error_msg().contains(&next.attachment.container_id),
        "{error}"
    );
}

fn gc_stale_reclaims_only_attachments_whose_interface_is_gone(backend: Backend) {
    let sim = SimHost::on(
        backend,
        "rc-gc",
        json!({ "ipMasq": true, "filter": [
            { "index": 1, "direction": "ingress", "proto": "tcp", "dport": 9, "target": "DROP" },
        ]}),
    );
    let gone = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let live = sim.container("c2", port_mappings(&[(8081, 80, "tcp")]));
    let _servers = [
        TcpServer::start(&gone.netns, gone.socket(80), "c1"),
        TcpServer::start(&live.netns, live.socket(80), "c2"),
    ];
    let outside = SocketAddr::new(OUTSIDE_ADDR.into(), 7000);
    let _outside_server = TcpServer::start(&sim.outside, outside, "outside");
    // The vanishing pod has flows of every kind: one in through its hostPort, one out
    // masqueraded, both tracked by its filter.
    assert_eq!(
        tcp_request(&sim.outside, sim.uplink_target(8080)).as_deref(),
        Ok("c1")
    );
    assert_eq!(tcp_request(&gone.netns, outside).as_deref(), Ok("outside"));
    let owner = sim.owner_of(&gone);
    let owner_text = format!("{owner:016x}");
    match backend {
        Backend::Ebpf => {
            let held = sim.ebpf_maps_holding(owner);
            for map in [
                "owners",
                "endpoints",
                "portmap",
                "connections",
                "masq_sources",
                "masq_excludes",
                "masq_replies",
                "filters",
                "endpoints.sources",
            ] {
                assert!(held.contains(&map), "before: {map} holds the pod: {held:?}");
            }
        }
        Backend::Nftables => {
            let ruleset = sim.nft_ruleset();
            assert!(
                ruleset.contains(&owner_text) && ruleset.contains(&gone.attachment.container_id),
                "before: the table holds the pod:\n{ruleset}"
            );
        }
    }
    sim.vanish(&gone);
    let pin_path = sim.pin_path.display().to_string();
    // Without --stale, gc only sweeps expired state: the vanished attachment stays.
    let sweep = sim.cnibpf(&["gc", "--pin-path", &pin_path]);
    assert!(sweep.status.success(), "{sweep:?}");
    let mut both = vec![
        gone.attachment.container_id.clone(),
        live.attachment.container_id.clone(),
    ];
    both.sort();
    assert_eq!(
        sim.attached_ids(),
        both,
        "gc without --stale reclaims nothing"
    );

    let output = sim.cnibpf(&["gc", "--stale", "--pin-path", &pin_path]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "gc --stale: {output:?}");
    assert!(
        stdout.contains(&gone.attachment.container_id) && stdout.contains("is gone"),
        "gc names what it reclaimed: {stdout}"
    );
    assert!(
        !stdout.contains(&live.attachment.container_id),
        "gc leaves the live one alone: {stdout}"
    );
    assert_eq!(
        sim.attached_ids(),
        std::slice::from_ref(&live.attachment.container_id)
    );
    // Everything of the vanished pod went: hostPorts, masquerade, filter, source check, flows.
    match backend {
        Backend::Ebpf => {
            let held = sim.ebpf_maps_holding(owner);
            assert!(
                held.is_empty(),
                "maps still hold the reclaimed pod: {held:?}"
            );
        }
        Backend::Nftables => {
            let ruleset = sim.nft_ruleset();
            assert!(
                !ruleset.contains(&owner_text) && !ruleset.contains(&gone.attachment.container_id),
                "the table still holds the reclaimed pod:\n{ruleset}"
            );
        }
    }
    // The live attachment still works, in and out.
    assert_eq!(
        tcp_request(&sim.outside, sim.uplink_target(8081)).as_deref(),
        Ok("c2"),
        "the live attachment still works"
    );
    assert_eq!(tcp_request(&live.netns, outside).as_deref(), Ok("outside"));
    sim.check(&live)
        .unwrap_or_else(|error| panic!("CHECK of the live attachment: {error}"));
    // Nothing else is stale: a second run reclaims nothing.
    let again = sim.cnibpf(&["gc", "--stale", "--pin-path", &pin_path]);
    assert!(again.status.success(), "{again:?}");
    assert_eq!(String::from_utf8_lossy(&again.stdout), "");
}

for_both_backends!(
    the_next_add_reclaims_a_host_port_whose_holder_vanished,
    gc_stale_reclaims_only_attachments_whose_interface_is_gone
);
