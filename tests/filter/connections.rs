//! Connections: replies and related errors, `connstate`, rule changes cutting running
//! connections, atomic re-ADDs under traffic, fragments, masqueraded connections.

use super::*;

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
    // Hundreds of datagrams per target across each change, few enough that a 2-core machine
    // running another suite beside keeps up with them (its backlog queues hold 1,000 packets).
    let sender = UdpSender::start(&host.outside, targets, Duration::from_micros(250));
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

for_both_backends!(
    connstate_new_is_the_first_packet_on_ebpf_and_conntracks_new_on_nftables,
    replies_after_a_rule_change_drops_the_connection,
    replies_and_related_errors_pass_a_default_drop_unsolicited_packets_do_not,
    connstate_new_matches_first_packets_and_established_the_later_ones_until_rules_change,
    masqueraded_connections_replies_and_errors_pass_a_default_drop,
    readd_replaces_the_rules_atomically_while_traffic_runs,
    fragmented_datagrams_follow_their_first_fragment,
);
