//! Filter rules (`filter`, `filterDefault`): ordered, stateful, on the container's side of
//! every translation, replaced atomically, observable (counters, `cnibpf monitor`).

use std::{net::SocketAddr, time::Duration};

use cnibpf_common::{
    filter::FilterSet,
    filter_flow::{FilterFlow, FilterFlowKey},
};
use cnibpf_tests::{
    Container, Netns, SimHost, eventually, for_both_backends,
    monitor::{first_line_matching, interrupt, monitor_lines, start_monitor},
    topology::{Backend, Family, GATEWAY, GATEWAY6, OUTSIDE_ADDR, OUTSIDE_ADDR6, port_mappings},
    traffic::{
        CLIENT_TIMEOUT, Conversation, StreamEchoServer, TcpServer, UdpCounter, UdpSender,
        UdpServer, kernel_has_sctp, ping, sctp_request, tcp_exchange, tcp_request, udp_error,
        udp_exchange_from, udp_exchange_with, udp_request, unanswered, uninterrupted,
    },
};
use serde_json::{Value, json};

/// How long a client waits before a request counts as dropped: tests first show the same
/// path working, so neighbours are resolved and a drop is not a slow first packet.
const DROPPED_AFTER: Duration = Duration::from_millis(1200);

/// Whether a request was dropped: no answer within [`DROPPED_AFTER`]. An error that is an
/// answer (a reset, an ICMP error) is not a drop: the test fails on it, naming it.
fn dropped<T>(outcome: Result<T, String>, what: &str) -> bool {
    match outcome {
        Ok(_) => false,
        Err(error) if unanswered(&error) => true,
        Err(error) => panic!("{what}: answered with an error ({error}), which is not a drop"),
    }
}

fn tcp_dropped(netns: &Netns, target: SocketAddr) -> bool {
    dropped(
        netns.run(move || tcp_exchange(target, DROPPED_AFTER)),
        &format!("TCP to {target}"),
    )
}

fn udp_dropped(netns: &Netns, target: SocketAddr) -> bool {
    dropped(
        netns.run(move || udp_exchange_from(0, target, DROPPED_AFTER)),
        &format!("UDP to {target}"),
    )
}

fn udp_from(netns: &Netns, source_port: u16, target: SocketAddr) -> Result<String, String> {
    netns
        .run(move || udp_exchange_from(source_port, target, DROPPED_AFTER))
        .map(|(answer, _)| answer)
}

/// The attachment's filter as `cnibpf inspect --json` shows it.
fn inspected_filter(host: &SimHost, container: &Container) -> Value {
    let inspect = host.inspect();
    inspect["attachments"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|attachment| attachment["containerID"] == container.attachment.container_id)
        .map(|attachment| attachment["filter"].clone())
        .unwrap_or_else(|| {
            panic!(
                "{} not in inspect: {inspect:#}",
                container.attachment.container_id
            )
        })
}

/// Packets counted on the rule with `index` (`None`: the default verdict).
fn hits(filter: &Value, index: Option<u64>) -> u64 {
    match index {
        None => filter["defaultHits"]["packets"].as_u64(),
        Some(index) => filter["rules"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|rule| rule["index"] == index)
            .and_then(|rule| rule["packets"].as_u64()),
    }
    .unwrap_or_else(|| panic!("no counter for rule {index:?} in {filter:#}"))
}

fn rules_apply_in_index_order_not_in_array_order(backend: Backend) {
    // In array order the ALLOW would decide port 8080; by index the DROP comes first.
    let host = SimHost::on(
        backend,
        "fl-order",
        json!({ "filter": [
            { "index": 20, "proto": "tcp", "dport": 8080, "target": "ALLOW" },
            { "index": 10, "proto": "tcp", "dport": "8080-8089", "target": "DROP" },
        ]}),
    );
    host.route_outside_to_containers();
    let container = host.container("c1", Value::Null);
    for family in Family::BOTH {
        let _open = TcpServer::start(&container.netns, family.any(8090), "open");
        let _guarded = TcpServer::start(&container.netns, family.any(8080), "guarded");
        assert_eq!(
            tcp_request(&host.outside, container.at(family, 8090)).as_deref(),
            Ok("open"),
            "{family:?}: no rule matches port 8090, the default ALLOW does"
        );
        assert!(
            tcp_dropped(&host.outside, container.at(family, 8080)),
            "{family:?}: index 10 (DROP) must decide before index 20 (ALLOW)"
        );
    }
    let filter = inspected_filter(&host, &container);
    let indexes: Vec<u64> = filter["rules"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|rule| rule["index"].as_u64())
        .collect();
    assert_eq!(
        indexes,
        [10, 20],
        "inspect lists the rules in evaluation order"
    );
    assert!(hits(&filter, Some(10)) >= 2, "{filter:#}");
    assert_eq!(hits(&filter, Some(20)), 0, "{filter:#}");
}

fn the_proposal_example_drops_a_source_network_before_allowing_new_web_connections(
    backend: Backend,
) {
    let host = SimHost::on(backend, "fl-proposal", json!({}));
    host.route_outside_to_containers();
    let container = host.container("c1", Value::Null);
    // The proposal's 172.64.0.0/13 is the outside network here; its 10.10.10.100 the container.
    host.readd_with(
        &container,
        json!({ "filter": [
            { "index": 20, "dst": format!("{}/32", container.address), "proto": "tcp", "dport": 80,
              "connstate": "new", "target": "ALLOW" },
            { "index": 10, "src": "203.0.113.0/24", "target": "DROP" },
        ], "filterDefault": "ALLOW" }),
    )
    .unwrap_or_else(|error| panic!("re-ADD with the proposal's rules: {error}"));
    let _web = TcpServer::start(&container.netns, Family::V4.any(80), "web");
    assert_eq!(
        tcp_request(&host.host, container.socket(80)).as_deref(),
        Ok("web"),
        "from the host ({GATEWAY}), rule 20 lets the connection open"
    );
    assert!(
        tcp_dropped(&host.outside, container.socket(80)),
        "from {OUTSIDE_ADDR}, rule 10 drops it although rule 20 matches too"
    );
    let filter = inspected_filter(&host, &container);
    assert!(hits(&filter, Some(10)) >= 1, "{filter:#}");
    assert_eq!(hits(&filter, Some(20)), 1, "one new connection: {filter:#}");
    assert!(
        hits(&filter, None) >= 2,
        "its later packets: default ALLOW: {filter:#}"
    );
}

fn replies_and_related_errors_pass_a_default_drop_unsolicited_packets_do_not(backend: Backend) {
    let host = SimHost::on(
        backend,
        "fl-state",
        json!({ "filterDefault": "DROP",
                "filter": [{ "index": 1, "direction": "egress", "target": "ALLOW" }] }),
    );
    host.route_outside_to_containers();
    let container = host.container("c1", Value::Null);
    for family in Family::BOTH {
        let outside = |port| SocketAddr::new(family.outside(), port);
        let _tcp = TcpServer::start(&host.outside, family.any(8080), "tcp out");
        let _udp = UdpServer::start(&host.outside, family.any(5353), "udp out");
        assert_eq!(
            tcp_request(&container.netns, outside(8080)).as_deref(),
            Ok("tcp out"),
            "{family:?}: the replies of an allowed TCP connection pass"
        );
        assert_eq!(
            udp_request(&container.netns, outside(5353)).map(|(answer, _)| answer),
            Ok("udp out".to_owned()),
            "{family:?}: the replies of an allowed UDP flow pass"
        );
        assert!(
            ping(&container.netns, family.outside()),
            "{family:?}: echo replies pass"
        );
        assert_eq!(
            udp_error(&container.netns, outside(5999)),
            std::io::ErrorKind::ConnectionRefused,
            "{family:?}: the port-unreachable error about an allowed flow passes"
        );
        let _inside_tcp = TcpServer::start(&container.netns, family.any(8080), "tcp in");
        let _inside_udp = UdpServer::start(&container.netns, family.any(5353), "udp in");
        assert!(
            tcp_dropped(&host.outside, container.at(family, 8080)),
            "{family:?} TCP in"
        );
        assert!(
            udp_dropped(&host.outside, container.at(family, 5353)),
            "{family:?} UDP in"
        );
        let address = container.at(family, 0).ip();
        assert!(
            !ping(&host.outside, address),
            "{family:?}: unsolicited echo requests"
        );
    }
}

fn connstate_new_matches_first_packets_and_established_the_later_ones_until_rules_change(
    backend: Backend,
) {
    let new_only = json!([
        { "index": 1, "direction": "ingress", "proto": "tcp", "dport": 8080, "connstate": "new",
          "target": "ALLOW" },
    ]);
    let host = SimHost::on(
        backend,
        "fl-connst",
        json!({ "filterDefault": "DROP", "filter": new_only }),
    );
    host.route_outside_to_containers();
    let container = host.container("c1", Value::Null);
    for family in Family::BOTH {
        let _echo = StreamEchoServer::start(&container.netns, family.any(8080));
        let target = container.at(family, 8080);
        host.readd_with(&container, json!({ "filter": new_only }))
            .unwrap_or_else(|error| panic!("re-ADD: {error}"));
        // The SYN is new and passes, the SYN-ACK is a reply; the client's later packets are
        // established, which no rule allows.
        let mut opened = Conversation::open(&host.outside, target)
            .unwrap_or_else(|error| panic!("{family:?}: the first packet passes: {error}"));
        assert!(
            dropped(opened.exchange(b"hello", DROPPED_AFTER), "a later packet"),
            "{family:?}: later packets are not new"
        );
        host.readd_with(
            &container,
            json!({ "filter": [
                { "index": 1, "direction": "ingress", "proto": "tcp", "dport": 8080,
                  "connstate": "new", "target": "ALLOW" },
                { "index": 2, "direction": "ingress", "proto": "tcp", "dport": 8080,
                  "connstate": "established", "target": "ALLOW" },
            ]}),
        )
        .unwrap_or_else(|error| panic!("re-ADD: {error}"));
        let mut conversation = Conversation::open(&host.outside, target)
            .unwrap_or_else(|error| panic!("{family:?}: {error}"));
        conversation
            .exchange(b"first", CLIENT_TIMEOUT)
            .unwrap_or_else(|error| panic!("{family:?}: established packets allowed: {error}"));
        // A rule in front that drops established packets cuts the running connection.
        host.readd_with(
            &container,
            json!({ "filter": [
                { "index": 0, "direction": "ingress", "proto": "tcp", "dport": 8080,
                  "connstate": "established", "target": "DROP" },
                { "index": 1, "direction": "ingress", "proto": "tcp", "dport": 8080,
                  "connstate": "new", "target": "ALLOW" },
                { "index": 2, "direction": "ingress", "proto": "tcp", "dport": 8080,
                  "connstate": "established", "target": "ALLOW" },
            ]}),
        )
        .unwrap_or_else(|error| panic!("re-ADD: {error}"));
        assert!(
            dropped(
                conversation.exchange(b"second", DROPPED_AFTER),
                "a packet of the running connection"
            ),
            "{family:?}: the connection is cut by the new rule"
        );
        let filter = inspected_filter(&host, &container);
        assert!(hits(&filter, Some(0)) >= 1, "{filter:#}");
    }
}

fn rules_match_addresses_protocols_ports_and_directions(backend: Backend) {
    let host = SimHost::on(
        backend,
        "fl-match",
        json!({ "filter": [
            { "index": 1, "proto": "udp", "dport": "6000-6009", "target": "DROP" },
            { "index": 2, "proto": "udp", "sport": "40000-40009", "direction": "ingress",
              "target": "DROP" },
            { "index": 3, "src": format!("{OUTSIDE_ADDR6}/128"), "proto": "tcp", "target": "DROP" },
            { "index": 4, "proto": "icmp", "direction": "ingress", "target": "DROP" },
            { "index": 5, "proto": "icmpv6", "direction": "ingress", "target": "DROP" },
            { "index": 6, "dst": format!("{OUTSIDE_ADDR}/32"), "proto": "tcp", "dport": 9000,
              "direction": "egress", "target": "DROP" },
            { "index": 7, "proto": "sctp", "dport": 7000, "target": "DROP" },
            { "index": 8, "dst": "2001:db8:1::/64", "proto": "udp", "dport": 9100,
              "direction": "egress", "target": "DROP" },
        ]}),
    );
    host.route_outside_to_containers();
    let container = host.container("c1", Value::Null);
    for family in Family::BOTH {
        let servers: Vec<UdpServer> = [6005, 6010, 6100]
            .into_iter()
            .map(|port| UdpServer::start(&container.netns, family.any(port), "udp"))
            .collect();
        assert_eq!(
            udp_from(&host.outside, 0, container.at(family, 6010)).as_deref(),
            Ok("udp")
        );
        assert!(
            udp_dropped(&host.outside, container.at(family, 6005)),
            "{family:?} dport range"
        );
        assert_eq!(
            udp_from(&host.outside, 41000, container.at(family, 6100)).as_deref(),
            Ok("udp"),
            "{family:?}: source port outside the range"
        );
        assert!(
            dropped(
                udp_from(&host.outside, 40005, container.at(family, 6100)),
                "UDP from a source port in the range"
            ),
            "{family:?}: source port in the range"
        );
        drop(servers);
        let _web = TcpServer::start(&container.netns, family.any(8080), "web");
        let from_outside = tcp_request(&host.outside, container.at(family, 8080));
        match family {
            Family::V4 => assert_eq!(from_outside.as_deref(), Ok("web"), "IPv4 is not src"),
            Family::V6 => assert!(
                tcp_dropped(&host.outside, container.at(family, 8080)),
                "the IPv6 src rule drops TCP from {OUTSIDE_ADDR6}"
            ),
        }
        assert!(
            ping(&container.netns, family.outside()),
            "{family:?}: egress pings pass"
        );
        assert!(
            !ping(&host.outside, container.at(family, 0).ip()),
            "{family:?}: ingress echo requests are dropped (icmp / icmpv6 rules)"
        );
    }
    // Neighbour discovery still works under an icmpv6 DROP: IPv6 UDP above went through.
    let _closed = TcpServer::start(&host.outside, Family::V4.any(9000), "9000");
    let _open = TcpServer::start(&host.outside, Family::V4.any(9001), "9001");
    assert_eq!(
        tcp_request(&container.netns, SocketAddr::from((OUTSIDE_ADDR, 9001))).as_deref(),
        Ok("9001")
    );
    assert!(
        tcp_dropped(&container.netns, SocketAddr::from((OUTSIDE_ADDR, 9000))),
        "egress rule with dst and dport"
    );
    let _inside = TcpServer::start(&container.netns, Family::V4.any(9000), "in 9000");
    assert_eq!(
        tcp_request(&host.outside, container.at(Family::V4, 9000)).as_deref(),
        Ok("in 9000"),
        "the egress rule does not apply to ingress"
    );
    for family in Family::BOTH {
        let _server = UdpServer::start(&host.outside, family.any(9100), "9100");
        let sent = udp_from(&container.netns, 0, SocketAddr::new(family.outside(), 9100));
        match family {
            Family::V4 => assert_eq!(sent.as_deref(), Ok("9100"), "the dst rule is IPv6"),
            Family::V6 => assert!(
                dropped(sent, "UDP to the IPv6 dst CIDR"),
                "the IPv6 dst CIDR rule drops it"
            ),
        }
    }
    let filter = inspected_filter(&host, &container);
    assert_eq!(filter["rules"][6]["proto"], "sctp", "{filter:#}");
}

/// An `sctp` rule with a port drops the associations to that port and no other: needs a
/// kernel with SCTP.
fn sctp_rules_match_associations(backend: Backend) {
    if !kernel_has_sctp() {
        cnibpf_tests::skip("this kernel has no SCTP");
        return;
    }
    let host = SimHost::on(
        backend,
        "fl-sctp",
        json!({ "filter": [{ "index": 7, "proto": "sctp", "dport": 7000, "target": "DROP" }] }),
    );
    host.route_outside_to_containers();
    let container = host.container("c1", Value::Null);
    let passed = sctp_request(
        &host.outside,
        &container.netns,
        container.at(Family::V4, 7001),
        Family::V4.any(7001),
    );
    assert_eq!(passed.as_deref(), Ok("sctp"), "SCTP to port 7001 passes");
    let refused = sctp_request(
        &host.outside,
        &container.netns,
        container.at(Family::V4, 7000),
        Family::V4.any(7000),
    );
    assert!(
        dropped(refused, "SCTP to port 7000"),
        "SCTP to port 7000 is dropped"
    );
}

fn host_port_traffic_is_filtered_by_the_container_side_addresses(backend: Backend) {
    // The rules name containerPort 80; clients use hostPort 8080.
    let host = SimHost::on(
        backend,
        "fl-hostport",
        json!({ "capabilities": { "portMappings": true }, "filter": [
            { "index": 1, "src": format!("{OUTSIDE_ADDR}/32"), "proto": "tcp", "dport": 80,
              "target": "DROP" },
            { "index": 2, "src": format!("{OUTSIDE_ADDR6}/128"), "proto": "tcp", "dport": 80,
              "target": "DROP" },
        ]}),
    );
    let container = host.container("c1", port_mappings(&[(8080, 80, "tcp"), (8081, 81, "tcp")]));
    for family in Family::BOTH {
        let _guarded = TcpServer::start(&container.netns, family.any(80), "80");
        let _open = TcpServer::start(&container.netns, family.any(81), "81");
        assert_eq!(
            tcp_request(&host.outside, host.uplink(family, 8081)).as_deref(),
            Ok("81"),
            "{family:?}: hostPort 8081 (container port 81) is not filtered"
        );
        assert!(
            tcp_dropped(&host.outside, host.uplink(family, 8080)),
            "{family:?}: hostPort 8080 arrives as container port 80 from the outside: dropped"
        );
        let (answer, _) = host
            .host_client("tcp", host.uplink(family, 8080))
            .unwrap_or_else(|error| panic!("{family:?}: a host process, same hostPort: {error}"));
        assert_eq!(
            answer, "80",
            "{family:?}: the rules' src is the outside only"
        );
    }
    // Hairpin: a neighbour reaching the hostPort arrives with its own address as the source.
    let neighbour = host.container("c2", Value::Null);
    let _open = TcpServer::start(&container.netns, Family::V4.any(81), "81");
    assert_eq!(
        tcp_request(&neighbour.netns, host.uplink(Family::V4, 8081)).as_deref(),
        Ok("81"),
        "hairpin from the neighbour"
    );
    let mut rules = inspected_filter(&host, &container)["rules"].clone();
    if let Some(rules) = rules.as_array_mut() {
        for rule in rules.iter_mut().filter_map(Value::as_object_mut) {
            rule.retain(|_, value| !value.is_null());
            for counter in ["packets", "bytes", "connstate", "direction"] {
                rule.remove(counter);
            }
        }
        rules.push(
            json!({ "index": 3, "src": format!("{}/32", neighbour.address),
                           "target": "DROP" }),
        );
    }
    host.readd_with(&container, json!({ "filter": rules }))
        .unwrap_or_else(|error| panic!("re-ADD: {error}"));
    assert!(
        tcp_dropped(&neighbour.netns, host.uplink(Family::V4, 8081)),
        "hairpin traffic is filtered with the neighbour's address as its source"
    );
}

/// Filtered containers reach their own hostPorts and their neighbours' (hairpin), through the
/// uplink's address and the gateway's, both families, TCP and UDP; the filter still judges that
/// traffic (a hostPort leading to a dropped port stays closed) and the bridged traffic between
/// neighbours. On nftables the bridge then hands its frames to the IP hooks: the ports' hairpin
/// mode is what lets a container's DNATed frame back to itself.
fn hairpin_reaches_itself_and_its_neighbour_with_filters_on(backend: Backend) {
    let host = SimHost::on(
        backend,
        "fl-hairpin",
        json!({ "filter": [
            { "index": 1, "direction": "ingress", "proto": "tcp", "dport": 81, "target": "DROP" },
        ]}),
    );
    let c1 = host.container(
        "c1",
        port_mappings(&[(8080, 80, "tcp"), (8082, 81, "tcp"), (5353, 53, "udp")]),
    );
    let c2 = host.container("c2", port_mappings(&[(8081, 80, "tcp")]));
    for family in Family::BOTH {
        let _servers = [
            TcpServer::start(&c1.netns, c1.at(family, 80), "c1"),
            TcpServer::start(&c1.netns, c1.at(family, 81), "c1 81"),
            TcpServer::start(&c2.netns, c2.at(family, 80), "c2"),
            TcpServer::start(&c2.netns, c2.at(family, 81), "c2 81"),
        ];
        let _dns = UdpServer::start(&c1.netns, c1.at(family, 53), "dns c1");
        let gateway = match family {
            Family::V4 => SocketAddr::from((GATEWAY, 0)),
            Family::V6 => SocketAddr::from((GATEWAY6, 0)),
        };
        for host_address in [host.uplink(family, 0), gateway] {
            let at = |port| SocketAddr::new(host_address.ip(), port);
            let what =
                |path: &str| format!("{backend:?} {family:?} {path} via {}", host_address.ip());
            assert_eq!(
                tcp_request(&c1.netns, at(8080)).as_deref(),
                Ok("c1"),
                "{}",
                what("c1 to itself")
            );
            assert_eq!(
                tcp_request(&c1.netns, at(8081)).as_deref(),
                Ok("c2"),
                "{}",
                what("c1 to its neighbour")
            );
            assert_eq!(
                tcp_request(&c2.netns, at(8080)).as_deref(),
                Ok("c1"),
                "{}",
                what("c2 to its neighbour")
            );
            let answer = udp_request(&c1.netns, at(5353)).map(|(answer, _)| answer);
            assert_eq!(
                answer.as_deref(),
                Ok("dns c1"),
                "{}",
                what("UDP c1 to itself")
            );
            assert!(
                tcp_dropped(&c1.netns, at(8082)),
                "{}",
                what("c1 to itself, to a port its filter drops")
            );
        }
        assert!(
            tcp_dropped(&c2.netns, c1.at(family, 81)),
            "{backend:?} {family:?}: bridged traffic between neighbours is filtered"
        );
    }
}

fn masqueraded_connections_replies_and_errors_pass_a_default_drop(backend: Backend) {
    let host = SimHost::on(
        backend,
        "fl-masq",
        json!({ "ipMasq": true, "filterDefault": "DROP", "filter": [
            { "index": 1, "direction": "egress", "proto": "tcp", "dport": 8080, "target": "ALLOW" },
            { "index": 2, "direction": "egress", "proto": "udp", "target": "ALLOW" },
        ]}),
    );
    let container = host.container("c1", Value::Null);
    for family in Family::BOTH {
        let outside = |port| SocketAddr::new(family.outside(), port);
        let _allowed = TcpServer::start(&host.outside, family.any(8080), "masqueraded");
        let _other = TcpServer::start(&host.outside, family.any(8090), "not allowed");
        let answer = tcp_request(&container.netns, outside(8080));
        assert_eq!(answer.as_deref(), Ok("masqueraded"), "{family:?}");
        assert!(
            tcp_dropped(&container.netns, outside(8090)),
            "{family:?}: no rule allows 8090"
        );
        assert_eq!(
            udp_error(&container.netns, outside(5999)),
            std::io::ErrorKind::ConnectionRefused,
            "{family:?}: the translated port-unreachable error passes with its flow"
        );
    }
}

/// Containers on one bridge reach each other without the IP stack: the eBPF backend judges at
/// the veth, the nftables backend has the bridge hand its frames to the IP hooks. A DROP a
/// neighbour walks past is the hole this catches.
fn neighbours_on_one_bridge_are_filtered(backend: Backend) {
    let host = SimHost::on(
        backend,
        "fl-bridge",
        json!({ "filter": [
            { "index": 1, "direction": "ingress", "proto": "tcp", "dport": 8080, "target": "DROP" },
            { "index": 2, "direction": "ingress", "proto": "udp", "dport": 5353, "target": "DROP" },
        ]}),
    );
    let guarded = host.container("c1", Value::Null);
    let neighbour = host.container("c2", Value::Null);
    for family in Family::BOTH {
        let _server = TcpServer::start(&guarded.netns, family.any(8080), "bridged");
        let _open = TcpServer::start(&guarded.netns, family.any(8081), "open");
        let _dns = UdpServer::start(&guarded.netns, family.any(5353), "dns");
        let _dns_open = UdpServer::start(&guarded.netns, family.any(5354), "dns open");
        assert_eq!(
            tcp_request(&neighbour.netns, guarded.at(family, 8081)).as_deref(),
            Ok("open"),
            "{family:?}: the neighbour reaches what no rule drops"
        );
        assert!(
            tcp_dropped(&neighbour.netns, guarded.at(family, 8080)),
            "{family:?}: a DROP holds between neighbours on one bridge"
        );
        assert!(
            udp_dropped(&neighbour.netns, guarded.at(family, 5353)),
            "{family:?}: UDP too"
        );
        assert_eq!(
            udp_from(&neighbour.netns, 0, guarded.at(family, 5354)).as_deref(),
            Ok("dns open"),
            "{family:?}: replies of allowed UDP come back"
        );
    }
    // The rule's counter saw the neighbour's packets.
    let inspect = host.inspect();
    let packets = inspect["attachments"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|attachment| attachment["containerID"] == guarded.attachment.container_id)
        .and_then(|attachment| attachment["filter"]["rules"][0]["packets"].as_u64())
        .unwrap_or_default();
    assert!(packets >= 2, "rule 1 counted the dropped SYNs: {inspect}");
}

fn connstate_new_is_the_first_packet_on_ebpf_and_conntracks_new_on_nftables(backend: Backend) {
    let host = SimHost::on(
        backend,
        "fl-newness",
        json!({ "filterDefault": "DROP", "filter": [
            { "index": 1, "direction": "ingress", "proto": "udp", "dport": 6000,
              "connstate": "new", "target": "ALLOW" },
        ]}),
    );
    host.route_outside_to_containers();
    let container = host.container("c1", Value::Null);
    let counter = UdpCounter::start(&container.netns, container.at(Family::V4, 6000));
    let target = container.at(Family::V4, 6000);
    // Two datagrams of one flow, and no answer in between.
    host.outside.run(move || {
        let socket = std::net::UdpSocket::bind("0.0.0.0:0").expect("bind");
        for _ in 0..2 {
            socket.send_to(b"tick", target).expect("send");
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    let expected = match backend {
        // The second datagram is a later packet of the connection: `new` no longer matches.
        Backend::Ebpf => 1,
        // conntrack calls a flow NEW until it sees a reply.
        Backend::Nftables => 2,
    };
    assert_eq!(counter.received(), expected, "{backend:?}");
}

fn replies_after_a_rule_change_drops_the_connection(backend: Backend) {
    let allow = json!({ "filterDefault": "DROP", "filter": [
        { "index": 1, "direction": "egress", "proto": "udp", "target": "ALLOW" },
    ]});
    let host = SimHost::on(backend, "fl-cutreply", allow);
    host.route_outside_to_containers();
    let container = host.container("c1", Value::Null);
    let server = host
        .outside
        .run(|| std::net::UdpSocket::bind("0.0.0.0:7100").expect("bind the outside socket"));
    server
        .set_read_timeout(Some(CLIENT_TIMEOUT))
        .expect("timeout");
    let client = container.netns.run(|| {
        let socket = std::net::UdpSocket::bind("0.0.0.0:7200").expect("bind");
        socket
            .set_read_timeout(Some(DROPPED_AFTER))
            .expect("timeout");
        socket
    });
    let outside = SocketAddr::from((OUTSIDE_ADDR, 7100));
    let mut buffer = [0u8; 64];
    client.send_to(b"first", outside).expect("send");
    let (_, peer) =
        uninterrupted(|| server.recv_from(&mut buffer)).expect("the first datagram arrives");
    server.send_to(b"reply", peer).expect("reply");
    assert!(
        uninterrupted(|| client.recv(&mut buffer)).is_ok(),
        "a reply passes"
    );
    host.readd_with(
        &container,
        json!({ "filterDefault": "DROP", "filter": [
            { "index": 0, "direction": "egress", "proto": "udp", "connstate": "established",
              "target": "DROP" },
            { "index": 1, "direction": "egress", "proto": "udp", "target": "ALLOW" },
        ]}),
    )
    .unwrap_or_else(|error| panic!("re-ADD: {error}"));
    client.send_to(b"second", outside).expect("send");
    server
        .set_read_timeout(Some(DROPPED_AFTER))
        .expect("timeout");
    assert!(
        dropped(
            uninterrupted(|| server.recv_from(&mut buffer)).map_err(|error| error.to_string()),
            "the connection's datagram"
        ),
        "the connection's packet is dropped"
    );
    server.send_to(b"late reply", peer).expect("reply");
    let late = uninterrupted(|| client.recv(&mut buffer)).is_ok();
    match backend {
        Backend::Ebpf => assert!(!late, "replies of a dropped connection are dropped too"),
        Backend::Nftables => assert!(late, "conntrack still lets the reply through"),
    }
}

/// `count` filler rules from `first_index` on that match nothing the test sends.
fn filler_rules(first_index: u64, count: u64) -> Vec<Value> {
    (0..count)
        .map(|offset| {
            json!({ "index": first_index + offset, "proto": "udp", "dport": 20_000 + offset,
                    "target": "DROP" })
        })
        .collect()
}

fn readd_replaces_the_rules_atomically_while_traffic_runs(backend: Backend) {
    // Both rule sets allow port 7002 and drop 7001 (by default), with the ALLOW at the
    // other end of 200 other rules: a half-written set would drop 7002 or pass 7001.
    let allow_7002 =
        |index: u64| json!({ "index": index, "proto": "udp", "dport": 7002, "target": "ALLOW" });
    let mut first = vec![allow_7002(5)];
    first.extend(filler_rules(100, 200));
    let mut second = filler_rules(10, 200);
    second.push(allow_7002(250));
    let keys = |rules: &Vec<Value>| json!({ "filterDefault": "DROP", "filter": rules });
    let host = SimHost::on(backend, "fl-atomic", keys(&first));
    host.route_outside_to_containers();
    let container = host.container("c1", Value::Null);
    let counters: Vec<(Family, u16, UdpCounter)> = Family::BOTH
        .into_iter()
        .flat_map(|family| [(family, 7001), (family, 7002)])
        .map(|(family, port)| {
            let counter = UdpCounter::start(&container.netns, container.at(family, port));
            (family, port, counter)
        })
        .collect();
    let targets = counters
        .iter()
        .map(|(family, port, _)| container.at(*family, *port))
        .collect();
    // Warm up the neighbours, then count from zero.
    for family in Family::BOTH {
        let _ = udp_request(&host.outside, container.at(family, 7002));
    }
    let before: Vec<u64> = counters
        .iter()
        .map(|(_, _, counter)| counter.received())
        .collect();
    let sender = UdpSender::start(&host.outside, targets, Duration::from_micros(100));
    for round in 0..10 {
        for rules in [&second, &first] {
            host.readd_with(&container, keys(rules))
                .unwrap_or_else(|error| panic!("re-ADD {round}: {error}"));
        }
    }
    let rounds = sender.stop();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        rounds > 100,
        "the sender ran through the changes ({rounds} rounds)"
    );
    for ((family, port, counter), before) in counters.iter().zip(before) {
        let received = counter.received() - before;
        let expected = if *port == 7002 { rounds } else { 0 };
        assert_eq!(
            received, expected,
            "{family:?} port {port}: {received} of {rounds} datagrams arrived during 20 rule changes"
        );
    }
}

fn up_to_256_rules_per_attachment_more_is_invalid_config(backend: Backend) {
    let host = SimHost::on(
        backend,
        "fl-limit",
        json!({ "filter": filler_rules(0, 257) }),
    );
    let error = host
        .add_container("c1", Value::Null)
        .expect_err("257 rules must be refused");
    assert_eq!(error.0.error_code(), Some(7), "{error}");
    assert!(
        error.0.error_msg().contains("at most 256"),
        "the message names the limit: {error}"
    );
    assert!(
        !host.pin_path.join("filters").exists(),
        "a refused ADD leaves no state behind"
    );
    let mut rules = filler_rules(0, 255);
    rules.push(json!({ "index": 1000, "proto": "udp", "dport": 5353, "target": "DROP" }));
    let host = SimHost::on(backend, "fl-256", json!({ "filter": rules }));
    host.route_outside_to_containers();
    let container = host.container("c1", Value::Null);
    let _open = UdpServer::start(&container.netns, Family::V4.any(5354), "open");
    let _last = UdpServer::start(&container.netns, Family::V4.any(5353), "last");
    assert_eq!(
        udp_from(&host.outside, 0, container.at(Family::V4, 5354)).as_deref(),
        Ok("open")
    );
    assert!(
        udp_dropped(&host.outside, container.at(Family::V4, 5353)),
        "the 256th rule applies"
    );
    let filter = inspected_filter(&host, &container);
    assert_eq!(filter["rules"].as_array().map(Vec::len), Some(256));
    assert!(hits(&filter, Some(1000)) >= 1, "{filter:#}");
}

fn fragmented_datagrams_follow_their_first_fragment(backend: Backend) {
    let host = SimHost::on(
        backend,
        "fl-frag",
        json!({ "filterDefault": "DROP", "filter": [
            { "index": 1, "proto": "udp", "dport": 5000, "direction": "ingress", "target": "ALLOW" },
            { "index": 2, "direction": "egress", "target": "ALLOW" },
        ]}),
    );
    host.route_outside_to_containers();
    let container = host.container("c1", Value::Null);
    let payload = vec![b'x'; 3000];
    for family in Family::BOTH {
        let _allowed = UdpServer::start(&container.netns, family.any(5000), "whole");
        let _denied = UdpServer::start(&container.netns, family.any(5001), "whole");
        let _outside = UdpServer::start(&host.outside, family.any(5002), "back");
        let send = |netns: &Netns, target: SocketAddr, timeout: Duration| {
            let payload = payload.clone();
            netns.run(move || udp_exchange_with(0, target, &payload, timeout))
        };
        assert_eq!(
            send(&host.outside, container.at(family, 5000), CLIENT_TIMEOUT)
                .map(|(answer, _)| answer),
            Ok("whole".to_owned()),
            "{family:?}: every fragment of an allowed datagram passes"
        );
        assert!(
            dropped(
                send(&host.outside, container.at(family, 5001), DROPPED_AFTER),
                "a fragmented datagram to a dropped port"
            ),
            "{family:?}: fragments of a dropped datagram do not reassemble"
        );
        assert_eq!(
            send(
                &container.netns,
                SocketAddr::new(family.outside(), 5002),
                CLIENT_TIMEOUT
            )
            .map(|(answer, _)| answer),
            Ok("back".to_owned()),
            "{family:?}: fragmented egress"
        );
    }
}

#[test]
fn drops_are_counted_per_rule_and_streamed_by_monitor() {
    let host = SimHost::new(
        "fl-monitor",
        json!({ "filter": [
            { "index": 10, "proto": "tcp", "dport": 8080, "direction": "ingress", "target": "DROP" },
        ]}),
    );
    host.route_outside_to_containers();
    // Named by the runtime, as containerd names a pod: the events name it too.
    let container = host
        .add_container_with_args(
            "c1",
            Value::Null,
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-0",
        )
        .unwrap_or_else(|error| panic!("ADD failed: {error}"));
    let mut json_monitor = start_monitor(&host, true);
    let json_lines = monitor_lines(&mut json_monitor);
    // A ring buffer has one read position: a second reader would take events from the first.
    assert!(
        eventually(Duration::from_secs(5), || host.monitor_following()),
        "the monitor took its lock"
    );
    let mut second = start_monitor(&host, false);
    if !eventually(Duration::from_secs(5), || {
        second.try_wait().is_ok_and(|status| status.is_some())
    }) {
        let _ = second.kill();
        panic!("a second monitor ran beside the first");
    }
    let second = second.wait_with_output().expect("second monitor");
    let refusal = String::from_utf8_lossy(&second.stderr);
    assert!(
        !second.status.success() && refusal.contains("another cnibpf monitor follows"),
        "a second monitor is refused: {second:?}"
    );
    // The monitor opens the ring buffer before the traffic starts.
    std::thread::sleep(Duration::from_millis(300));
    for family in Family::BOTH {
        let _open = TcpServer::start(&container.netns, family.any(8081), "open");
        let _guarded = TcpServer::start(&container.netns, family.any(8080), "guarded");
        assert_eq!(
            tcp_request(&host.outside, container.at(family, 8081)).as_deref(),
            Ok("open")
        );
        assert!(tcp_dropped(&host.outside, container.at(family, 8080)));
        let source = family.outside().to_string();
        let destination = container.at(family, 0).ip().to_string();
        let Some(event) = first_line_matching(&json_lines, |line| line.contains(&source)) else {
            let _ = json_monitor.kill();
            let output = json_monitor.wait_with_output().expect("monitor output");
            panic!("no {family:?} drop event from the JSON monitor: {output:?}");
        };
        let event: Value = serde_json::from_str(&event)
            .unwrap_or_else(|error| panic!("monitor printed no JSON ({error}): {event}"));
        assert_eq!(event["network"], host.network(), "{event}");
        assert_eq!(
            event["containerID"], container.attachment.container_id,
            "{event}"
        );
        assert_eq!(event["ifname"], "eth0", "{event}");
        assert_eq!(event["pod"], "shop/web-0", "{event}");
        assert_eq!(event["direction"], "ingress", "{event}");
        assert_eq!(event["rule"], 10, "{event}");
        assert_eq!(event["reason"], "filter_rule", "{event}");
        assert_eq!(event["protocol"], "tcp", "{event}");
        assert_eq!(event["src"], source, "{event}");
        assert_eq!(event["dst"], destination, "{event}");
        assert_eq!(event["dport"], 8080, "{event}");
        assert!(
            event["time"]
                .as_str()
                .is_some_and(|time| time.ends_with('Z')),
            "{event}"
        );
    }
    interrupt(json_monitor);
    let mut text_monitor = start_monitor(&host, false);
    let text_lines = monitor_lines(&mut text_monitor);
    assert!(
        eventually(Duration::from_secs(5), || host.monitor_following()),
        "the text monitor took its lock"
    );
    std::thread::sleep(Duration::from_millis(300));
    for family in Family::BOTH {
        let _guarded = TcpServer::start(&container.netns, family.any(8080), "guarded");
        assert!(tcp_dropped(&host.outside, container.at(family, 8080)));
        let source = family.outside().to_string();
        let line = first_line_matching(&text_lines, |line| line.contains(&source))
            .unwrap_or_else(|| panic!("no {family:?} drop event from the text monitor"));
        assert!(
            line.contains("eth0 pod shop/web-0 ingress DROP by rule 10: tcp")
                && line.contains(":8080"),
            "{line}"
        );
    }
    interrupt(text_monitor);
    let filter = inspected_filter(&host, &container);
    assert!(
        hits(&filter, Some(10)) >= 4,
        "both families' SYNs, twice: {filter:#}"
    );
    assert!(
        hits(&filter, None) >= 4,
        "the open connections' packets: {filter:#}"
    );
    let dumped = host.bpftool_dump("filter_hits");
    let per_cpu_rule_10: u64 = dumped
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|entry| {
            entry["formatted"]["values"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|cpu| cpu["value"]["rules"][0]["packets"].as_u64())
        .sum();
    assert_eq!(
        per_cpu_rule_10,
        hits(&filter, Some(10)),
        "bpftool shows the same per-CPU counters: {dumped:#}"
    );
}

fn del_gc_and_check_cover_the_filter_and_its_connections(backend: Backend) {
    let keys = json!({ "filterDefault": "DROP", "filter": [
        { "index": 1, "direction": "egress", "target": "ALLOW" },
    ]});
    let host = SimHost::on(backend, "fl-life", keys.clone());
    host.route_outside_to_containers();
    let first = host.container("c1", Value::Null);
    let second = host.container("c2", Value::Null);
    let _server = TcpServer::start(&host.outside, Family::V4.any(8080), "out");
    for container in [&first, &second] {
        assert_eq!(
            tcp_request(&container.netns, SocketAddr::from((OUTSIDE_ADDR, 8080))).as_deref(),
            Ok("out")
        );
    }
    host.check(&first)
        .unwrap_or_else(|error| panic!("CHECK: {error}"));
    let ifindex = |container: &Container| -> u32 {
        let name = host.host_interface(container);
        host.host
            .run(move || nix::net::if_::if_nametoindex(name.as_str()).expect("host interface"))
    };
    // The filter's state of an attachment: (rule set present, what else of it is left: its
    // tracked connections on eBPF; on nftables, where the kernel's conntrack tracks them, the
    // rules and dispatch elements that lead to its chains).
    let state_of = |ifindex: u32, owner_chain: &str| -> (bool, usize) {
        match backend {
            Backend::Ebpf if !host.pin_path.exists() => (false, 0),
            Backend::Ebpf => (
                host.pinned_hash_map::<u32, FilterSet>("filters")
                    .get(&ifindex, 0)
                    .is_ok(),
                host.pinned_hash_map::<FilterFlowKey, FilterFlow>("filter_flows")
                    .iter()
                    .map(|entry| entry.expect("read filter_flows"))
                    .filter(|(key, _)| key.ifindex == ifindex)
                    .count(),
            ),
            Backend::Nftables => {
                let ruleset = host.nft_ruleset();
                (
                    ruleset.contains(&format!("chain {owner_chain}_in"))
                        && ruleset.contains(&format!("chain {owner_chain}_out")),
                    ruleset.matches(owner_chain).count(),
                )
            }
        }
    };
    let chain_of = |container: &Container| {
        let owner = inspected_owner(&host, container);
        format!("f_{owner}")
    };
    let (first_ifindex, first_chain) = (ifindex(&first), chain_of(&first));
    let (second_ifindex, second_chain) = (ifindex(&second), chain_of(&second));
    match backend {
        Backend::Ebpf => {
            let mut filters = host.pinned_hash_map::<u32, FilterSet>("filters");
            filters.remove(&first_ifindex).expect("remove the filter");
        }
        Backend::Nftables => {
            host.host.exec(&[
                "nft",
                "flush",
                "chain",
                "inet",
                "cnibpf",
                &format!("{first_chain}_in"),
            ]);
        }
    }
    let error = host
        .check(&first)
        .expect_err("CHECK must notice the missing filter");
    assert_eq!(error.0.error_code(), Some(105), "{error}");
    host.readd_with(&first, keys)
        .unwrap_or_else(|error| panic!("re-ADD repairs: {error}"));
    host.check(&first)
        .unwrap_or_else(|error| panic!("CHECK after repair: {error}"));
    let (present, held) = state_of(first_ifindex, &first_chain);
    assert!(present, "the filter is in place");
    assert!(
        held >= 1,
        "connections are tracked (eBPF), dispatch leads to the chains (nftables)"
    );
    host.del(&first)
        .unwrap_or_else(|error| panic!("DEL: {error}"));
    assert_eq!(
        state_of(first_ifindex, &first_chain),
        (false, 0),
        "DEL removes the filter and the attachment's connections"
    );
    assert!(
        state_of(second_ifindex, &second_chain).0,
        "the other attachment keeps its filter"
    );
    host.chain
        .gc(&[])
        .unwrap_or_else(|error| panic!("GC: {error}"));
    assert_eq!(
        state_of(second_ifindex, &second_chain),
        (false, 0),
        "GC removes the filter of an attachment not listed"
    );
    assert!(
        host.inspect()["attachments"]
            .as_array()
            .is_none_or(Vec::is_empty)
    );
}

/// The owner id `cnibpf inspect` shows for `container`.
fn inspected_owner(host: &SimHost, container: &Container) -> String {
    host.inspect()["attachments"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|attachment| attachment["containerID"] == container.attachment.container_id)
        .and_then(|attachment| attachment["owner"].as_str().map(str::to_owned))
        .unwrap_or_else(|| panic!("{} not in inspect", container.attachment.container_id))
}

/// The longest rule the configuration allows (two full IPv6 host addresses, both port ranges,
/// a protocol, a connection state, a direction) and the shortest, as inspect shows them: each
/// field as configured, whichever backend holds it.
fn inspect_shows_each_rule_as_configured(backend: Backend) {
    let longest = json!({ "index": 4_294_967_295u32, "target": "DROP",
        "src": "2001:db8:ffff:ffff:ffff:ffff:ffff:fff1/128",
        "dst": "2001:db8:ffff:ffff:ffff:ffff:ffff:fff2/128", "proto": "sctp",
        "sport": "10000-10999", "dport": "60000-65535", "connstate": "established",
        "direction": "egress" });
    let host = SimHost::on(
        backend,
        "fl-inspect",
        json!({ "filter": [
            longest,
            { "index": 3, "target": "ALLOW", "dst": "10.22.0.0/16", "proto": "icmp", "direction": "ingress" },
            { "index": 2, "target": "ALLOW" },
        ]}),
    );
    let container = host.container("c1", Value::Null);
    let filter = inspected_filter(&host, &container);
    let rules: Vec<Value> = filter["rules"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|mut rule| {
            let rule = rule.as_object_mut().expect("a rule is an object");
            rule.remove("packets");
            rule.remove("bytes");
            Value::Object(rule.clone())
        })
        .collect();
    assert_eq!(
        rules,
        [
            json!({ "index": 2, "target": "ALLOW", "src": null, "dst": null, "proto": "any",
                "sport": null, "dport": null, "connstate": "any", "direction": "both" }),
            json!({ "index": 3, "target": "ALLOW", "src": null, "dst": "10.22.0.0/16",
                "proto": "icmp", "sport": null, "dport": null, "connstate": "any",
                "direction": "ingress" }),
            json!({ "index": 4_294_967_295u32, "target": "DROP",
                "src": "2001:db8:ffff:ffff:ffff:ffff:ffff:fff1/128",
                "dst": "2001:db8:ffff:ffff:ffff:ffff:ffff:fff2/128", "proto": "sctp",
                "sport": "10000-10999", "dport": "60000-65535", "connstate": "established",
                "direction": "egress" }),
        ],
        "{backend:?}: {filter:#}"
    );
    host.check(&container)
        .unwrap_or_else(|error| panic!("CHECK reads the rules back: {error}"));
}

for_both_backends!(
    inspect_shows_each_rule_as_configured,
    connstate_new_is_the_first_packet_on_ebpf_and_conntracks_new_on_nftables,
    replies_after_a_rule_change_drops_the_connection,
    neighbours_on_one_bridge_are_filtered,
    rules_apply_in_index_order_not_in_array_order,
    the_proposal_example_drops_a_source_network_before_allowing_new_web_connections,
    replies_and_related_errors_pass_a_default_drop_unsolicited_packets_do_not,
    connstate_new_matches_first_packets_and_established_the_later_ones_until_rules_change,
    rules_match_addresses_protocols_ports_and_directions,
    sctp_rules_match_associations,
    host_port_traffic_is_filtered_by_the_container_side_addresses,
    hairpin_reaches_itself_and_its_neighbour_with_filters_on,
    masqueraded_connections_replies_and_errors_pass_a_default_drop,
    readd_replaces_the_rules_atomically_while_traffic_runs,
    up_to_256_rules_per_attachment_more_is_invalid_config,
    fragmented_datagrams_follow_their_first_fragment,
    del_gc_and_check_cover_the_filter_and_its_connections,
);
