//! podman with its CNI backend and the simulated host's bridge + cnibpf conflist:
//! `podman run -p …` publishes TCP (any address and a hostIP) and UDP ports that the outside
//! and host processes reach; `podman stop` + `rm` leaves nothing. And backing out under
//! podman: `cnibpf uninstall` with a container running, then its removal, leaves nothing.

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use cnibpf_tests::{
    SimHost,
    assertions::assert_uninstalled,
    cri, eventually, for_both_backends,
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

/// Backing out under podman with a container running: `cnibpf install --replace-portmap` over a
/// bridge + portmap network, a container publishing a port served by cnibpf, `cnibpf uninstall`
/// (cnibpf's conflist turns release-only), a new container made by the restored network
/// (portmap's iptables) while the first stays served; the first one's removal through cnibpf's
/// entry leaves nothing of cnibpf on the node, and the second one's is portmap's.
#[test]
fn uninstall_with_a_container_running_leaves_nothing_once_it_is_removed() {
    let sim = SimHost::on(Backend::Ebpf, "podu", json!({ "ipMasq": true }));
    let podman = Podman::with_networks(&sim, |conf_dir, bin_dir| {
        cri::cni_bin_dir(bin_dir, &["bridge", "host-local", "portmap"]);
        sim.install_over_portmap(conf_dir, bin_dir);
    });
    let (conf_dir, bin_dir) = (podman.conf_dir(), podman.bin_dir());
    let own_file = conf_dir.join(format!("10-{}.cnibpf.conflist", sim.network()));
    let httpd = ["/bin/httpd", "-f", "-p", "80", "-h", "/www"];
    let reaches = |port| {
        eventually(Duration::from_secs(5), || {
            http_get(&sim.outside, sim.uplink_target(port)).is_ok_and(|body| body == PAGE)
        })
    };
    podman.start("web", &["18080:80"], &httpd);
    assert!(reaches(18080), "the outside reaches web through 18080");
    let attachments = |sim: &SimHost| sim.inspect()["attachments"].as_array().map(Vec::len);
    assert_eq!(attachments(&sim), Some(1), "cnibpf serves web");

    sim.uninstall_with_pods_running(&conf_dir, &bin_dir);

    let late = podman.start("late", &["18081:80"], &httpd);
    assert_eq!(
        attachments(&sim),
        Some(1),
        "the new container is not cnibpf's"
    );
    assert!(
        sim.host
            .exec(&["iptables-save", "-t", "nat"])
            .contains(&late),
        "the restored portmap maps the new container's port"
    );
    assert!(
        reaches(18081),
        "the outside reaches late through portmap's 18081"
    );
    assert!(reaches(18080), "web keeps its port, served by cnibpf");

    for args in [&["stop", "--time", "0", "web"][..], &["rm", "web"]] {
        let output = podman.run(args);
        assert!(output.status.success(), "podman {args:?}: {output:?}");
    }
    // podman DELs with the configuration it cached at ADD: web's named cnibpf's ordinary
    // entry, late's names the release-only one, so the binary stays for late's DEL.
    assert!(
        sim.holds_no_state() && !sim.pin_path.exists(),
        "web's DEL took the datapath"
    );
    assert!(!own_file.exists(), "web's DEL took cnibpf's conflist");
    assert!(
        bin_dir.join("cnibpf").exists(),
        "the binary stays while late, made in release-only mode, lives"
    );
    assert!(reaches(18081), "late is still reached through portmap");

    for args in [&["stop", "--time", "0", "late"][..], &["rm", "late"]] {
        let output = podman.run(args);
        assert!(output.status.success(), "podman {args:?}: {output:?}");
    }
    let nat = sim.host.exec(&["iptables-save", "-t", "nat"]);
    assert!(
        !nat.contains(&late),
        "the restored network's portmap removed late's rules:\n{nat}"
    );
    assert_uninstalled(&sim, &own_file, &bin_dir.join("cnibpf"));
    assert!(sim.holds_no_state(), "nothing of cnibpf");
}
