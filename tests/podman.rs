//! podman with its CNI backend and the simulated host's bridge + cnibpf conflist:
//! `podman run -p …` publishes TCP (any address and a hostIP) and UDP ports that the outside
//! and host processes reach; `podman stop` + `rm` leaves nothing.

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use cnibpf_tests::{
    SimHost, eventually, for_both_backends,
    image::PAGE,
    podman::Podman,
    topology::{Backend, HOST_UPLINK_ADDR},
    traffic::{UdpServer, http_get, udp_request},
};
use serde_json::json;

fn podman_run_publishes_ports(backend: Backend) {
    let sim = SimHost::on(backend, "podman", json!({ "ipMasq": true }));
    let podman = Podman::new(&sim);
    let uplink = HOST_UPLINK_ADDR.to_string();
    podman.start(
        "web",
        &["18080:80", &format!("{uplink}:18081:80"), "15353:5353/udp"],
        &["/bin/httpd", "-f", "-p", "80", "-h", "/www"],
    );
    let netns = podman.netns("web");
    let _dns = UdpServer::start(&netns, "0.0.0.0:5353".parse().expect("literal"), "dns");

    assert!(
        eventually(Duration::from_secs(5), || http_get(
            &sim.outside,
            sim.uplink_target(18080)
        )
        .is_ok_and(|body| body == PAGE)),
        "the outside reaches httpd through the published port 18080"
    );
    assert_eq!(
        http_get(&sim.outside, sim.uplink_target(18081)).as_deref(),
        Ok(PAGE),
        "published port 18081 on {uplink}"
    );
    let (answer, _) = udp_request(&sim.outside, sim.uplink_target(15353))
        .unwrap_or_else(|error| panic!("published UDP port 15353: {error}"));
    assert_eq!(answer, "dns");
    let local = SocketAddr::new(IpAddr::V4([127, 0, 0, 1].into()), 18080);
    let outcome = sim.host_client("http", local);
    // Both backends translate 127.0.0.1 (nftables as the reference portmap does).
    assert_eq!(
        outcome.map(|(answer, _)| answer).as_deref(),
        Ok(PAGE.trim_end()),
        "{backend:?}: host process -> {local}"
    );
    let inspect = sim.inspect();
    assert_eq!(
        inspect["attachments"].as_array().map(Vec::len),
        Some(1),
        "{inspect}"
    );

    let stopped = podman.run(&["stop", "--time", "0", "web"]);
    assert!(stopped.status.success(), "podman stop: {stopped:?}");
    let removed = podman.run(&["rm", "web"]);
    assert!(removed.status.success(), "podman rm: {removed:?}");
    assert!(
        http_get(&sim.outside, sim.uplink_target(18080)).is_err(),
        "port 18080 refused once the container is gone"
    );
    assert!(sim.holds_no_state(), "podman rm leaves no cnibpf state");
}

for_both_backends!(podman_run_publishes_ports);
