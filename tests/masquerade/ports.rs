//! The masquerade port of a flow: its own when free, another on a collision, never one a
//! host socket or a hostPort holds; many concurrent flows; port mapping beside masquerade.

use super::*;

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

/// The address as the datapath's maps hold it.
fn map_address(addr: IpAddr) -> Address {
    match addr {
        IpAddr::V4(addr) => Address::ipv4(addr.octets()),
        IpAddr::V6(addr) => Address::from_bytes(addr.octets()),
    }
}

/// CLOCK_MONOTONIC's second plus one, as the datapath stamps a claim.
fn claim_clock() -> u32 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .unwrap_or_else(|error| panic!("CLOCK_MONOTONIC: {error}"));
    u32::try_from(now.tv_sec()).expect("seconds since boot") + 1
}

/// Two containers' first packets from one source port towards one server masqueraded at the
/// same moment on two CPUs: the one that claims the reply tuple second finds the first one's
/// claim before the first flow's connection state is written. A claim that fresh holds its
/// port (the second flow moves to another), an old one without state is taken over. The
/// claim of the other CPU is put in `masq_replies` by hand, without its connection state.
#[test]
fn a_claim_made_a_moment_ago_holds_its_port_before_its_flows_state_is_written() {
    let host = masquerading(Backend::Ebpf, "mq-fresh");
    let container = host.container("c1", Value::Null);
    for family in Family::BOTH {
        let udp = UdpServer::start(&host.outside, family.any(5353), "hello");
        let target = SocketAddr::new(family.outside(), 5353);
        let mut replies = host.pinned_hash_map::<ReplyKey, MasqReply>("masq_replies");
        let claim = |port: u16, claimed_at: u32| {
            let key = ReplyKey {
                src_addr: map_address(family.outside()),
                dst_addr: map_address(uplink_address(family)),
                src_port: 5353,
                dst_port: port,
                protocol: cnibpf_common::PROTO_UDP,
                family: match family {
                    Family::V4 => cnibpf_common::FAMILY_IPV4,
                    Family::V6 => cnibpf_common::FAMILY_IPV6,
                },
                _pad: 0,
            };
            let value = MasqReply {
                container_addr: map_address(far(family, 0).ip()),
                owner: 0x5eed,
                host_ifindex: 1,
                container_port: port,
                claimed_at,
                ..MasqReply::default()
            };
            (key, value)
        };
        let (fresh_key, fresh) = claim(41_000, claim_clock());
        replies
            .insert(&fresh_key, &fresh, 0)
            .expect("a fresh claim");
        let (old_key, old) = claim(41_001, 1);
        replies.insert(&old_key, &old, 0).expect("an old claim");
        for source_port in [41_000, 41_001] {
            let (answer, _) = container
                .netns
                .run(move || udp_exchange_from(source_port, target, CLIENT_TIMEOUT))
                .unwrap_or_else(|error| panic!("{family:?} from port {source_port}: {error}"));
            assert_eq!(answer, "hello");
        }
        let ports: Vec<u16> = udp.peers().iter().map(SocketAddr::port).collect();
        assert_eq!(ports.len(), 2, "{family:?}: {ports:?}");
        assert_ne!(
            ports[0], 41_000,
            "{family:?}: the fresh claim holds its port"
        );
        assert_eq!(
            ports[1], 41_001,
            "{family:?}: the old claim without state is taken over"
        );
        assert_eq!(
            replies.get(&fresh_key, 0).expect("the fresh claim").owner,
            0x5eed,
            "{family:?}: the fresh claim is still its flow's"
        );
    }
}

for_both_backends!(
    source_ports_are_kept_when_free_and_a_collision_picks_another,
    a_port_a_host_socket_holds_is_not_taken_for_a_container,
    a_host_port_added_later_does_not_take_a_masqueraded_flows_replies,
    a_thousand_concurrent_flows_from_eight_containers_all_complete,
    port_mapping_keeps_working_with_masquerade_on,
);
