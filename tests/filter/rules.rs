//! What rules match: index order, addresses, protocols, ports, directions, SCTP, the
//! largest rule set, and inspect showing each rule as configured.

use super::*;

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
    rules_apply_in_index_order_not_in_array_order,
    the_proposal_example_drops_a_source_network_before_allowing_new_web_connections,
    rules_match_addresses_protocols_ports_and_directions,
    sctp_rules_match_associations,
    up_to_256_rules_per_attachment_more_is_invalid_config,
);
