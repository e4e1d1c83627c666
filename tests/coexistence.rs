//! cnibpf shares its interfaces: the reference `bandwidth` plugin chained before or after it
//! still shapes (and cnibpf still filters and translates), and an operator's tc filter or
//! another tcx program on the uplink or a container's veth still sees every packet cnibpf
//! does not take.

use std::{
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use cnibpf_tests::{
    SimHost, eventually, for_both_backends,
    foreign::{Hook, IcmpDropper, PinnedIcmpDropper},
    topology::{
        Backend, Chained, Container, GATEWAY, HOST_UPLINK_ADDR, OUTSIDE_ADDR, UPLINK,
        bandwidth_plugin,
    },
    traffic::{SinkServer, TcpServer, ping, tcp_request, tcp_upload},
};
use serde_json::{Value, json};

/// 8 Mbit/s both ways, with a 50 kB burst: 2 MB take about two seconds.
const RATE_BITS: u64 = 8_000_000;
const BURST_BITS: u64 = 400_000;
const UPLOAD_BYTES: usize = 2_000_000;
/// Shaped to 8 Mbit/s, 2 MB cannot arrive in less; unshaped they take milliseconds here.
const SHAPED_AT_LEAST: Duration = Duration::from_millis(1_400);
const UNSHAPED_AT_MOST: Duration = Duration::from_millis(1_000);

fn cnibpf_keys(backend: Backend, extra: Value) -> Value {
    let mut keys = json!({
        "backend": backend.name(),
        "ipMasq": true,
        "filter": [{ "index": 10, "proto": "tcp", "dport": 81, "direction": "ingress", "target": "DROP" }],
    });
    if let (Some(keys), Some(extra)) = (keys.as_object_mut(), extra.as_object()) {
        keys.extend(extra.clone());
    }
    keys
}

fn id(base: &str, backend: Backend) -> String {
    match backend {
        Backend::Ebpf => base.to_owned(),
        Backend::Nftables => format!("{base}-n"),
    }
}

fn timed_upload(from: &cnibpf_tests::Netns, to: SocketAddr) -> Duration {
    let started = Instant::now();
    let received = tcp_upload(from, to, UPLOAD_BYTES, Duration::from_secs(20))
        .unwrap_or_else(|error| panic!("upload to {to} failed: {error}"));
    assert_eq!(received, UPLOAD_BYTES as u64, "the sink got everything");
    started.elapsed()
}

/// The pod with shaping: its hostPort traffic (into it) and its masqueraded traffic (out of it)
/// are held to the rates; a neighbour without shaping is not; the filter and both translations
/// work.
fn shapes_filters_and_translates(sim: &SimHost, backend: Backend) {
    let shaped = sim.container(
        "bw",
        json!({
            "portMappings": [
                { "hostPort": 8080, "containerPort": 80, "protocol": "tcp" },
                { "hostPort": 8081, "containerPort": 81, "protocol": "tcp" },
            ],
            "bandwidth": {
                "ingressRate": RATE_BITS, "ingressBurst": BURST_BITS,
                "egressRate": RATE_BITS, "egressBurst": BURST_BITS,
            },
        }),
    );
    let plain: Container = sim.container("plain", json!({}));
    let _sink = SinkServer::start(&shaped.netns, shaped.socket(80));
    let _blocked = TcpServer::start(&shaped.netns, shaped.socket(81), "port 81");
    let outside_sink = SinkServer::start(&sim.outside, SocketAddr::new(OUTSIDE_ADDR.into(), 9000));
    let outside_web = TcpServer::start(
        &sim.outside,
        SocketAddr::new(OUTSIDE_ADDR.into(), 9001),
        "outside",
    );

    let into_pod = timed_upload(&sim.outside, sim.uplink_target(8080));
    assert!(
        into_pod >= SHAPED_AT_LEAST,
        "{}: 2 MB through the hostPort into the shaped pod took {into_pod:?}: not shaped to 8 Mbit/s",
        backend.name()
    );
    let out_of_pod = timed_upload(&shaped.netns, SocketAddr::new(OUTSIDE_ADDR.into(), 9000));
    assert!(
        out_of_pod >= SHAPED_AT_LEAST,
        "{}: 2 MB from the shaped pod, masqueraded, took {out_of_pod:?}: not shaped",
        backend.name()
    );
    let unshaped = timed_upload(&plain.netns, SocketAddr::new(OUTSIDE_ADDR.into(), 9000));
    assert!(
        unshaped <= UNSHAPED_AT_MOST,
        "{}: the unshaped neighbour's 2 MB took {unshaped:?}",
        backend.name()
    );
    drop(outside_sink);

    tcp_request(&shaped.netns, SocketAddr::new(OUTSIDE_ADDR.into(), 9001))
        .unwrap_or_else(|error| panic!("masqueraded request from the shaped pod: {error}"));
    assert_eq!(
        outside_web.peers()[0].ip(),
        IpAddr::V4(HOST_UPLINK_ADDR),
        "the outside saw the uplink's address"
    );
    assert!(
        tcp_request(&sim.outside, sim.uplink_target(8081)).is_err(),
        "filter rule 10 drops what reaches port 81 through the hostPort"
    );
    if backend == Backend::Ebpf {
        assert!(
            tcp_request(&plain.netns, shaped.socket(81)).is_err(),
            "filter rule 10 holds for a neighbour on the bridge"
        );
    }
}

fn bandwidth_chained_before_cnibpf(backend: Backend) {
    let sim = SimHost::with_chain(
        &id("bw-before", backend),
        vec![
            bandwidth_plugin(),
            Chained::Cnibpf(cnibpf_keys(backend, json!({}))),
        ],
    );
    shapes_filters_and_translates(&sim, backend);
}

/// Chained after cnibpf, the `bandwidth` plugin's qdiscs come after cnibpf's ADD: cnibpf learns
/// that the pod is shaped from the capability, which it declares too.
fn bandwidth_chained_after_cnibpf(backend: Backend) {
    let sim = SimHost::with_chain(
        &id("bw-after", backend),
        vec![
            Chained::Cnibpf(cnibpf_keys(
                backend,
                json!({ "capabilities": { "portMappings": true, "bandwidth": true } }),
            )),
            bandwidth_plugin(),
        ],
    );
    shapes_filters_and_translates(&sim, backend);
}

/// Chained after cnibpf in a hand-written conflist whose cnibpf entry does not declare the
/// `bandwidth` capability (k3s's chain after portmap is swapped for cnibpf): cnibpf's ADD cannot
/// know of the shaping, and the datapath learns of the qdiscs when the plugin adds them.
fn bandwidth_chained_after_cnibpf_without_its_capability(backend: Backend) {
    let sim = SimHost::with_chain(
        &id("bw-unkn", backend),
        vec![
            Chained::Cnibpf(cnibpf_keys(backend, json!({}))),
            bandwidth_plugin(),
        ],
    );
    shapes_filters_and_translates(&sim, backend);
}

/// An operator's tc filter and another tcx program, on the uplink and on a container's veth,
/// keep judging what cnibpf passes through; cnibpf's own traffic keeps working beside them.
fn foreign_filters_and_programs_keep_seeing_traffic(backend: Backend) {
    let sim = SimHost::on(backend, "foreign", json!({ "ipMasq": true }));
    let c1 = sim.container(
        "c1",
        json!({ "portMappings": [{ "hostPort": 8080, "containerPort": 80, "protocol": "tcp" }] }),
    );
    let _web = TcpServer::start(&c1.netns, c1.socket(80), "c1");
    let host_address = IpAddr::V4(HOST_UPLINK_ADDR);
    let hostport_works =
        || tcp_request(&sim.outside, sim.uplink_target(8080)).is_ok_and(|answer| answer == "c1");
    assert!(ping(&sim.outside, host_address) && hostport_works());

    // An operator's classic tc filter on the uplink: a cls_bpf program dropping ICMP.
    let operator_pin = sim.pin_path.with_file_name(format!(
        "{}-operator",
        sim.pin_path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
    ));
    let operator = PinnedIcmpDropper::pin(&operator_pin);
    let pinned = operator.path.display().to_string();
    sim.host
        .exec(&["tc", "qdisc", "add", "dev", UPLINK, "clsact"]);
    sim.host.exec(&[
        "tc", "filter", "add", "dev", UPLINK, "ingress", "bpf", "da", "pinned", &pinned,
    ]);
    assert!(
        !ping(&sim.outside, host_address),
        "the operator's tc filter on {UPLINK} still drops ICMP with cnibpf attached"
    );
    assert!(hostport_works(), "the hostPort works beside the filter");
    sim.host
        .exec(&["tc", "qdisc", "del", "dev", UPLINK, "clsact"]);
    assert!(ping(&sim.outside, host_address));

    // Another tcx program after cnibpf's on the uplink.
    let uplink_dropper = IcmpDropper::attach(&sim.host, UPLINK, Hook::Ingress);
    assert!(
        !ping(&sim.outside, host_address),
        "a tcx program after cnibpf's on {UPLINK} sees the ICMP cnibpf passes"
    );
    assert!(hostport_works());
    drop(uplink_dropper);
    assert!(eventually(Duration::from_secs(3), || ping(
        &sim.outside,
        host_address
    )));

    // On the container's veth: towards it (tcx egress) and from it (tcx ingress).
    let veth = sim.host_interface(&c1);
    let container = IpAddr::V4(c1.address);
    assert!(ping(&sim.host, container) && ping(&c1.netns, GATEWAY.into()));
    let towards = IcmpDropper::attach(&sim.host, &veth, Hook::Egress);
    assert!(
        !ping(&sim.host, container),
        "a tcx program after cnibpf's on {veth} egress sees the host's ICMP to the container"
    );
    assert!(hostport_works());
    drop(towards);
    let from = IcmpDropper::attach(&sim.host, &veth, Hook::Ingress);
    assert!(
        !ping(&c1.netns, GATEWAY.into()),
        "a tcx program after cnibpf's on {veth} ingress sees the container's ICMP to its gateway"
    );
    assert!(hostport_works());
    drop(from);
    if backend == Backend::Ebpf {
        assert_eq!(
            sim.tcx_programs(&veth),
            ["from_container", "to_container"],
            "cnibpf's own hooks stay"
        );
    }
}

for_both_backends!(
    bandwidth_chained_before_cnibpf,
    bandwidth_chained_after_cnibpf,
    bandwidth_chained_after_cnibpf_without_its_capability,
    foreign_filters_and_programs_keep_seeing_traffic,
);
