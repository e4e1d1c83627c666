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
    topology::{Backend, OUTSIDE_ADDR, OUTSIDE_ADDR6, UPLINK, cnibpf_binary},
    traffic::{send_frame, tcp_exchange},
};
use serde_json::{Value, json};

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

fn mac_of(netns: &cnibpf_tests::Netns, ifname: &str) -> [u8; 6] {
    let line = netns.exec(&["ip", "-o", "link", "show", "dev", ifname]);
    let text = line
        .split_whitespace()
        .skip_while(|word| *word != "link/ether")
        .nth(1)
        .unwrap_or_else(|| panic!("no MAC address of {ifname} in {line:?}"));
    let mut mac = [0u8; 6];
    for (byte, part) in mac.iter_mut().zip(text.split(':')) {
        *byte = u8::from_str_radix(part, 16).expect("a MAC address");
    }
    mac
}

/// What inspect counts of `reason` on `backend`: packets.
fn inspected_drops(host: &SimHost, backend: Backend, reason: &str) -> u64 {
    let inspect = host.inspect();
    inspect["drops"][backend.name()][reason]["packets"]
        .as_u64()
        .unwrap_or_else(|| panic!("no {reason} drop count in inspect: {:#}", inspect["drops"]))
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

/// The container's frames that the filter and the source check drop: a later fragment with
/// no first one, an ICMPv6 message cut short, an IPv4 datagram, an ARP announcement and
/// a neighbour advertisement in `victim`'s name, and a frame that is neither IP nor ARP.
fn send_policy_violations(sender: &Container, victim: &Container, filtered: bool) {
    let mac = mac_of(&sender.netns, "eth0");
    let outside = IpAddr::V4(OUTSIDE_ADDR);
    let frame = |payload: Vec<u8>, ethertype: u16| ethernet([0xff; 6], mac, ethertype, &payload);
    if filtered {
        let later_fragment = ipv4(
            sender.address,
            OUTSIDE_ADDR,
            UDP,
            &[],
            (false, 185),
            &[0u8; 64],
        );
        send_frame(&sender.netns, "eth0", frame(later_fragment, ETH_P_IP));
        // An ICMPv6 message cut off after the IPv6 header, which claims 8 bytes more: the
        // filter cannot read what it would judge.
        let mut cut = ipv6(sender.address6, OUTSIDE_ADDR6, ICMPV6, &[]);
        cut[4..6].copy_from_slice(&8u16.to_be_bytes());
        send_frame(&sender.netns, "eth0", frame(cut, ETH_P_IPV6));
    }
    let spoofed = ipv4(
        victim.address,
        OUTSIDE_ADDR,
        UDP,
        &[],
        (false, 0),
        &udp(
            IpAddr::V4(victim.address),
            outside,
            4000,
            53,
            b"spoofed",
            true,
        ),
    );
    send_frame(&sender.netns, "eth0", frame(spoofed, ETH_P_IP));
    send_frame(&sender.netns, "eth0", arp_announcement(mac, victim.address));
    send_frame(
        &sender.netns,
        "eth0",
        neighbour_advertisement(mac, Ipv6Addr::UNSPECIFIED, victim.address6, false),
    );
    send_frame(
        &sender.netns,
        "eth0",
        frame(b"not an IP packet".to_vec(), 0x88b5),
    );
}

/// Fills every masquerade port below 512 towards the outside's port 5353 with `holder`'s
/// flows (one datagram from each of its ports 1–511), then sends from `late`'s port 100: no
/// port is left for it.
fn exhaust_masquerade_ports(holder: &Container, late: &Container) {
    let target = SocketAddr::new(IpAddr::V4(OUTSIDE_ADDR), 5353);
    holder.netns.run(move || {
        for port in 1..512u16 {
            let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port))
                .unwrap_or_else(|error| panic!("bind port {port}: {error}"));
            socket.send_to(b"hold", target).expect("send");
        }
    });
    late.netns.run(move || {
        let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 100)).expect("bind port 100");
        for _ in 0..3 {
            socket.send_to(b"late", target).expect("send");
        }
    });
}

/// A monitor following every drop (`--drops --json`), killed on drop unless interrupted.
struct DropMonitor(Option<Child>);

impl DropMonitor {
    fn start(host: &SimHost) -> Self {
        let pin_path = host.pin_path.display().to_string();
        Self(Some(
            host.cnibpf_command(&["monitor", "--pin-path", &pin_path, "--json", "--drops"])
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("start cnibpf monitor --drops"),
        ))
    }

    fn lines(&mut self) -> std::sync::mpsc::Receiver<String> {
        monitor_lines(self.0.as_mut().expect("running"))
    }

    /// Ctrl-C, and its clean exit.
    fn interrupt(mut self) {
        interrupt(self.0.take().expect("running"));
    }
}

impl Drop for DropMonitor {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The eBPF datapath drops for each of its reasons, and each drop is counted by reason in
/// inspect and the metrics, and streamed by `monitor --drops` with its pod and reason. (A
/// failed rewrite, the one reason left out, takes a helper failing half way through a packet:
/// nothing a test can cause.)
#[test]
fn every_drop_of_the_ebpf_datapath_has_its_reason() {
    let mut keys = filter_keys();
    keys["ipMasq"] = json!(true);
    // Masquerade where the host's stack hands packets to the uplink (what the stack forwards),
    // the path of the one drop below the stack decides to make.
    keys["hostFirewall"] = json!(true);
    let host = SimHost::on(Backend::Ebpf, "ob-drops", keys);
    host.route_outside_to_containers();
    let sender = host.container("a", Value::Null);
    let victim = host.container("b", Value::Null);
    let mut monitor = DropMonitor::start(&host);
    let lines = monitor.lines();
    assert!(
        eventually(Duration::from_secs(5), || host.monitor_following()),
        "the monitor took its lock"
    );

    unanswered_from_outside(&host, SocketAddr::new(IpAddr::V4(sender.address), 8081));
    unanswered_from_outside(&host, SocketAddr::new(IpAddr::V4(sender.address), 9000));
    send_policy_violations(&sender, &victim, true);
    exhaust_masquerade_ports(&sender, &victim);
    // An uplink without a global IPv6 address (CHECK records it so) that still routes IPv6:
    // the container's datagrams, handed to the host's stack (hostFirewall), leave by it, and
    // masquerade has no address to give them (the kernel's MASQUERADE drops such packets too).
    host.host.exec(&[
        "ip", "-6", "addr", "flush", "dev", UPLINK, "scope", "global",
    ]);
    host.host.exec(&[
        "ip",
        "-6",
        "route",
        "replace",
        "default",
        "via",
        "2001:db8:1::2",
        "dev",
        UPLINK,
        "onlink",
    ]);
    host.check(&sender)
        .unwrap_or_else(|error| panic!("CHECK taking the uplink's addresses: {error}"));
    let outside6 = SocketAddr::new("2001:db8:1::2".parse().expect("literal"), 53);
    sender.netns.run(move || {
        let socket = UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0)).expect("bind");
        for _ in 0..3 {
            socket.send_to(b"out", outside6).expect("send");
        }
    });
    assert!(
        eventually(Duration::from_secs(5), || inspected_drops(
            &host,
            Backend::Ebpf,
            "masquerade_no_uplink_address"
        ) >= 1),
        "the datagrams without an address to masquerade to are dropped: {:#}",
        host.inspect()["uplinks"]
    );

    let reasons = [
        "filter_rule",
        "filter_default",
        "filter_fragment",
        "filter_unreadable",
        "source_check_address",
        "source_check_arp",
        "source_check_neighbour_advertisement",
        "source_check_not_ip",
        "masquerade_ports_exhausted",
        "masquerade_no_uplink_address",
    ];
    for reason in reasons {
        assert!(
            inspected_drops(&host, Backend::Ebpf, reason) >= 1,
            "inspect counts {reason}"
        );
        let line = first_line_matching(&lines, |line| {
            line.contains(&format!("\"reason\":\"{reason}\""))
        })
        .unwrap_or_else(|| panic!("monitor --drops streamed no {reason} event"));
        let event: Value = serde_json::from_str(&line).expect("a JSON event");
        let by = if reason == "masquerade_ports_exhausted" {
            &victim
        } else {
            &sender
        };
        assert_eq!(
            event["containerID"], by.attachment.container_id,
            "{reason}: {event}"
        );
    }
    monitor.interrupt();
    assert_eq!(
        inspected_drops(&host, Backend::Ebpf, "rewrite_failed"),
        0,
        "no rewrite failed"
    );

    let endpoint = Endpoint::metrics(&host, &[]);
    let text = endpoint.scrape();
    for reason in reasons {
        let value = sample(
            &text,
            "cnibpf_packets_dropped_total",
            &[("backend", "ebpf"), ("reason", reason)],
        );
        assert!(
            value.is_some_and(|value| value >= 1.0),
            "{reason} in the metrics: {value:?}\n{text}"
        );
    }
    assert!(
        sample(
            &text,
            "cnibpf_masquerade_port_allocation_failures_total",
            &[]
        )
        .is_some_and(|value| value >= 1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "cnibpf_filter_rule_packets_total",
            &[
                ("container_id", sender.attachment.container_id.as_str()),
                ("index", "1")
            ],
        )
        .map(|value| value >= 1.0),
        Some(true),
        "rule 1 of the sender counted: {text}"
    );
}

/// The nftables backend's drops, by the reasons it has: its filter rules and default, its
/// source check, and the localnet guard beside 127.0.0.1 hostPorts.
#[test]
fn every_drop_of_the_nftables_datapath_has_its_reason() {
    let host = SimHost::on(Backend::Nftables, "ob-drops", filter_keys());
    host.route_outside_to_containers();
    let sender = host.container("a", Value::Null);
    let victim = host.container("b", Value::Null);
    unanswered_from_outside(&host, SocketAddr::new(IpAddr::V4(sender.address), 8081));
    unanswered_from_outside(&host, SocketAddr::new(IpAddr::V4(sender.address), 9000));
    send_policy_violations(&sender, &victim, false);
    // From outside to 127.0.0.1 at the host's uplink: only the host may reach its loopback.
    let uplink_mac = mac_of(&host.host, UPLINK);
    let outside_mac = mac_of(&host.outside, "eth0");
    let to_loopback = ipv4(
        OUTSIDE_ADDR,
        Ipv4Addr::LOCALHOST,
        UDP,
        &[],
        (false, 0),
        &udp(
            IpAddr::V4(OUTSIDE_ADDR),
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            4000,
            8080,
            b"in",
            true,
        ),
    );
    send_frame(
        &host.outside,
        "eth0",
        ethernet(uplink_mac, outside_mac, ETH_P_IP, &to_loopback),
    );
    let reasons = [
        "filter_rule",
        "filter_default",
        "source_check_address",
        "source_check_arp",
        "source_check_neighbour_advertisement",
        "source_check_not_ip",
        "localnet_guard",
    ];
    for reason in reasons {
        assert!(
            eventually(Duration::from_secs(5), || inspected_drops(
                &host,
                Backend::Nftables,
                reason
            ) >= 1),
            "inspect counts {reason}: {:#}",
            host.inspect()["drops"]
        );
    }
    let endpoint = Endpoint::metrics(&host, &[]);
    let text = endpoint.scrape();
    for reason in reasons {
        assert!(
            sample(
                &text,
                "cnibpf_packets_dropped_total",
                &[("backend", "nftables"), ("reason", reason)],
            )
            .is_some_and(|value| value >= 1.0),
            "{reason} in the metrics:\n{text}"
        );
    }
    assert!(
        sample(&text, "cnibpf_flows_max", &[("table", "conntrack")]).is_some_and(|max| max > 0.0),
        "the conntrack table's size: {text}"
    );
}

/// A Prometheus server started by the test, scraping the endpoint every second; killed on
/// drop.
struct Prometheus {
    child: Child,
    host_netns: std::path::PathBuf,
}

const PROMETHEUS_ADDR: &str = "127.0.0.1:9090";

impl Prometheus {
    fn start(host: &SimHost) -> Self {
        let dir = host.work_dir.join("prometheus");
        std::fs::create_dir_all(&dir).expect("prometheus dir");
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: cnibpf\n    static_configs:\n      - targets: ['{}']\n",
                alert_rules().display(),
                cnibpf_tests::observe::METRICS_ADDR
            ),
        )
        .expect("write the Prometheus configuration");
        let mut command = Command::new("prometheus");
        command
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={PROMETHEUS_ADDR}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        enter_netns_on_exec(&mut command, &host.host.path());
        let child = command
            .spawn()
            .expect("start prometheus (Debian's prometheus package)");
        Self {
            child,
            host_netns: host.host.path(),
        }
    }

    /// The value of the first series `query` returns, through the HTTP query API.
    fn query(&self, query: &str) -> Option<f64> {
        let encoded: String = query
            .bytes()
            .map(|byte| match byte {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' => (byte as char).to_string(),
                other => format!("%{other:02X}"),
            })
            .collect();
        let netns = cnibpf_tests::Netns::at(&self.host_netns);
        let (status, body) = cnibpf_tests::observe::http_get_path(
            &netns,
            PROMETHEUS_ADDR.parse().expect("an address"),
            &format!("/api/v1/query?query={encoded}"),
        )
        .ok()?;
        if status != 200 {
            return None;
        }
        let answer: Value = serde_json::from_str(&body).ok()?;
        answer["data"]["result"][0]["value"][1]
            .as_str()?
            .parse()
            .ok()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn alert_rules() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("deploy")
        .join("prometheus-alerts.yaml")
}

/// The exposition passes `promtool check metrics`, the example alerts `promtool check rules`,
/// and a real Prometheus server scrapes the endpoint: the attachments, a drop counter and the
/// plugin's calls read back through its query API.
#[test]
fn prometheus_scrapes_the_endpoint() {
    let host = SimHost::on(Backend::Ebpf, "ob-prom", filter_keys());
    host.route_outside_to_containers();
    let container = host.container("a", Value::Null);
    unanswered_from_outside(&host, SocketAddr::new(IpAddr::V4(container.address), 8081));
    assert_eq!(
        host.inspect()["callStatsFile"]
            .as_str()
            .map(std::path::PathBuf::from),
        Some(cnibpf_tests::topology::call_stats_file(&host.pin_path)),
        "where the host's calls are counted"
    );
    let endpoint = Endpoint::metrics(&host, &[]);
    let text = endpoint.scrape();
    promtool_check_metrics(&text).unwrap_or_else(|complaints| {
        panic!("promtool check metrics refused the exposition:\n{complaints}\n{text}")
    });
    assert_eq!(
        sample(
            &text,
            "cnibpf_plugin_operations_total",
            &[("verb", "ADD"), ("result", "ok")]
        ),
        Some(1.0),
        "the ADD is counted: {text}"
    );
    assert_eq!(
        sample(
            &text,
            "cnibpf_plugin_operation_duration_seconds_count",
            &[("verb", "ADD")]
        ),
        Some(1.0),
        "{text}"
    );
    let checked = Command::new("promtool")
        .args(["check", "rules"])
        .arg(alert_rules())
        .output()
        .expect("run promtool check rules");
    assert!(
        checked.status.success(),
        "promtool check rules: {checked:?}"
    );

    let prometheus = Prometheus::start(&host);
    assert!(
        eventually(Duration::from_secs(60), || prometheus
            .query("cnibpf_attachments{backend=\"ebpf\"}")
            == Some(1.0)),
        "Prometheus reads cnibpf_attachments"
    );
    assert!(
        eventually(Duration::from_secs(30), || prometheus
            .query("cnibpf_packets_dropped_total{reason=\"filter_rule\"}")
            .is_some_and(|dropped| dropped >= 1.0)),
        "Prometheus reads the filter_rule drops"
    );
    assert_eq!(
        prometheus.query("sum(cnibpf_plugin_operations_total{verb=\"ADD\",result=\"ok\"})"),
        Some(1.0),
        "Prometheus reads the plugin's calls"
    );
    drop(container);
}

/// The value of the `layout` map, as bpftool writes it (hex bytes).
fn layout_bytes(host: &SimHost) -> Vec<u8> {
    let path = host.pin_path.join("layout").display().to_string();
    let raw = host.host.exec(&[
        "bpftool", "-j", "map", "lookup", "pinned", &path, "key", "0", "0", "0", "0",
    ]);
    let value: Value = serde_json::from_str(&raw).expect("bpftool JSON");
    value["value"]
        .as_array()
        .expect("the raw value")
        .iter()
        .map(|byte| {
            u8::from_str_radix(byte.as_str().expect("hex").trim_start_matches("0x"), 16)
                .expect("a hex byte")
        })
        .collect()
}

fn set_layout_bytes(host: &SimHost, bytes: &[u8]) {
    let path = host.pin_path.join("layout").display().to_string();
    let mut args = vec![
        "bpftool".to_owned(),
        "map".to_owned(),
        "update".to_owned(),
        "pinned".to_owned(),
        path,
        "key".to_owned(),
        "0".to_owned(),
        "0".to_owned(),
        "0".to_owned(),
        "0".to_owned(),
        "value".to_owned(),
    ];
    args.extend(bytes.iter().map(|byte| byte.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    host.host.exec(&args);
}

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

    let stamped = layout_bytes(&host);
    let mut older = stamped.clone();
    older[8..12].copy_from_slice(
        &(u32::from_le_bytes(stamped[8..12].try_into().expect("4 bytes")) - 1).to_le_bytes(),
    );
    set_layout_bytes(&host, &older);
    let (status, body) = readiness();
    set_layout_bytes(&host, &stamped);
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
