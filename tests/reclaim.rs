//! What no DEL will free: a pod whose network namespace went without a DEL (a lost DEL, a
//! crashed runtime — containerd never calls CNI GC) keeps its hostPorts, masquerade, filter
//! and flows. The next ADD that needs its hostPort reclaims it, and so does `cnibpf gc
//! --stale`; an attachment whose interface exists is never touched, and `gc` without
//! `--stale` touches no attachment at all. Nor is the datapath trusted past the host it was
//! set up for: a pinPath that outlives its host (a simulated host made again) serves the next
//! one, a datapath another live host's namespace uses is refused, and an uplink made again is
//! hooked again.

use std::{net::SocketAddr, time::Duration};

use cnibpf_tests::{
    Container, SimHost, eventually, for_both_backends,
    topology::{Backend, Family, OUTSIDE_ADDR, SharedPinPath, port_mappings},
    traffic::{TcpServer, UdpServer, connection_rate, tcp_request, udp_request},
};
use serde_json::{Value, json};

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

/// What a pod of `sim` (`port_mappings(POD_PORTS)`, `ipMasq`) is served, or the first thing
/// it is not: its hostPort over TCP and UDP from outside (both families) and over TCP from a
/// host process (127.0.0.1), a burst of connections through it, its masqueraded connection
/// to the outside (seen from the uplink's address).
fn served(sim: &SimHost, pod: &Container) -> Result<(), String> {
    let _servers = (
        Family::BOTH.map(|family| TcpServer::start(&pod.netns, pod.at(family, 80), "pod")),
        Family::BOTH.map(|family| UdpServer::start(&pod.netns, pod.at(family, 53), "pod dns")),
    );
    let outside = SocketAddr::new(OUTSIDE_ADDR.into(), 7000);
    let outside_server = TcpServer::start(&sim.outside, outside, "outside");
    let _echo = cnibpf_tests::traffic::EchoServer::start(&pod.netns, pod.socket(81), 2);
    for family in Family::BOTH {
        let hostport = sim.uplink(family, 8080);
        match tcp_request(&sim.outside, hostport) {
            Ok(answer) if answer == "pod" => {}
            other => {
                return Err(format!(
                    "{family:?}: TCP to the hostPort from outside: {other:?}"
                ));
            }
        }
        match udp_request(&sim.outside, hostport) {
            Ok((answer, _)) if answer == "pod dns" => {}
            other => {
                return Err(format!(
                    "{family:?}: UDP to the hostPort from outside: {other:?}"
                ));
            }
        }
    }
    match sim.host_client("tcp", "127.0.0.1:8080".parse().expect("literal")) {
        Ok((answer, _)) if answer == "pod" => {}
        other => {
            return Err(format!(
                "TCP to 127.0.0.1:8080 from a host process: {other:?}"
            ));
        }
    }
    let burst = connection_rate(
        &sim.outside,
        sim.uplink_target(8081),
        2,
        Duration::from_secs(1),
    );
    if burst.per_second == 0.0 {
        return Err("no connection of a burst through hostPort 8081 was answered".to_owned());
    }
    match tcp_request(&pod.netns, outside) {
        Ok(answer) if answer == "outside" => {}
        other => return Err(format!("the pod's connection out: {other:?}")),
    }
    let seen = outside_server.peers();
    if seen
        .iter()
        .any(|peer| peer.ip() != sim.uplink(Family::V4, 0).ip())
    {
        return Err(format!(
            "the pod's connection out is not masqueraded: the server saw {seen:?}"
        ));
    }
    Ok(())
}

const POD_PORTS: [(u16, u16, &str); 3] = [(8080, 80, "tcp"), (8080, 53, "udp"), (8081, 81, "tcp")];

/// Waits until no hook of the datapath under `sim`'s pinPath attaches an interface: a
/// namespace's interfaces go some time after the namespace is deleted (the kernel dismantles it
/// from a work queue), and until then its datapath still serves it.
fn wait_until_its_hooks_are_gone(sim: &SimHost) {
    assert!(
        eventually(Duration::from_secs(20), || sim.inspect()["ebpfNamespace"]
            .as_str()
            .is_some_and(|note| note.contains("none of its hooks attaches"))),
        "the first host's hooks are still attached: {}",
        sim.inspect()["ebpfNamespace"]
    );
}

/// Two simulated hosts one after the other on one pinPath, the first switched off without
/// `cnibpf unload` — its pods DELed first, or gone with it —: the second host's pods are served
/// as the first's were, CHECK passes, and the first's attachments are reclaimed (eBPF: its
/// first ADD reclaims the datapath whose namespace is gone and sets the node up again).
fn a_pin_path_outliving_its_host_serves_the_next_one(backend: Backend) {
    let shared = SharedPinPath::new(&format!("rc-next-{}", backend.name()));
    let keys = json!({ "ipMasq": true });
    for pods_deleted in [true, false] {
        let what = if pods_deleted {
            "its pods DELed"
        } else {
            "its pods gone with it"
        };
        let first = SimHost::sharing(backend, "rc-first", &shared, keys.clone());
        let pod = first.container("c1", port_mappings(&POD_PORTS));
        served(&first, &pod).unwrap_or_else(|error| panic!("the first host: {error}"));
        if pods_deleted {
            first.del(&pod).expect("DEL");
        }
        first.switch_off();
        drop(pod);
        let second = SimHost::sharing(backend, "rc-second", &shared, keys.clone());
        if backend == Backend::Ebpf {
            wait_until_its_hooks_are_gone(&second);
        }
        let pod = second
            .add_container("c1", port_mappings(&POD_PORTS))
            .unwrap_or_else(|error| panic!("the second host ({what}): ADD: {error}"));
        served(&second, &pod).unwrap_or_else(|error| panic!("the second host ({what}): {error}"));
        second
            .check(&pod)
            .unwrap_or_else(|error| panic!("the second host ({what}): CHECK: {error}"));
        assert_eq!(
            second.attached_ids(),
            std::slice::from_ref(&pod.attachment.container_id),
            "the second host ({what}) holds its own pod alone"
        );
        // Gone with its host too, for the next round's first.
        second.switch_off();
    }
}

/// A host's datapath is not another live host's: on a pinPath two hosts share at once, the
/// second's ADD is refused with an error naming both namespaces, a DEL of the first's pod from
/// there finds nothing of its own and changes nothing, its CHECK fails, `gc --stale` and
/// `unload` are refused; the first host's pod is served throughout. Once the first host is gone, the second's ADD reclaims the datapath.
#[test]
fn a_datapath_another_live_namespace_uses_is_refused() {
    let shared = SharedPinPath::new("rc-other");
    let keys = json!({ "ipMasq": true });
    let first = SimHost::sharing(Backend::Ebpf, "rc-live", &shared, keys.clone());
    let pod = first.container("c1", port_mappings(&POD_PORTS));
    let second = SimHost::sharing(Backend::Ebpf, "rc-beside", &shared, keys.clone());
    let refused = second
        .add_container("c2", port_mappings(&POD_PORTS))
        .expect_err("a datapath another namespace serves is refused");
    assert_eq!(refused.0.error_code(), Some(106), "{refused}");
    let message = refused.0.error_msg();
    assert!(
        message.contains("another network namespace") && message.contains("uplink up0"),
        "names both namespaces and the hooks: {message}"
    );
    // The first host's own pod, by its own configuration, from the second host: none of the
    // second namespace's. Its DEL removes nothing; its CHECK is refused.
    let entry = first.chain.conflist()["plugins"][1].clone();
    let config = first
        .chain
        .plugin_config(&entry, "1.0.0", Some(&pod.result), &Value::Null)
        .to_string();
    let del = second.invoke_cnibpf("DEL", Some(&pod.attachment), &config);
    assert_eq!(del.exit_code, 0, "DEL from the other namespace: {del:?}");
    // (Its pod's interface is not even found from here: the host side is the first's.)
    let check = second.invoke_cnibpf("CHECK", Some(&pod.attachment), &config);
    assert_ne!(
        check.exit_code, 0,
        "CHECK from the other namespace fails: {check:?}"
    );
    let pin_path = shared.path.display().to_string();
    let gc = second.cnibpf(&["gc", "--stale", "--pin-path", &pin_path]);
    assert!(
        !gc.status.success()
            && String::from_utf8_lossy(&gc.stderr).contains("another network namespace"),
        "gc --stale from the other namespace is refused: {gc:?}"
    );
    let unload = second.cnibpf(&["unload", "--pin-path", &pin_path]);
    assert!(
        !unload.status.success(),
        "unload from the other namespace is refused: {unload:?}"
    );
    served(&first, &pod).unwrap_or_else(|error| panic!("the first host meanwhile: {error}"));
    first
        .check(&pod)
        .unwrap_or_else(|error| panic!("the first host's CHECK: {error}"));
    first.switch_off();
    drop(pod);
    wait_until_its_hooks_are_gone(&second);
    // (The refused pod's address is still the bridge's: its runtime would DEL it.)
    let pod = second
        .add_container("c3", port_mappings(&POD_PORTS))
        .unwrap_or_else(|error| panic!("once the first host is gone: {error}"));
    served(&second, &pod).unwrap_or_else(|error| panic!("the second host: {error}"));
}

/// The uplink deleted and made again under a running pod — at the index it had, and at a new
/// one —: the eBPF datapath is not believed hooked (CHECK fails, naming the uplink), the next
/// pod's ADD hooks it again, and the running pod is served again; the nftables backend serves
/// throughout.
fn an_uplink_made_again_under_a_running_pod_is_hooked_again(backend: Backend) {
    let sim = SimHost::on(backend, "rc-uplink", json!({ "ipMasq": true }));
    let running = sim.container("c1", port_mappings(&POD_PORTS));
    served(&sim, &running).unwrap_or_else(|error| panic!("before: {error}"));
    for (round, same_index) in [("the same index", true), ("a new index", false)] {
        sim.remake_uplink(same_index);
        match backend {
            Backend::Ebpf => {
                let check = sim
                    .check(&running)
                    .expect_err("CHECK fails while the uplink is not hooked");
                assert!(
                    check.0.error_msg().contains("up0"),
                    "{round}: names the uplink: {check}"
                );
            }
            Backend::Nftables => {
                sim.check(&running)
                    .unwrap_or_else(|error| panic!("{round}: CHECK: {error}"));
            }
        }
        let next = sim.container(&format!("c{}", 2 + usize::from(same_index)), Value::Null);
        served(&sim, &running)
            .unwrap_or_else(|error| panic!("{round}, after the next ADD: {error}"));
        sim.check(&running)
            .unwrap_or_else(|error| panic!("{round}, after the next ADD: CHECK: {error}"));
        sim.del(&next).expect("DEL");
    }
}

for_both_backends!(
    the_next_add_reclaims_a_host_port_whose_holder_vanished,
    gc_stale_reclaims_only_attachments_whose_interface_is_gone,
    a_pin_path_outliving_its_host_serves_the_next_one,
    an_uplink_made_again_under_a_running_pod_is_hooked_again,
);
