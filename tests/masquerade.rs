//! Masquerade (`ipMasq`): container traffic leaving through the uplink carries the uplink's
//! address, and the outside namespace has no route back to the containers.

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use cnibpf_common::{
    masq_flow::{MasqFlow, STATE_CLOSING, STATE_ESTABLISHED, timeout_ns},
    masq_reply::MasqReply,
    masq_source::{MasqSource, MasqSourceKey},
    nat_flow::NatFlowKey,
};
use cnibpf_tests::{
    Container, SimHost, for_both_backends,
    topology::{
        Backend, FAR_ADDR, FAR_ADDR6, Family, HOST_UPLINK_ADDR, HOST_UPLINK_ADDR6, UPLINK,
        port_mappings,
    },
    traffic::{
        CLIENT_TIMEOUT, Conversation, EchoServer, SinkServer, StreamEchoServer, TcpServer,
        UdpServer, any_address_for, ping, reset_on_close, tcp_exchange, tcp_request, tcp_upload,
        udp_error, udp_exchange_from, udp_exchange_with, udp_request, uninterrupted,
    },
};
use serde_json::{Value, json};

fn masquerading(backend: Backend, id: &str) -> SimHost {
    SimHost::on(backend, id, json!({ "ipMasq": true }))
}

fn uplink_address(family: Family) -> IpAddr {
    match family {
        Family::V4 => IpAddr::V4(HOST_UPLINK_ADDR),
        Family::V6 => IpAddr::V6(HOST_UPLINK_ADDR6),
    }
}

fn far(family: Family, port: u16) -> SocketAddr {
    match family {
        Family::V4 => SocketAddr::new(IpAddr::V4(FAR_ADDR), port),
        Family::V6 => SocketAddr::new(IpAddr::V6(FAR_ADDR6), port),
    }
}

fn tcp_udp_and_ping_reach_an_outside_without_a_route_back_as_the_uplink(backend: Backend) {
    let host = masquerading(backend, "mq-basic");
    let container = host.container("c1", Value::Null);
    for family in Family::BOTH {
        let tcp = TcpServer::start(&host.outside, family.any(8080), "tcp hello");
        let udp = UdpServer::start(&host.outside, family.any(5353), "udp hello");
        let target = |port| SocketAddr::new(family.outside(), port);
        assert_eq!(
            tcp_request(&container.netns, target(8080)).as_deref(),
            Ok("tcp hello"),
            "{family:?} TCP"
        );
        let (answer, from) = udp_request(&container.netns, target(5353))
            .unwrap_or_else(|error| panic!("{family:?} UDP: {error}"));
        assert_eq!(
            (answer.as_str(), from),
            ("udp hello", target(5353)),
            "{family:?} UDP reply comes from the server's own address"
        );
        for peers in [tcp.peers(), udp.peers()] {
            assert!(
                !peers.is_empty() && peers.iter().all(|peer| peer.ip() == uplink_address(family)),
                "{family:?}: the server saw {peers:?}, not the uplink address"
            );
        }
        assert!(ping(&container.netns, family.outside()), "{family:?} ping");
    }
    if backend == Backend::Ebpf {
        let icmp_flows = host
            .masq_flows()
            .iter()
            .filter(|(key, _)| key.protocol == 1 || key.protocol == 58)
            .count();
        assert_eq!(icmp_flows, 2, "one tracked echo flow per family");
    }
}

fn source_ports_are_kept_when_free_and_a_collision_picks_another(backend: Backend) {
    let host = masquerading(backend, "mq-ports");
    let first = host.container("c1", Value::Null);
    let second = host.container("c2", Value::Null);
    for family in Family::BOTH {
        let udp = UdpServer::start(&host.outside, family.any(5353), "hello");
        let target = SocketAddr::new(family.outside(), 5353);
        for container in [&first, &second] {
            let (answer, _) = container
                .netns
                .run(move || udp_exchange_from(40_000, target, CLIENT_TIMEOUT))
                .unwrap_or_else(|error| panic!("{family:?} from port 40000: {error}"));
            assert_eq!(answer, "hello");
        }
        let ports: Vec<u16> = udp.peers().iter().map(SocketAddr::port).collect();
        assert_eq!(ports.len(), 2, "{family:?}: {ports:?}");
        assert_eq!(ports[0], 40_000, "{family:?}: the first keeps its port");
        assert_ne!(ports[1], 40_000, "{family:?}: the second gets another");
        assert!(ports[1] >= 1024, "{family:?}: from the same port class");
    }
    if backend == Backend::Ebpf {
        assert!(host.masq_stats().port_collisions >= 2);
    }
}

fn a_port_a_host_socket_holds_is_not_taken_for_a_container(backend: Backend) {
    let host = masquerading(backend, "mq-hsock");
    let container = host.container("c1", Value::Null);
    for family in Family::BOTH {
        let udp = UdpServer::start(&host.outside, family.any(5353), "hello");
        let target = SocketAddr::new(family.outside(), 5353);
        // A host process talks to the server from port 40000 of the uplink's address ...
        let host_socket = host.host.run(move || {
            let socket = std::net::UdpSocket::bind(SocketAddr::new(uplink_address(family), 40_000))
                .expect("bind the host socket");
            socket.connect(target).expect("connect the host socket");
            socket
                .set_read_timeout(Some(CLIENT_TIMEOUT))
                .expect("timeout");
            socket
        });
        // nftables' NAT knows a host socket only once it has sent (a conntrack entry): then.
        if backend == Backend::Nftables {
            host_socket.send(b"ping").expect("host send");
            let mut buffer = [0u8; 64];
            let length = uninterrupted(|| host_socket.recv(&mut buffer)).expect("host reply");
            assert_eq!(&buffer[..length], b"hello");
        }
        // ... when a container uses the same source port towards the same server.
        let (answer, _) = container
            .netns
            .run(move || udp_exchange_from(40_000, target, CLIENT_TIMEOUT))
            .unwrap_or_else(|error| panic!("{family:?} container: {error}"));
        assert_eq!(answer, "hello");
        host_socket.send(b"ping").expect("host send");
        let mut buffer = [0u8; 64];
        let length = uninterrupted(|| host_socket.recv(&mut buffer)).unwrap_or_else(|error| {
            panic!("{family:?}: the host socket's reply was taken: {error}")
        });
        assert_eq!(&buffer[..length], b"hello");
        let ports: Vec<u16> = udp.peers().iter().map(SocketAddr::port).collect();
        let container_ports: Vec<u16> = ports
            .iter()
            .copied()
            .filter(|port| *port != 40_000)
            .collect();
        assert_eq!(
            container_ports.len(),
            1,
            "{family:?}: the container's datagram came from another port: {ports:?}"
        );
        assert!(
            ports.contains(&40_000),
            "{family:?}: the host socket kept its own: {ports:?}"
        );
    }
}

fn a_host_port_added_later_does_not_take_a_masqueraded_flows_replies(backend: Backend) {
    let host = masquerading(backend, "mq-later");
    let client = host.container("c1", Value::Null);
    for family in Family::BOTH {
        let _udp = UdpServer::start(&host.outside, family.any(5353), "hello");
        let target = SocketAddr::new(family.outside(), 5353);
        let exchange = || {
            client
                .netns
                .run(move || udp_exchange_from(40_000, target, CLIENT_TIMEOUT))
        };
        exchange().unwrap_or_else(|error| panic!("{family:?} before: {error}"));
        // Another container now maps the uplink's port 40000 the flow's replies arrive on.
        let mapper = host.container(
            &format!("m{}", family as u8),
            port_mappings(&[(40_000, 53, "udp")]),
        );
        let (answer, _) =
            exchange().unwrap_or_else(|error| panic!("{family:?} after the hostPort: {error}"));
        assert_eq!(answer, "hello", "{family:?}");
        host.del(&mapper).expect("DEL the mapper");
    }
}

fn a_thousand_concurrent_flows_from_eight_containers_all_complete(backend: Backend) {
    let host = masquerading(backend, "mq-many");
    let containers: Vec<Container> = (0..8)
        .map(|index| host.container(&format!("c{index}"), Value::Null))
        .collect();
    // Bound to [::], it serves IPv4 too.
    let _server = EchoServer::start(&host.outside, Family::V6.any(7000), 8);
    let handles: Vec<_> = containers
        .iter()
        .enumerate()
        .map(|(index, container)| {
            // Half the containers over IPv4, half over IPv6.
            let family = if index % 2 == 0 {
                Family::V4
            } else {
                Family::V6
            };
            let target = SocketAddr::new(family.outside(), 7000);
            container.netns.spawn(move || {
                use std::io::{Read as _, Write as _};
                // 125 connections held open at once; each sends its byte at once, and the
                // answers are read once all are open.
                let mut streams = Vec::new();
                for _ in 0..125 {
                    let mut stream =
                        std::net::TcpStream::connect_timeout(&target, Duration::from_secs(5))
                            .map_err(|error| error.to_string())?;
                    stream.write_all(&[7]).map_err(|error| error.to_string())?;
                    streams.push(stream);
                }
                let mut completed = 0;
                for mut stream in streams {
                    let mut byte = [0u8];
                    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
                    if stream.read_exact(&mut byte).is_ok() && byte == [7] {
                        completed += 1;
                    }
                }
                Ok::<u32, String>(completed)
            })
        })
        .collect();
    let completed: u32 = handles
        .into_iter()
        .map(|handle| {
            handle
                .join()
                .expect("client thread")
                .unwrap_or_else(|error| panic!("connect: {error}"))
        })
        .sum();
    assert_eq!(completed, 1000);
}

fn own_subnet_host_exclusions_and_multicast_are_not_masqueraded(backend: Backend) {
    let host = SimHost::on(
        backend,
        "mq-excl",
        json!({ "ipMasq": true, "ipMasqExclude": ["198.18.0.0/24", "2001:db8:3::/64"] }),
    );
    let _far = host.far_network(1500);
    host.route_outside_to_containers();
    let client = host.container("c1", Value::Null);
    let neighbour = host.container("c2", Value::Null);
    for family in Family::BOTH {
        // Excluded by ipMasqExclude: the far server sees the container itself.
        let far_server = TcpServer::start(&_far, family.any(8080), "far");
        assert_eq!(
            tcp_request(&client.netns, far(family, 8080)).as_deref(),
            Ok("far")
        );
        assert_eq!(
            far_server
                .peers()
                .iter()
                .map(SocketAddr::ip)
                .collect::<Vec<_>>(),
            vec![client.at(family, 0).ip()],
            "{family:?} ipMasqExclude"
        );
        // The own subnet: a neighbour sees the container itself.
        let neighbour_server = TcpServer::start(&neighbour.netns, family.any(8081), "n");
        assert_eq!(
            tcp_request(&client.netns, neighbour.at(family, 8081)).as_deref(),
            Ok("n")
        );
        assert_eq!(
            neighbour_server.peers()[0].ip(),
            client.at(family, 0).ip(),
            "{family:?} own subnet"
        );
        // The host itself: a host process sees the container itself.
        let host_server = TcpServer::start(&host.host, family.any(8082), "h");
        assert_eq!(
            tcp_request(&client.netns, host.uplink(family, 8082)).as_deref(),
            Ok("h")
        );
        assert_eq!(
            host_server.peers()[0].ip(),
            client.at(family, 0).ip(),
            "{family:?} host"
        );
    }
    // Multicast: nothing is tracked or translated for it (the eBPF backend counts what it
    // tracks; nftables leaves multicast to the kernel's conntrack).
    let before = host.masq_stats_if(backend).flows_created;
    for group in ["239.1.2.3", "ff0e::123"] {
        let target: IpAddr = group.parse().expect("literal");
        client.netns.run(move || {
            let socket = std::net::UdpSocket::bind(any_address_for(target, 0)).expect("bind");
            let _ = socket.send_to(b"hello", SocketAddr::new(target, 9999));
        });
    }
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        host.masq_stats_if(backend).flows_created,
        before,
        "multicast was tracked"
    );
    let inspect = host.inspect();
    let excludes = &inspect["attachments"][0]["masquerade"]["excludes"];
    for (destination, reason) in [
        ("10.22.0.0/16", "own subnet"),
        ("fd00:22::/64", "own subnet"),
        ("224.0.0.0/4", "multicast"),
        ("ff00::/8", "multicast"),
        ("198.18.0.0/24", "ipMasqExclude"),
        ("2001:db8:3::/64", "ipMasqExclude"),
    ] {
        assert!(
            excludes
                .as_array()
                .into_iter()
                .flatten()
                .any(|entry| entry["destination"] == destination && entry["reason"] == reason),
            "{destination} ({reason}) missing from {excludes}"
        );
    }
}

fn fragmented_udp_datagrams_are_masqueraded_both_ways(backend: Backend) {
    let host = masquerading(backend, "mq-frag");
    let container = host.container("c1", Value::Null);
    // Both ways larger than the 1500-byte MTU: the container and the server fragment them.
    let greeting = "r".repeat(4000);
    for family in Family::BOTH {
        let udp = UdpServer::start(&host.outside, family.any(5353), &greeting);
        let target = SocketAddr::new(family.outside(), 5353);
        let (answer, from) = container
            .netns
            .run(move || udp_exchange_with(0, target, &[7; 4000], CLIENT_TIMEOUT))
            .unwrap_or_else(|error| panic!("{family:?}: fragmented exchange: {error}"));
        assert_eq!((answer.len(), from), (4000, target), "{family:?}");
        let peers = udp.peers();
        assert!(
            !peers.is_empty() && peers.iter().all(|peer| peer.ip() == uplink_address(family)),
            "{family:?}: the server reassembled {peers:?}, not the uplink address"
        );
    }
}

fn icmp_errors_reach_the_container_translated(backend: Backend) {
    let host = masquerading(backend, "mq-icmp");
    let container = host.container("c1", Value::Null);
    for family in Family::BOTH {
        assert_eq!(
            udp_error(&container.netns, SocketAddr::new(family.outside(), 9)),
            std::io::ErrorKind::ConnectionRefused,
            "{family:?}: port unreachable reaches the container"
        );
    }
    if backend == Backend::Ebpf {
        assert!(host.masq_stats().icmp_errors >= 2);
    }
}

fn path_mtu_discovery_works_through_the_nat(backend: Backend) {
    let host = masquerading(backend, "mq-pmtu");
    let far_network = host.far_network(1280);
    let container = host.container("c1", Value::Null);
    for family in Family::BOTH {
        let _sink = SinkServer::start(&far_network, family.any(9000));
        let bytes = 256 * 1024;
        let received = tcp_upload(
            &container.netns,
            far(family, 9000),
            bytes,
            Duration::from_secs(10),
        )
        .unwrap_or_else(|error| panic!("{family:?} upload through a 1280-byte link: {error}"));
        assert_eq!(received, bytes as u64, "{family:?}");
    }
    if backend == Backend::Ebpf {
        assert!(
            host.masq_stats().icmp_errors >= 2,
            "the too-big errors were translated"
        );
    }
}

#[test]
fn tcp_state_follows_the_connection_and_expired_state_goes_away() {
    let host = masquerading(Backend::Ebpf, "mq-state");
    let container = host.container("c1", Value::Null);
    for family in Family::BOTH {
        let family_code = if family == Family::V4 { 2 } else { 10 };
        let state_towards = |port: u16| {
            host.masq_flows()
                .into_iter()
                .find(|(key, _)| key.dst_port == port && key.family == family_code)
                .unwrap_or_else(|| panic!("{family:?}: no flow to port {port}"))
                .1
                .state
        };
        let target = move |port| SocketAddr::new(family.outside(), port);
        let _closing = TcpServer::start(&host.outside, family.any(8080), "bye");
        let _echo = EchoServer::start(&host.outside, family.any(7000), 2);
        let _udp = UdpServer::start(&host.outside, family.any(5353), "hello");

        // An open connection is established once the remote side answered ...
        let open = container
            .netns
            .run(move || std::net::TcpStream::connect_timeout(&target(7000), CLIENT_TIMEOUT))
            .unwrap_or_else(|error| panic!("{family:?} connect: {error}"));
        assert_eq!(state_towards(7000), STATE_ESTABLISHED, "{family:?}");
        // ... an RST shortens its life ...
        reset_on_close(&open);
        drop(open);
        assert!(
            cnibpf_tests::eventually(Duration::from_secs(2), || state_towards(7000)
                == STATE_CLOSING),
            "{family:?}: a reset connection is closing"
        );
        // ... and so do FINs both ways.
        assert_eq!(
            tcp_request(&container.netns, target(8080)).as_deref(),
            Ok("bye")
        );
        assert!(
            cnibpf_tests::eventually(Duration::from_secs(2), || state_towards(8080)
                == STATE_CLOSING),
            "{family:?}: a closed connection is closing"
        );
        // A UDP flow that was answered is established.
        container
            .netns
            .run(move || udp_exchange_from(41_000, target(5353), CLIENT_TIMEOUT))
            .unwrap_or_else(|error| panic!("{family:?} udp: {error}"));
        assert_eq!(state_towards(5353), STATE_ESTABLISHED, "{family:?}");

        // Age every entry past its timeout: the next packet replaces the state (lazy
        // expiry) ...
        age_flows(&host);
        let expired_before = host.masq_stats().expired;
        container
            .netns
            .run(move || udp_exchange_from(41_000, target(5353), CLIENT_TIMEOUT))
            .unwrap_or_else(|error| panic!("{family:?} udp after expiry: {error}"));
        assert_eq!(host.masq_stats().expired, expired_before + 1, "{family:?}");
        // ... and a GC sweeps every expired entry away, whoever it belongs to.
        age_flows(&host);
        host.chain
            .gc(&[(container.attachment.container_id.as_str(), "eth0")])
            .unwrap_or_else(|error| panic!("GC: {error}"));
        assert_eq!(
            host.masq_flows().len(),
            0,
            "{family:?}: expired flows were swept"
        );
        assert_eq!(
            reply_count(&host),
            0,
            "{family:?}: their reverse entries too"
        );
    }
}

/// Moves every `masq_flows` entry's last-seen time a second past its state's timeout (these
/// are the short timeouts of closed TCP and UDP: the clock started long enough ago).
fn age_flows(host: &SimHost) {
    let mut map = host.pinned_hash_map::<NatFlowKey, MasqFlow>("masq_flows");
    for (key, mut flow) in host.masq_flows() {
        let age = timeout_ns(key.protocol, flow.state) + 1_000_000_000;
        assert!(
            flow.last_seen_ns > age,
            "the monotonic clock started too recently"
        );
        flow.last_seen_ns -= age;
        map.insert(&key, &flow, 0).expect("age flow");
    }
}

fn reply_count(host: &SimHost) -> usize {
    let map = host.pinned_hash_map::<NatFlowKey, MasqReply>("masq_replies");
    map.keys().count()
}

#[test]
fn a_full_table_keeps_live_flows_lets_new_ones_through_and_shows_the_pressure() {
    let host = masquerading(Backend::Ebpf, "mq-full");
    let container = host.container("c1", Value::Null);
    let _tcp = TcpServer::start(&host.outside, Family::V4.any(8080), "hello");
    let _echo = EchoServer::start(&host.outside, Family::V4.any(7000), 1);
    // A connection that lives through the filling.
    let target = SocketAddr::new(Family::V4.outside(), 7000);
    let mut long_lived = container
        .netns
        .run(move || std::net::TcpStream::connect_timeout(&target, CLIENT_TIMEOUT))
        .expect("connect");
    // Fill the table with other flows, as a busy host would.
    let capacity = cnibpf_common::masq_flow::MAX_ENTRIES;
    host.fill_masq_flows(capacity);
    let mut map = host.pinned_hash_map::<NatFlowKey, MasqFlow>("masq_flows");
    // The LRU keeps entries in use, so the live connection survived the filling; evict its
    // state as more pressure eventually would: its next packet rebuilds it (counted), and the
    // connection carries on.
    let live = host
        .masq_flows()
        .into_iter()
        .find(|(key, _)| key.dst_port == 7000)
        .expect("the live connection's state survived the filling")
        .0;
    map.remove(&live)
        .expect("evict the live connection's state");
    {
        use std::io::{Read as _, Write as _};
        let mut byte = [9u8];
        long_lived
            .set_read_timeout(Some(CLIENT_TIMEOUT))
            .expect("timeout");
        long_lived
            .write_all(&byte)
            .expect("write on the long-lived connection");
        long_lived
            .read_exact(&mut byte)
            .expect("answer on the long-lived connection");
        assert_eq!(byte, [9]);
    }
    assert!(host.masq_stats().state_lost >= 1, "state lost is counted");
    for attempt in 0..20 {
        assert_eq!(
            tcp_request(
                &container.netns,
                SocketAddr::new(Family::V4.outside(), 8080)
            )
            .as_deref(),
            Ok("hello"),
            "connection {attempt} through a full table"
        );
    }
    let inspect = host.inspect();
    let counters = &inspect["counters"]["ebpf"];
    // An LRU map keeps some free slots per CPU: "full" is within a percent of capacity.
    let entries = counters["masq_flows entries"].as_u64().unwrap_or(0);
    assert!(
        entries * 100 >= u64::from(capacity) * 99,
        "{entries} of {capacity}: {counters}"
    );
    assert!(counters["flows created"].as_u64() >= Some(20), "{counters}");
}

fn del_gc_and_check_manage_the_masquerade_state(backend: Backend) {
    let host = masquerading(backend, "mq-life");
    let kept = host.container("c1", Value::Null);
    let gone = host.container("c2", Value::Null);
    let _tcp = TcpServer::start(&host.outside, Family::V4.any(8080), "hello");
    for container in [&kept, &gone] {
        assert!(
            tcp_request(
                &container.netns,
                SocketAddr::new(Family::V4.outside(), 8080)
            )
            .is_ok()
        );
    }
    host.check(&kept).expect("CHECK of a complete attachment");
    // CHECK fails when an entry is missing, and ADD repairs it.
    match backend {
        Backend::Ebpf => {
            let mut sources = host.pinned_hash_map::<MasqSourceKey, MasqSource>("masq_sources");
            let key = MasqSourceKey {
                addr: {
                    let mut addr = [0u8; 16];
                    addr[..4].copy_from_slice(&kept.address.octets());
                    addr
                },
                family: 2,
                _pad: [0; 3],
            };
            sources.remove(&key).expect("remove the entry");
        }
        Backend::Nftables => {
            let element = format!("{{ {} }}", kept.address);
            host.host.exec(&[
                "nft", "delete", "element", "inet", "cnibpf", "nat4", &element,
            ]);
        }
    }
    let error = host.check(&kept).expect_err("CHECK must notice");
    assert_eq!(error.0.error_code(), Some(105), "{error}");
    host.chain
        .add_again(&kept.attachment, "cnibpf")
        .expect("re-ADD");
    host.check(&kept).expect("CHECK after repair");

    let owners_with_flows = |host: &SimHost| {
        let mut owners: Vec<u64> = host
            .masq_flows()
            .iter()
            .map(|(_, flow)| flow.owner)
            .collect();
        owners.sort_unstable();
        owners.dedup();
        owners.len()
    };
    if backend == Backend::Ebpf {
        assert_eq!(owners_with_flows(&host), 2);
    }
    // GC with only c1 valid removes c2's masquerade and flows.
    host.chain
        .gc(&[(kept.attachment.container_id.as_str(), "eth0")])
        .expect("GC");
    let inspect = host.inspect();
    assert_eq!(inspect["attachments"].as_array().map(Vec::len), Some(1));
    let masqueraded: Vec<&Value> = inspect["attachments"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|attachment| !attachment["masquerade"].is_null())
        .collect();
    assert_eq!(masqueraded.len(), 1, "{inspect:#}");
    if backend == Backend::Ebpf {
        assert_eq!(owners_with_flows(&host), 1);
    }
    // DEL of the last attachment removes the rest, maps (or the table) included.
    host.del(&kept).expect("DEL");
    assert!(!host.pin_path.join("masq_flows").exists());
    assert!(!host.nft_ruleset().contains("cnibpf"));
    let _ = gone;
}

fn port_mapping_keeps_working_with_masquerade_on(backend: Backend) {
    let host = masquerading(backend, "mq-pm");
    let container = host.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let _outside = TcpServer::start(&host.outside, Family::V4.any(9090), "out");
    for family in Family::BOTH {
        let web = TcpServer::start(&container.netns, family.any(80), "web");
        let target = host.uplink(family, 8080);
        let answer = host
            .outside
            .run(move || tcp_exchange(target, CLIENT_TIMEOUT));
        assert_eq!(
            answer.map(|(answer, _)| answer).as_deref(),
            Ok("web"),
            "{family:?}: outside → hostPort with masquerade on"
        );
        assert_eq!(
            web.peers().iter().map(SocketAddr::ip).collect::<Vec<_>>(),
            vec![family.outside()],
            "{family:?}: the container sees the outside client itself"
        );
    }
    assert_eq!(
        tcp_request(
            &container.netns,
            SocketAddr::new(Family::V4.outside(), 9090)
        )
        .as_deref(),
        Ok("out"),
        "container → outside, masqueraded"
    );
}

fn a_changed_uplink_address_takes_effect_at_the_next_packet(backend: Backend) {
    let host = masquerading(backend, "mq-addr");
    let container = host.container("c1", Value::Null);
    let new_addresses = [
        (Family::V4, "203.0.113.9", "24", "203.0.113.2"),
        (Family::V6, "2001:db8:1::9", "64", "2001:db8:1::2"),
    ];
    host.host
        .sysctl("net.ipv4.conf.all.promote_secondaries", "1");
    host.host
        .sysctl("net.ipv4.conf.up0.promote_secondaries", "1");
    // A running flow, from a fixed port: its next datagram after the change leaves from the
    // new address (eBPF: the FIB's answer no longer matches its translation; nftables: the
    // kernel drops masquerade bindings of a removed address).
    let udp_servers: Vec<UdpServer> = Family::BOTH
        .iter()
        .map(|family| UdpServer::start(&host.outside, family.any(5300 + *family as u16), "hi"))
        .collect();
    let udp_target = |family: Family| SocketAddr::new(family.outside(), 5300 + family as u16);
    let running_flow = |family: Family| {
        let target = udp_target(family);
        container
            .netns
            .run(move || udp_exchange_from(41_000, target, CLIENT_TIMEOUT))
            .map(|(answer, _)| answer)
    };
    for family in Family::BOTH {
        assert_eq!(
            running_flow(family).as_deref(),
            Ok("hi"),
            "{family:?}: the running flow before the change"
        );
    }
    for (family, new, prefix, gateway) in new_addresses {
        let old = uplink_address(family);
        let version = if family == Family::V4 { "-4" } else { "-6" };
        host.host.exec(&[
            "ip",
            version,
            "addr",
            "add",
            &format!("{new}/{prefix}"),
            "dev",
            "up0",
            "nodad",
        ]);
        host.host.exec(&[
            "ip",
            version,
            "addr",
            "del",
            &format!("{old}/{prefix}"),
            "dev",
            "up0",
        ]);
        host.host
            .exec(&["ip", version, "route", "replace", "default", "via", gateway]);
    }
    for ((family, new, _, _), server) in new_addresses.iter().zip(&udp_servers) {
        assert_eq!(
            running_flow(*family).as_deref(),
            Ok("hi"),
            "{family:?}: the running flow after the change"
        );
        let seen: Vec<(String, u16)> = server
            .peers()
            .iter()
            .map(|peer| (peer.ip().to_string(), peer.port()))
            .collect();
        let old = uplink_address(*family).to_string();
        assert_eq!(seen.len(), 2, "{family:?}: {seen:?}");
        assert_eq!(seen[0].0, old, "{family:?}: before, from the old address");
        assert_eq!(
            seen[1].0,
            new.to_string(),
            "{family:?}: then from the new one"
        );
    }
    let servers: Vec<TcpServer> = Family::BOTH
        .iter()
        .map(|family| TcpServer::start(&host.outside, family.any(8080 + *family as u16), "hello"))
        .collect();
    let target = |family: Family| SocketAddr::new(family.outside(), 8080 + family as u16);
    // No plugin run: the next connection leaves from the new address (eBPF: the FIB chooses
    // it per packet; nftables: the kernel's masquerade).
    for ((family, new, _, _), server) in new_addresses.iter().zip(&servers) {
        assert_eq!(
            tcp_request(&container.netns, target(*family)).as_deref(),
            Ok("hello"),
            "{family:?}: at once"
        );
        let seen: Vec<String> = server
            .peers()
            .iter()
            .map(|peer| peer.ip().to_string())
            .collect();
        assert_eq!(seen, [new.to_string()], "{family:?}: from the new address");
    }
    host.check(&container)
        .unwrap_or_else(|error| panic!("CHECK: {error}"));
    let inspect = host.inspect();
    let uplink = &inspect["uplinks"][0];
    assert_eq!(
        (
            uplink["ifname"].as_str(),
            uplink["masqueradeV4"].as_str(),
            uplink["masqueradeV6"].as_str()
        ),
        (Some("up0"), Some("203.0.113.9"), Some("2001:db8:1::9")),
        "inspect shows the addresses CHECK recorded: {inspect}"
    );
    for ((family, new, _, _), server) in new_addresses.iter().zip(&servers) {
        assert_eq!(
            tcp_request(&container.netns, target(*family)).as_deref(),
            Ok("hello"),
            "{family:?} after CHECK"
        );
        let seen: Vec<String> = server
            .peers()
            .iter()
            .map(|peer| peer.ip().to_string())
            .collect();
        assert!(
            !seen.is_empty() && seen.iter().all(|peer| peer == new),
            "{family:?}: {seen:?}"
        );
    }
}

/// As with conntrack's NAT binding: a connection running when an exclusion is added keeps its
/// translation to its end; connections opened after it are not masqueraded. Also where the
/// container's traffic crosses the host stack (`hostFirewall`: masqueraded at the uplink).
fn an_exclusion_added_later_applies_to_new_connections_and_spares_running_ones(backend: Backend) {
    for host_firewall in [false, true] {
        exclusion_added_later(backend, host_firewall);
    }
}

fn exclusion_added_later(backend: Backend, host_firewall: bool) {
    let keys = json!({ "ipMasq": true, "hostFirewall": host_firewall });
    let host = SimHost::on(
        backend,
        &format!("mq-excl{}", u8::from(host_firewall)),
        keys,
    );
    let container = host.container("c1", Value::Null);
    host.route_outside_to_containers();
    let _echo: Vec<StreamEchoServer> = Family::BOTH
        .iter()
        .map(|family| StreamEchoServer::start(&host.outside, family.any(7100 + *family as u16)))
        .collect();
    let servers: Vec<TcpServer> = Family::BOTH
        .iter()
        .map(|family| TcpServer::start(&host.outside, family.any(8100 + *family as u16), "hi"))
        .collect();
    let mut running: Vec<Conversation> = Family::BOTH
        .iter()
        .map(|family| {
            let target = SocketAddr::new(family.outside(), 7100 + *family as u16);
            let mut conversation = Conversation::open(&container.netns, target)
                .unwrap_or_else(|error| panic!("{family:?}: open: {error}"));
            conversation
                .exchange(b"before", CLIENT_TIMEOUT)
                .unwrap_or_else(|error| panic!("{family:?}: before the exclusion: {error}"));
            conversation
        })
        .collect();
    let excluded: Vec<String> = Family::BOTH
        .iter()
        .map(|family| match family.outside() {
            IpAddr::V4(addr) => format!("{addr}/32"),
            IpAddr::V6(addr) => format!("{addr}/128"),
        })
        .collect();
    host.readd_with(
        &container,
        json!({ "ipMasq": true, "hostFirewall": host_firewall, "ipMasqExclude": excluded }),
    )
    .unwrap_or_else(|error| panic!("ADD with the exclusion: {error}"));
    for (family, conversation) in Family::BOTH.iter().zip(&mut running) {
        conversation
            .exchange(b"after", CLIENT_TIMEOUT)
            .unwrap_or_else(|error| {
                panic!("{family:?} (hostFirewall {host_firewall}): the running connection broke: {error}")
            });
    }
    for (family, server) in Family::BOTH.iter().zip(&servers) {
        let target = SocketAddr::new(family.outside(), 8100 + *family as u16);
        assert_eq!(
            tcp_request(&container.netns, target).as_deref(),
            Ok("hi"),
            "{family:?}: a new connection"
        );
        let seen: Vec<IpAddr> = server.peers().iter().map(SocketAddr::ip).collect();
        assert_eq!(
            seen,
            [container.at(*family, 0).ip()],
            "{family:?} (hostFirewall {host_firewall}): a new connection is not masqueraded"
        );
    }
}

fn ip_masq_turned_off_and_on_by_a_new_add_applies_to_the_next_connection(backend: Backend) {
    let host = masquerading(backend, "mq-toggle");
    // Without masquerade the outside answers the container's own address.
    host.route_outside_to_containers();
    let container = host.container("c1", Value::Null);
    let servers: Vec<TcpServer> = Family::BOTH
        .iter()
        .map(|family| TcpServer::start(&host.outside, family.any(8090 + *family as u16), "hi"))
        .collect();
    for (round, ip_masq) in [true, false, true].into_iter().enumerate() {
        if round > 0 {
            host.readd_with(&container, json!({ "ipMasq": ip_masq }))
                .unwrap_or_else(|error| panic!("ADD with ipMasq {ip_masq}: {error}"));
        }
        for (family, server) in Family::BOTH.iter().zip(&servers) {
            let target = SocketAddr::new(family.outside(), 8090 + *family as u16);
            assert_eq!(
                tcp_request(&container.netns, target).as_deref(),
                Ok("hi"),
                "{family:?}, ipMasq {ip_masq}"
            );
            let expected = if ip_masq {
                uplink_address(*family)
            } else {
                container.at(*family, 0).ip()
            };
            assert_eq!(
                server.peers().last().map(SocketAddr::ip),
                Some(expected),
                "{family:?}: a new connection with ipMasq {ip_masq} (round {round})"
            );
        }
    }
}

/// The uplink's MTU below the container's: small datagrams are sent straight out (their
/// answer keeps the interface's MTU for the flow's later packets), a larger one from the same
/// socket right after them is left to the host stack, which fragments it (`uplink_egress`
/// masquerades the fragments). Sent straight out, it would be dropped by the uplink.
fn a_datagram_too_big_for_the_uplink_goes_through_the_stack_between_small_ones(backend: Backend) {
    const PAIRS: usize = 5;
    const BIG: usize = 1400;
    let host = masquerading(backend, "mq-mtu");
    let container = host.container("c1", Value::Null);
    host.host
        .exec(&["ip", "link", "set", UPLINK, "mtu", "1280"]);
    host.outside
        .exec(&["ip", "link", "set", "eth0", "mtu", "1280"]);
    let target = SocketAddr::new(Family::V4.outside(), 5400);
    let server = host.outside.run(move || {
        std::net::UdpSocket::bind(target).unwrap_or_else(|error| panic!("bind {target}: {error}"))
    });
    server
        .set_read_timeout(Some(CLIENT_TIMEOUT))
        .expect("read timeout");
    container.netns.run(move || {
        let socket = std::net::UdpSocket::bind("0.0.0.0:0").expect("bind the client");
        // No DF bit: a router (here the host) may fragment it.
        let dont = libc::IP_PMTUDISC_DONT;
        // SAFETY: setsockopt reads an int option from a live local, on a socket we own.
        let set = unsafe {
            libc::setsockopt(
                std::os::fd::AsRawFd::as_raw_fd(&socket),
                libc::IPPROTO_IP,
                libc::IP_MTU_DISCOVER,
                (&raw const dont).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(
            set,
            0,
            "IP_MTU_DISCOVER: {}",
            std::io::Error::last_os_error()
        );
        for _ in 0..PAIRS {
            socket
                .send_to(&[1; 64], target)
                .expect("send a small datagram");
            socket
                .send_to(&[2; BIG], target)
                .expect("send a big datagram");
        }
    });
    let mut sizes = Vec::new();
    let mut buffer = [0u8; 2048];
    while sizes.len() < 2 * PAIRS {
        match uninterrupted(|| server.recv_from(&mut buffer)) {
            Ok((size, from)) => {
                assert_eq!(from.ip(), uplink_address(Family::V4), "masqueraded");
                sizes.push(size);
            }
            Err(error) => panic!("after {sizes:?}: {error}"),
        }
    }
    assert_eq!(
        sizes.iter().filter(|size| **size == BIG).count(),
        PAIRS,
        "every big datagram arrived whole: {sizes:?}"
    );
}

for_both_backends!(
    tcp_udp_and_ping_reach_an_outside_without_a_route_back_as_the_uplink,
    a_datagram_too_big_for_the_uplink_goes_through_the_stack_between_small_ones,
    ip_masq_turned_off_and_on_by_a_new_add_applies_to_the_next_connection,
    an_exclusion_added_later_applies_to_new_connections_and_spares_running_ones,
    source_ports_are_kept_when_free_and_a_collision_picks_another,
    a_port_a_host_socket_holds_is_not_taken_for_a_container,
    a_host_port_added_later_does_not_take_a_masqueraded_flows_replies,
    a_thousand_concurrent_flows_from_eight_containers_all_complete,
    own_subnet_host_exclusions_and_multicast_are_not_masqueraded,
    fragmented_udp_datagrams_are_masqueraded_both_ways,
    icmp_errors_reach_the_container_translated,
    path_mtu_discovery_works_through_the_nat,
    del_gc_and_check_manage_the_masquerade_state,
    port_mapping_keeps_working_with_masquerade_on,
    a_changed_uplink_address_takes_effect_at_the_next_packet,
);
