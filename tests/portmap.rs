//! Port mapping with real traffic from the outside namespace through the uplink (the
//! behaviour for both backends, the eBPF backend's pinned programs and maps).

use std::net::{IpAddr, SocketAddr};

use std::time::Duration;

use cnibpf_common::connections::{Connection, ConnectionKey, conntrack::timeout_ns};
use cnibpf_tests::{
    SimHost, eventually, for_both_backends,
    state::dual_stack,
    topology::{Backend, HOST_UPLINK_ADDR, OUTSIDE_ADDR, UPLINK, port_mappings},
    traffic::{TcpServer, UdpServer, tcp_request, udp_request},
};
use serde_json::{Value, json};

fn expect_answer(sim: &SimHost, port: u16, expected: &str) {
    let answer = tcp_request(&sim.outside, sim.uplink_target(port))
        .unwrap_or_else(|error| panic!("request to hostPort {port} failed: {error}"));
    assert_eq!(answer, expected, "answer through hostPort {port}");
}

fn expect_refused(sim: &SimHost, port: u16) {
    let outcome = tcp_request(&sim.outside, sim.uplink_target(port));
    assert!(
        outcome.is_err(),
        "hostPort {port} must be closed, got {outcome:?}"
    );
}

fn outside_client_reaches_container_through_host_port(backend: Backend) {
    let sim = SimHost::on(backend, "pm-basic", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let server = TcpServer::start(&c1.netns, c1.socket(80), "hello from c1");

    expect_answer(&sim, 8080, "hello from c1");
    let peers = server.peers();
    assert_eq!(peers.len(), 1, "the container saw {peers:?}");
    assert_eq!(
        peers[0].ip(),
        IpAddr::V4(OUTSIDE_ADDR),
        "the container must see the client's own address"
    );

    if backend == Backend::Ebpf {
        let host_if = sim.host_interface(&c1);
        assert_eq!(
            sim.tcx_programs(&host_if),
            ["from_container", "to_container"]
        );
        assert_eq!(
            sim.tcx_programs(UPLINK),
            ["uplink_egress", "uplink_ingress"]
        );
    }

    sim.del(&c1)
        .unwrap_or_else(|error| panic!("DEL failed: {error}"));
    expect_refused(&sim, 8080);
    assert!(
        sim.holds_no_state(),
        "the last DEL removes the attachment's entries, or the table"
    );
    if backend == Backend::Ebpf {
        assert_eq!(
            sim.tcx_programs(UPLINK),
            ["uplink_egress", "uplink_ingress"],
            "the uplink's stay for the next pod, until `cnibpf uninstall`"
        );
    }
}

fn udp_replies_come_from_the_host_port(backend: Backend) {
    let sim = SimHost::on(backend, "pm-udp", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(5353, 53, "udp")]));
    let server = UdpServer::start(&c1.netns, c1.socket(53), "dns from c1");

    let (answer, from) = udp_request(&sim.outside, sim.uplink_target(5353))
        .unwrap_or_else(|error| panic!("UDP request to hostPort 5353 failed: {error}"));
    assert_eq!(answer, "dns from c1");
    assert_eq!(
        from,
        sim.uplink_target(5353),
        "the reply must come from the hostPort the client used"
    );
    assert_eq!(server.peers()[0].ip(), IpAddr::V4(OUTSIDE_ADDR));
}

#[test]
fn second_add_reuses_pinned_programs() {
    let sim = SimHost::new("pm-reuse", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let before: Vec<u32> = ["uplink_ingress", "from_container"]
        .iter()
        .map(|name| sim.pinned_program_id(name))
        .collect();

    let c2 = sim.container("c2", port_mappings(&[(8081, 80, "tcp")]));
    let after: Vec<u32> = ["uplink_ingress", "from_container"]
        .iter()
        .map(|name| sim.pinned_program_id(name))
        .collect();
    assert_eq!(
        before, after,
        "the second ADD must reuse the pinned programs, not load new ones"
    );
    assert_eq!(
        sim.tcx_programs(&sim.host_interface(&c2)),
        ["from_container", "to_container"]
    );
    assert_eq!(
        sim.tcx_programs(UPLINK),
        ["uplink_egress", "uplink_ingress"],
        "the uplink is hooked once"
    );

    let _s1 = TcpServer::start(&c1.netns, c1.socket(80), "c1");
    let _s2 = TcpServer::start(&c2.netns, c2.socket(80), "c2");
    expect_answer(&sim, 8080, "c1");
    expect_answer(&sim, 8081, "c2");

    sim.del(&c1)
        .unwrap_or_else(|error| panic!("DEL c1 failed: {error}"));
    expect_refused(&sim, 8080);
    expect_answer(&sim, 8081, "c2");
    assert_eq!(
        sim.tcx_programs(UPLINK),
        ["uplink_egress", "uplink_ingress"],
        "c2 still needs the uplink"
    );
}

fn repeated_add_replaces_the_attachments_own_mappings(backend: Backend) {
    let sim = SimHost::on(backend, "pm-readd", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let _server = TcpServer::start(&c1.netns, c1.socket(80), "c1");
    expect_answer(&sim, 8080, "c1");

    if backend == Backend::Ebpf {
        let ports: Vec<u64> = sim
            .translations()
            .into_iter()
            .map(|(_, port)| port)
            .collect();
        assert_eq!(ports, [8080], "the request through 8080 left its flow");
    }

    let mut again = c1.attachment.clone();
    again.capability_args = port_mappings(&[(9090, 80, "tcp")]);
    sim.chain
        .add_again(&again, "cnibpf")
        .unwrap_or_else(|error| panic!("second ADD failed: {error}"));
    expect_refused(&sim, 8080);
    expect_answer(&sim, 9090, "c1");
    assert_eq!(
        sim.installed_host_ports(),
        dual_stack(&c1.attachment.container_id, 9090)
    );

    // The very same ADD once more changes nothing.
    sim.chain
        .add_again(&again, "cnibpf")
        .unwrap_or_else(|error| panic!("third ADD failed: {error}"));
    expect_answer(&sim, 9090, "c1");
    sim.check(&c1)
        .unwrap_or_else(|error| panic!("CHECK after re-ADD failed: {error}"));
}

fn host_port_held_by_another_attachment_is_refused_with_100(backend: Backend) {
    let sim = SimHost::on(backend, "pm-conflict", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let _server = TcpServer::start(&c1.netns, c1.socket(80), "c1");

    let error = sim
        .add_container("c2", port_mappings(&[(8080, 80, "tcp")]))
        .expect_err("a second holder of tcp/8080 must be refused");
    assert_eq!(error.0.plugin, "cnibpf");
    assert_eq!(error.0.error_code(), Some(100), "{error}");
    let msg = error.0.error_msg();
    assert!(
        msg.contains("hostPort 8080/tcp")
            && msg.contains(&c1.attachment.container_id)
            && msg.contains("eth0")
            && msg.contains(&sim.network()),
        "the message must name the port and the holder: {msg}"
    );
    // Nothing of c2 was installed, c1 still works.
    assert_eq!(
        sim.installed_host_ports(),
        dual_stack(&c1.attachment.container_id, 8080)
    );
    assert_eq!(
        sim.inspect()["attachments"].as_array().map(Vec::len),
        Some(1)
    );
    expect_answer(&sim, 8080, "c1");

    // A wildcard overlaps a specific hostIP, and another protocol does not conflict.
    let specific = json!({ "portMappings": [{ "hostPort": 8080, "containerPort": 80, "hostIP": HOST_UPLINK_ADDR.to_string() }] });
    let error = sim
        .add_container("c3", specific)
        .expect_err("a specific hostIP under a wildcard must be refused");
    assert_eq!(error.0.error_code(), Some(100), "{error}");
    sim.container("c4", port_mappings(&[(8080, 80, "udp")]));

    // ...and a wildcard overlaps a specific hostIP held before it.
    let specific = json!({ "portMappings": [{ "hostPort": 9090, "containerPort": 80, "hostIP": HOST_UPLINK_ADDR.to_string() }] });
    let c5 = sim.container("c5", specific);
    let error = sim
        .add_container("c6", port_mappings(&[(9090, 80, "tcp")]))
        .expect_err("a wildcard over a specific hostIP must be refused");
    assert_eq!(error.0.error_code(), Some(100), "{error}");
    assert!(
        error.0.error_msg().contains(&c5.attachment.container_id),
        "{error}"
    );
    sim.del(&c5)
        .unwrap_or_else(|error| panic!("DEL of c5: {error}"));
    sim.container("c7", port_mappings(&[(9090, 80, "tcp")]));
}

fn host_ip_restricts_the_mapping_to_that_address(backend: Backend) {
    let sim = SimHost::on(backend, "pm-hostip", json!({}));
    sim.host
        .exec(&["ip", "addr", "add", "198.51.100.1/24", "dev", UPLINK]);
    sim.outside
        .exec(&["ip", "addr", "add", "198.51.100.2/24", "dev", "eth0"]);
    let mapping = json!({ "portMappings": [{ "hostPort": 8080, "containerPort": 80, "protocol": "TCP", "hostIP": "198.51.100.1" }] });
    let c1 = sim.container("c1", mapping);
    let _server = TcpServer::start(&c1.netns, c1.socket(80), "c1");

    let answer = tcp_request(&sim.outside, "198.51.100.1:8080".parse().expect("literal"));
    assert_eq!(answer.as_deref(), Ok("c1"));
    expect_refused(&sim, 8080);
}

fn traffic_routed_through_the_host_is_not_captured_by_a_wildcard_host_port(backend: Backend) {
    let sim = SimHost::on(backend, "pm-routed", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let _server = TcpServer::start(&c1.netns, c1.socket(80), "c1");
    sim.route_outside_to_containers();

    // Straight to the container's own port 80 works (plain routing)...
    let direct = tcp_request(&sim.outside, c1.socket(80));
    assert_eq!(direct.as_deref(), Ok("c1"));
    // ...but port 8080 of the container address is not the host's hostPort: nothing listens.
    let routed = tcp_request(&sim.outside, SocketAddr::new(IpAddr::V4(c1.address), 8080));
    assert!(
        routed.is_err(),
        "a packet for {}:8080 was translated as if it were for the host: {routed:?}",
        c1.address
    );
}

/// A container with neither hostPorts nor a filter is hooked on what it sends only: nothing it
/// receives needs a program there, and each tcx link costs its ADD a grace period. A re-ADD
/// that gives it a filter hooks what it receives, one that takes the filter away unhooks it
/// again; CHECK agrees with either set, and the filter takes effect and goes with the hook.
#[test]
fn only_the_hooks_a_container_needs_are_attached() {
    let sim = SimHost::new("pm-hooks", json!({}));
    sim.route_outside_to_containers();
    let plain = sim.container("c1", Value::Null);
    let veth = sim.host_interface(&plain);
    assert_eq!(sim.tcx_programs(&veth), ["from_container"]);
    sim.check(&plain)
        .unwrap_or_else(|error| panic!("CHECK of a container hooked on one side: {error}"));
    let mapped = sim.container("c2", port_mappings(&[(8080, 80, "tcp")]));
    assert_eq!(
        sim.tcx_programs(&sim.host_interface(&mapped)),
        ["from_container", "to_container"],
        "a container with hostPorts is hooked on both sides"
    );
    sim.check(&mapped)
        .unwrap_or_else(|error| panic!("CHECK of a container hooked on both sides: {error}"));
    let _server = TcpServer::start(&plain.netns, plain.socket(81), "c1");
    let request = || tcp_request(&sim.outside, plain.socket(81));
    assert_eq!(request().as_deref(), Ok("c1"), "routed to the container");
    let filtered = json!({ "filter": [
        { "index": 1, "direction": "ingress", "proto": "tcp", "dport": 81, "target": "DROP" },
    ]});
    sim.readd_with(&plain, filtered)
        .unwrap_or_else(|error| panic!("re-ADD with a filter: {error}"));
    assert_eq!(sim.tcx_programs(&veth), ["from_container", "to_container"]);
    assert!(
        request().is_err(),
        "the ingress rule drops what is routed to it"
    );
    sim.readd_with(&plain, json!({}))
        .unwrap_or_else(|error| panic!("re-ADD without the filter: {error}"));
    assert_eq!(sim.tcx_programs(&veth), ["from_container"]);
    sim.check(&plain)
        .unwrap_or_else(|error| panic!("CHECK without the filter: {error}"));
    assert_eq!(request().as_deref(), Ok("c1"), "unfiltered again");
}

#[test]
fn check_detects_missing_state_and_re_add_repairs_it() {
    let sim = SimHost::new("pm-check", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let _server = TcpServer::start(&c1.netns, c1.socket(80), "c1");
    sim.check(&c1)
        .unwrap_or_else(|error| panic!("CHECK of a fresh ADD failed: {error}"));

    // A mapping deleted behind cnibpf's back (wildcard IPv4 tcp/8080: 16 zero address bytes,
    // the port little-endian, protocol 6, family 2).
    let portmap = sim.pin_path.join("portmap");
    let mut delete = std::process::Command::new("bpftool");
    delete
        .args(["map", "delete", "pinned"])
        .arg(&portmap)
        .arg("key");
    delete
        .args(std::iter::repeat_n("0", 16))
        .args(["0x90", "0x1f", "6", "2"]);
    cnibpf_tests::netns::run_checked(&mut delete);
    let error = sim
        .check(&c1)
        .expect_err("CHECK must notice the missing mapping");
    assert_eq!(error.0.error_code(), Some(105), "{error}");
    assert!(error.0.error_msg().contains("tcp 0.0.0.0:8080"), "{error}");
    sim.chain
        .add_again(&c1.attachment, "cnibpf")
        .unwrap_or_else(|error| panic!("repairing ADD failed: {error}"));
    sim.check(&c1)
        .unwrap_or_else(|error| panic!("CHECK after re-adding the mapping failed: {error}"));

    // A detached endpoint program: its link unpinned behind cnibpf's back.
    let host_if = sim.host_interface(&c1);
    let from_link = std::fs::read_dir(sim.pin_path.join("links"))
        .expect("links dir")
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .find(|path| {
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            name.starts_with("endpoint-") && name.ends_with("-from")
        })
        .expect("the endpoint's from_container link is pinned");
    std::fs::remove_file(&from_link).expect("unpin the link");
    assert!(
        eventually(Duration::from_secs(3), || !sim
            .tcx_programs(&host_if)
            .contains(&"from_container".to_owned())),
        "an unpinned link is released"
    );
    let error = sim
        .check(&c1)
        .expect_err("CHECK must notice the detached program");
    assert_eq!(error.0.error_code(), Some(105), "{error}");
    assert!(error.0.error_msg().contains("from_container"), "{error}");

    // Everything pinned gone: the hostPort stops working and CHECK fails.
    std::fs::remove_dir_all(&sim.pin_path).expect("remove pins");
    // The kernel releases an unpinned link from a work queue: wait for the uplink hooks to go.
    assert!(
        eventually(Duration::from_secs(3), || sim
            .tcx_programs(UPLINK)
            .is_empty()),
        "unpinned uplink links were never released"
    );
    expect_refused(&sim, 8080);
    let error = sim
        .check(&c1)
        .expect_err("CHECK must notice the missing state");
    assert_eq!(error.0.error_code(), Some(105), "{error}");

    // The runtime's answer to a failed CHECK: ADD again.
    sim.chain
        .add_again(&c1.attachment, "cnibpf")
        .unwrap_or_else(|error| panic!("repairing ADD failed: {error}"));
    sim.check(&c1)
        .unwrap_or_else(|error| panic!("CHECK after repair failed: {error}"));
    expect_answer(&sim, 8080, "c1");
}

fn gc_removes_only_attachments_missing_from_the_valid_list(backend: Backend) {
    let sim = SimHost::on(backend, "pm-gc", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let c2 = sim.container("c2", port_mappings(&[(8081, 80, "tcp")]));
    let _s1 = TcpServer::start(&c1.netns, c1.socket(80), "c1");
    let _s2 = TcpServer::start(&c2.netns, c2.socket(80), "c2");

    sim.chain
        .gc(&[(&c1.attachment.container_id, "eth0")])
        .unwrap_or_else(|error| panic!("GC failed: {error}"));
    expect_answer(&sim, 8080, "c1");
    expect_refused(&sim, 8081);
    assert_eq!(
        sim.installed_host_ports(),
        dual_stack(&c1.attachment.container_id, 8080)
    );
    if backend == Backend::Ebpf {
        let c2_if = sim.host_interface(&c2);
        assert!(
            eventually(Duration::from_secs(3), || sim
                .tcx_programs(&c2_if)
                .is_empty()),
            "GC detaches c2's programs"
        );
    }
}

fn del_is_idempotent_and_tolerates_missing_pieces(backend: Backend) {
    let sim = SimHost::on(backend, "pm-del", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let c2 = sim.container("c2", port_mappings(&[(8081, 80, "tcp")]));
    sim.del(&c1)
        .unwrap_or_else(|error| panic!("first DEL failed: {error}"));
    sim.del(&c1)
        .unwrap_or_else(|error| panic!("second DEL failed: {error}"));

    // DEL after the container's namespace is gone.
    let c2_attachment = c2.attachment.clone();
    drop(c2);
    sim.chain
        .del(&c2_attachment)
        .unwrap_or_else(|error| panic!("DEL without netns failed: {error}"));
    assert!(sim.holds_no_state(), "no attachment left, no state left");

    // DEL of something never added, with nothing of it pinned.
    let mut stranger = c2_attachment;
    stranger.container_id = "never-added".to_owned();
    sim.chain
        .del(&stranger)
        .unwrap_or_else(|error| panic!("DEL of an unknown attachment failed: {error}"));
}

fn parallel_adds_and_dels_lose_no_update(backend: Backend) {
    let sim = SimHost::on(backend, "pm-parallel", json!({}));
    let containers: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..6u16)
            .map(|n| {
                let sim = &sim;
                scope.spawn(move || {
                    sim.container(&format!("c{n}"), port_mappings(&[(8000 + n, 80, "tcp")]))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().expect("ADD thread"))
            .collect()
    });
    let servers: Vec<_> = containers
        .iter()
        .map(|c| TcpServer::start(&c.netns, c.socket(80), &c.attachment.container_id))
        .collect();
    assert_eq!(
        sim.installed_host_ports().len(),
        12,
        "every parallel ADD's mapping is installed"
    );
    for (n, container) in (0..6u16).zip(&containers) {
        expect_answer(&sim, 8000 + n, &container.attachment.container_id);
    }
    drop(servers);

    std::thread::scope(|scope| {
        for container in &containers {
            let sim = &sim;
            scope.spawn(move || {
                sim.del(container)
                    .unwrap_or_else(|error| panic!("DEL: {error}"))
            });
        }
    });
    assert!(
        sim.holds_no_state(),
        "the parallel DELs removed every attachment's state"
    );
}

#[test]
fn programs_of_another_build_are_replaced_and_links_follow() {
    let sim = SimHost::new("pm-upgrade", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let _server = TcpServer::start(&c1.netns, c1.socket(80), "c1");
    let c1_if = sim.host_interface(&c1);
    let old_from_container = sim.pinned_program_id("from_container");
    let old_uplink = sim.pinned_program_id("uplink_ingress");

    // As if an older cnibpf of the same map layout had pinned the programs.
    let version = sim.layout_version();
    let mut layout = Vec::new();
    layout.extend(u64::from_le_bytes(*b"cnibpf\0\0").to_le_bytes());
    layout.extend(version.to_le_bytes());
    layout.extend(0u32.to_le_bytes());
    layout.extend(42u64.to_le_bytes());
    sim.write_layout(&layout);

    let c2 = sim.container("c2", port_mappings(&[(8081, 80, "tcp")]));
    let new_from_container = sim.pinned_program_id("from_container");
    let new_uplink = sim.pinned_program_id("uplink_ingress");
    assert_ne!(
        new_from_container, old_from_container,
        "the programs were reloaded"
    );
    assert_ne!(new_uplink, old_uplink);
    let attached_c1: Vec<u32> = sim
        .tcx_program_ids(&c1_if)
        .into_iter()
        .map(|(_, id)| id)
        .collect();
    assert!(
        attached_c1.contains(&new_from_container),
        "c1's existing link moved to the new program: {attached_c1:?}"
    );
    assert!(!attached_c1.contains(&old_from_container));
    let uplink: Vec<u32> = sim
        .tcx_program_ids(UPLINK)
        .into_iter()
        .map(|(_, id)| id)
        .collect();
    assert!(
        uplink.contains(&new_uplink) && !uplink.contains(&old_uplink),
        "{uplink:?}"
    );
    assert_eq!(uplink.len(), 2, "still one program per uplink hook");
    expect_answer(&sim, 8080, "c1");
    sim.check(&c1)
        .unwrap_or_else(|error| panic!("CHECK of c1 after the upgrade: {error}"));
    sim.check(&c2)
        .unwrap_or_else(|error| panic!("CHECK of c2: {error}"));
}

#[test]
fn gc_sweeps_translations_idle_past_their_timeout() {
    let sim = SimHost::new("pm-idle", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp"), (5353, 53, "udp")]));
    let _tcp = TcpServer::start(&c1.netns, c1.socket(80), "c1");
    let _udp = UdpServer::start(&c1.netns, c1.socket(53), "c1");
    expect_answer(&sim, 8080, "c1");
    udp_request(&sim.outside, sim.uplink_target(5353)).expect("udp through the hostPort");
    let mut ports: Vec<u64> = sim
        .translations()
        .into_iter()
        .map(|(_, port)| port)
        .collect();
    ports.sort_unstable();
    assert_eq!(ports, [5353, 8080]);

    // Only the UDP flow falls silent longer than its timeout.
    let mut flows = sim.pinned_hash_map::<ConnectionKey, Connection>("connections");
    for (key, mut value) in sim.connections() {
        if key.protocol == 17 {
            let age = timeout_ns(key.protocol, value.state) + 1_000_000_000;
            assert!(
                value.last_seen_ns > age,
                "the monotonic clock started too recently"
            );
            value.last_seen_ns -= age;
            flows.insert(&key, &value, 0).expect("age the UDP flow");
        }
    }
    sim.chain
        .gc(&[(c1.attachment.container_id.as_str(), "eth0")])
        .unwrap_or_else(|error| panic!("GC failed: {error}"));
    let ports: Vec<u64> = sim
        .translations()
        .into_iter()
        .map(|(_, port)| port)
        .collect();
    assert_eq!(
        ports,
        [8080],
        "the idle UDP translation was swept, the TCP one kept"
    );
}

for_both_backends!(
    outside_client_reaches_container_through_host_port,
    udp_replies_come_from_the_host_port,
    repeated_add_replaces_the_attachments_own_mappings,
    host_port_held_by_another_attachment_is_refused_with_100,
    host_ip_restricts_the_mapping_to_that_address,
    traffic_routed_through_the_host_is_not_captured_by_a_wildcard_host_port,
    gc_removes_only_attachments_missing_from_the_valid_list,
    del_is_idempotent_and_tolerates_missing_pieces,
    parallel_adds_and_dels_lose_no_update,
);
