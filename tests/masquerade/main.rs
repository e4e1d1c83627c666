//! Masquerade (`ipMasq`): container traffic leaving through the uplink carries the uplink's
//! address, and the outside namespace has no route back to the containers.

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use cnibpf_common::{
    address::Address,
    connections::{
        Connection, ConnectionKey,
        conntrack::{STATE_CLOSING, STATE_ESTABLISHED, timeout_ns},
    },
    masquerade::{MasqReply, MasqSource, MasqSourceKey, ReplyKey},
};
use cnibpf_tests::{
    Container, SimHost, eventually, for_both_backends,
    packet::{
        ACK, ETH_P_IP, ETH_P_IPV6, FIN, ICMP, ICMPV6, RST, SYN, TCP, UDP, ethernet, icmp, icmpv6,
        ipv4, ipv6, tcp, udp,
    },
    topology::{
        BRIDGE, Backend, FAR_ADDR, FAR_ADDR6, Family, HOST_UPLINK_ADDR, HOST_UPLINK_ADDR6,
        OUTSIDE_ADDR, OUTSIDE_ADDR6, UPLINK, port_mappings,
    },
    traffic::{
        CLIENT_TIMEOUT, Conversation, EchoServer, SinkServer, Sniffer, StreamEchoServer, TcpServer,
        UdpServer, any_address_for, ping, reset_on_close, send_frame, tcp_exchange, tcp_request,
        tcp_upload, udp_error, udp_exchange_from, udp_exchange_with, udp_request, uninterrupted,
    },
};
use serde_json::{Value, json};

mod changes;
mod packets;
mod ports;
mod state;

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
            .masqueraded()
            .iter()
            .filter(|(key, _)| key.protocol == 1 || key.protocol == 58)
            .count();
        assert_eq!(icmp_flows, 2, "one tracked echo flow per family");
    }
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

for_both_backends!(
    tcp_udp_and_ping_reach_an_outside_without_a_route_back_as_the_uplink,
    own_subnet_host_exclusions_and_multicast_are_not_masqueraded,
);
