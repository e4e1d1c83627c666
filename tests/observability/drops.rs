//! Every drop of either datapath has its reason, counted and streamed.

use super::*;

/// What inspect counts of `reason` on `backend`: packets.
fn inspected_drops(host: &SimHost, backend: Backend, reason: &str) -> u64 {
    let inspect = host.inspect();
    inspect["drops"][backend.name()][reason]["packets"]
        .as_u64()
        .unwrap_or_else(|| panic!("no {reason} drop count in inspect: {:#}", inspect["drops"]))
}

/// The container's frames that the filter and the source check drop: a later fragment with
/// no first one, an ICMPv6 message cut short, an IPv4 datagram, an ARP announcement and
/// a neighbour advertisement in `victim`'s name, and a frame that is neither IP nor ARP.
fn send_policy_violations(sender: &Container, victim: &Container, filtered: bool) {
    let mac = sender.netns.mac("eth0");
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
    // A host without a global IPv6 address to send from (CHECK records the uplink without
    // one) that still routes IPv6: the container's datagrams, handed to the host's stack, leave
    // by the uplink, and masquerade has no address to give them (the kernel's MASQUERADE drops
    // such packets too; with an address on another interface both would take that one). The
    // bridge's address goes last, after the container has its gateway's MAC address fresh.
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
    assert!(
        ping(&sender.netns, IpAddr::V6(GATEWAY6)),
        "the container reaches its gateway"
    );
    host.host.exec(&[
        "ip",
        "-6",
        "addr",
        "del",
        &format!("{GATEWAY6}/64"),
        "dev",
        BRIDGE,
    ]);
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
/// source check, and the localnet guard beside hostPorts (a datagram to 127.0.0.1 on the
/// sender's would otherwise be translated to it, whatever interface it came in by).
#[test]
fn every_drop_of_the_nftables_datapath_has_its_reason() {
    let host = SimHost::on(Backend::Nftables, "ob-drops", filter_keys());
    host.route_outside_to_containers();
    let sender = host.container(
        "a",
        cnibpf_tests::topology::port_mappings(&[(8080, 8080, "udp")]),
    );
    let victim = host.container("b", Value::Null);
    unanswered_from_outside(&host, SocketAddr::new(IpAddr::V4(sender.address), 8081));
    unanswered_from_outside(&host, SocketAddr::new(IpAddr::V4(sender.address), 9000));
    send_policy_violations(&sender, &victim, false);
    // From outside to 127.0.0.1 at the host's uplink: only the host may reach its loopback.
    let uplink_mac = host.host.mac(UPLINK);
    let outside_mac = host.outside.mac("eth0");
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
