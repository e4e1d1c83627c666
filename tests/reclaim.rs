//! What no DEL will free: a pod whose network namespace went without a DEL (a lost DEL, a
//! crashed runtime — containerd never calls CNI GC) keeps its hostPorts, masquerade, filter
//! and flows. The next ADD that needs its hostPort reclaims it, and so does `cnibpf gc
//! --stale`; an attachment whose interface exists is never touched.

use cnibpf_tests::{
    SimHost, for_both_backends,
    topology::{Backend, port_mappings},
    traffic::{TcpServer, tcp_request},
};
use serde_json::json;

fn attached_ids(sim: &SimHost) -> Vec<String> {
    let mut ids: Vec<String> = sim.inspect()["attachments"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|attachment| attachment["containerID"].as_str().map(str::to_owned))
        .collect();
    ids.sort();
    ids
}

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
        attached_ids(&sim),
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
    let _server = TcpServer::start(&live.netns, live.socket(80), "c2");
    sim.vanish(&gone);
    let pin_path = sim.pin_path.display().to_string();
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
        attached_ids(&sim),
        std::slice::from_ref(&live.attachment.container_id)
    );
    assert_eq!(
        tcp_request(&sim.outside, sim.uplink_target(8081)).as_deref(),
        Ok("c2"),
        "the live attachment still works"
    );
    let inspect = sim.inspect();
    let inspect_text = inspect.to_string();
    assert!(
        !inspect_text.contains("\"hostPort\":8080"),
        "the vanished pod's hostPort went: {inspect}"
    );
    // Nothing else is stale: a second run reclaims nothing.
    let again = sim.cnibpf(&["gc", "--stale", "--pin-path", &pin_path]);
    assert!(again.status.success(), "{again:?}");
    assert_eq!(String::from_utf8_lossy(&again.stdout), "");
    // Without --stale, gc only sweeps expired state.
    let sweep = sim.cnibpf(&["gc", "--pin-path", &pin_path]);
    assert!(sweep.status.success(), "{sweep:?}");
    assert_eq!(
        attached_ids(&sim),
        std::slice::from_ref(&live.attachment.container_id)
    );
}

for_both_backends!(
    the_next_add_reclaims_a_host_port_whose_holder_vanished,
    gc_stale_reclaims_only_attachments_whose_interface_is_gone
);
