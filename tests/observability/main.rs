//! What an operator sees of a running node: every drop with its reason — made for real in the
//! simulated host, then found in `inspect`, in `monitor --drops` and in the metric with that
//! label — the metrics endpoint checked by `promtool` and scraped by a real Prometheus server,
//! `/readyz` following the chain and the datapath's layout, and the call log of many plugin
//! processes at once, rotated without losing a line.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
    path::Path,
    process::{Child, Command, Stdio},
    time::Duration,
};

use cnibpf_tests::{
    Container, SimHost,
    chain::enter_netns_on_exec,
    eventually,
    monitor::{first_line_matching, interrupt, monitor_lines},
    observe::{Endpoint, call_log, promtool_check_metrics, sample},
    packet::{
        ETH_P_IP, ETH_P_IPV6, ICMPV6, UDP, arp_announcement, ethernet, ipv4, ipv6,
        neighbour_advertisement, udp,
    },
    topology::{BRIDGE, Backend, GATEWAY6, OUTSIDE_ADDR, OUTSIDE_ADDR6, UPLINK, cnibpf_binary},
    traffic::{ping, send_frame, tcp_exchange},
};
use serde_json::{Value, json};

mod drops;
mod metrics;

/// The value of the `layout` map, as bpftool writes it (hex bytes).
/// `/readyz` of a node set up by `cnibpf install --load`: ready; not ready once cnibpf's entry
/// is gone from the network the runtime uses, ready again when `install --watch` (serving the
/// same endpoint) puts it back; not ready while the datapath has an older layout.
#[test]
fn readyz_follows_the_chain_and_the_datapath() {
    let host = SimHost::on(Backend::Ebpf, "ob-ready", json!({}));
    let conf_dir = host.work_dir.join("net.d");
    let bin_dir = host.work_dir.join("bin");
    std::fs::create_dir_all(&conf_dir).expect("conf dir");
    std::fs::create_dir_all(&bin_dir).expect("bin dir");
    let primary = json!({
        "cniVersion": "1.0.0",
        "name": "primary",
        "plugins": [{ "type": "bridge", "bridge": "cni9", "ipam": { "type": "host-local", "ranges": [[{ "subnet": "10.99.0.0/16" }]] } }],
    });
    let primary_file = conf_dir.join("10-primary.conflist");
    std::fs::write(&primary_file, primary.to_string()).expect("write the primary network");
    let entry = host.work_dir.join("entry.json");
    std::fs::write(
        &entry,
        json!({ "backend": "ebpf", "pinPath": host.pin_path, "capabilities": { "portMappings": true } })
            .to_string(),
    )
    .expect("write the entry");
    let dirs = [
        "--conf-dir".to_owned(),
        conf_dir.display().to_string(),
        "--bin-dir".to_owned(),
        bin_dir.display().to_string(),
    ];
    let dirs: Vec<&str> = dirs.iter().map(String::as_str).collect();
    let endpoint = Endpoint::metrics(&host, &[&dirs[..], &["--backend", "ebpf"]].concat());
    let readiness = || endpoint.get("/readyz").expect("/readyz answers");
    let (status, body) = readiness();
    assert_eq!(status, 503, "nothing installed yet: {body}");

    let entry_text = entry.display().to_string();
    let mut install = vec!["install", "--entry", entry_text.as_str(), "--load"];
    install.extend(&dirs);
    let installed = host.cnibpf(&install);
    assert!(installed.status.success(), "install: {installed:?}");
    let (status, body) = readiness();
    assert_eq!(
        (status, body.lines().count()),
        (200, 3),
        "installed and loaded: {body}"
    );

    std::fs::write(&primary_file, primary.to_string()).expect("the primary rewrites its file");
    assert_eq!(
        readiness().0,
        200,
        "the runtime reads cnibpf's own file, which the primary's rewrite leaves alone"
    );
    // cnibpf's entry taken out of its file: the runtime would make pods without it.
    let own_file = conf_dir.join("10-primary.cnibpf.conflist");
    let mut unchained: Value =
        serde_json::from_slice(&std::fs::read(&own_file).expect("cnibpf's own conflist"))
            .expect("it parses");
    unchained["plugins"]
        .as_array_mut()
        .expect("plugins")
        .retain(|plugin| plugin["type"] != "cnibpf");
    std::fs::write(&own_file, unchained.to_string()).expect("take cnibpf's entry out");
    let (status, body) = readiness();
    assert_eq!(status, 503, "cnibpf is not chained: {body}");
    assert!(body.contains("not ready chained"), "{body}");

    let mut watch = vec![
        "install",
        "--entry",
        entry_text.as_str(),
        "--watch",
        "--listen",
        "127.0.0.1:9966",
    ];
    watch.extend(&dirs);
    let watch_endpoint = Endpoint::spawn_at(&host, host.cnibpf_command(&watch), "127.0.0.1:9966");
    assert!(
        eventually(Duration::from_secs(10), || readiness().0 == 200),
        "ready again once --watch chains cnibpf in: {:?}",
        readiness()
    );
    assert_eq!(
        watch_endpoint.get("/readyz").map(|(status, _)| status),
        Ok(200),
        "install --watch --listen serves the same readiness"
    );
    drop(watch_endpoint);

    let stamped = host.layout_bytes();
    // A layout before the supported window's (the one before per-map versions' first).
    let mut older = stamped.clone();
    older[8..12].copy_from_slice(&(cnibpf_common::datapath::layout::VERSION - 1).to_le_bytes());
    host.write_layout(&older);
    let (status, body) = readiness();
    host.write_layout(&stamped);
    assert_eq!(status, 503, "an older layout is not ready: {body}");
    assert!(body.contains("older than this build's"), "{body}");
    assert_eq!(readiness().0, 200, "the layout restored");
    assert_eq!(
        endpoint.get("/healthz").map(|(status, _)| status),
        Ok(200),
        "healthy throughout"
    );
}

/// 100 containers added and deleted by concurrent plugin processes (200 calls) leave one
/// well-formed line each, with what it did; a storm of 12,000 calls from 200 processes at once
/// into a log of 1 MB rotates it, and every line is in one of its files.
#[test]
fn concurrent_calls_leave_whole_lines_and_rotation_loses_none() {
    let host = SimHost::on(Backend::Ebpf, "ob-log", json!({ "ipMasq": true }));
    let containers: Vec<Container> = std::thread::scope(|scope| {
        let started: Vec<_> = (0..100)
            .map(|index| {
                let host = &host;
                scope.spawn(move || {
                    host.container(
                        &format!("c{index}"),
                        cnibpf_tests::topology::port_mappings(&[(20_000 + index, 80, "tcp")]),
                    )
                })
            })
            .collect();
        started
            .into_iter()
            .map(|thread| thread.join().expect("an ADD"))
            .collect()
    });
    std::thread::scope(|scope| {
        for container in &containers {
            let host = &host;
            scope.spawn(move || {
                host.del(container)
                    .unwrap_or_else(|error| panic!("DEL: {error}"))
            });
        }
    });
    let lines = call_log(&host.call_log());
    let of_verb = |verb: &str| {
        lines
            .iter()
            .filter(|line| line["verb"] == verb && line["result"] == "ok")
            .count()
    };
    assert_eq!((of_verb("ADD"), of_verb("DEL")), (100, 100), "{lines:#?}");
    for container in &containers {
        let own: Vec<&Value> = lines
            .iter()
            .filter(|line| line["container_id"] == container.attachment.container_id)
            .collect();
        assert_eq!(own.len(), 2, "{own:#?}");
        assert_eq!(own[0]["network"], host.network(), "{own:#?}");
        assert_eq!(own[0]["backend"], "ebpf", "{own:#?}");
        assert!(
            own[0]["host_ports"]
                .as_str()
                .is_some_and(|ports| ports.contains(" -> ")),
            "the ADD says which hostPort it holds: {own:#?}"
        );
        assert_eq!(
            own[0]["host_ports"], own[1]["host_ports_released"],
            "{own:#?}"
        );
    }

    let storm_log = host.work_dir.join("storm.log");
    let stdin = json!({
        "cniVersion": "1.0.0",
        "logFile": storm_log,
        "logMaxSizeMB": 1,
        "logMaxFiles": 20,
    })
    .to_string();
    std::thread::scope(|scope| {
        for _ in 0..200 {
            let stdin = &stdin;
            scope.spawn(move || {
                for _ in 0..60 {
                    let mut child = Command::new(cnibpf_binary())
                        .env("CNI_COMMAND", "VERSION")
                        .stdin(Stdio::piped())
                        .stdout(Stdio::null())
                        .spawn()
                        .expect("run the plugin");
                    use std::io::Write as _;
                    child
                        .stdin
                        .take()
                        .expect("stdin")
                        .write_all(stdin.as_bytes())
                        .expect("feed the plugin");
                    assert!(child.wait().expect("wait").success(), "VERSION");
                }
            });
        }
    });
    let stormed = call_log(&storm_log);
    assert_eq!(stormed.len(), 12_000, "every call has its line");
    assert!(
        stormed.iter().all(|line| line["verb"] == "VERSION"),
        "only whole VERSION lines"
    );
    assert!(
        Path::new(&format!("{}.1", storm_log.display())).exists(),
        "the log was rotated"
    );
    for file in std::iter::once(storm_log.clone())
        .chain((1..=20).map(|generation| format!("{}.{generation}", storm_log.display()).into()))
    {
        if let Ok(metadata) = std::fs::metadata(&file) {
            assert!(
                metadata.len() <= 1024 * 1024,
                "{} is within 1 MB",
                file.display()
            );
        }
    }
}

/// A filter whose ingress drops port 8081 by rule and anything but 8080 by default; egress
/// is allowed.
fn filter_keys() -> Value {
    json!({
        "filterDefault": "DROP",
        "filter": [
            { "index": 1, "direction": "ingress", "proto": "tcp", "dport": 8081, "target": "DROP" },
            { "index": 2, "direction": "ingress", "proto": "tcp", "dport": 8080, "target": "ALLOW" },
            { "index": 3, "direction": "egress", "target": "ALLOW" },
        ],
    })
}

/// Connects from the outside to `target` and expects no answer (a drop, not a refusal).
fn unanswered_from_outside(host: &SimHost, target: SocketAddr) {
    let outcome = host
        .outside
        .run(move || tcp_exchange(target, Duration::from_millis(600)));
    assert!(
        outcome
            .as_ref()
            .is_err_and(|error| cnibpf_tests::traffic::unanswered(error)),
        "TCP to {target} should be dropped: {outcome:?}"
    );
}
