//! Host processes reach hostPorts through the socket hooks: by 127.0.0.1, ::1, an uplink
//! address or the bridge gateway, TCP and UDP, seeing the address they asked for.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use cnibpf_tests::{
    SimHost, for_both_backends,
    topology::{BRIDGE, Backend, Family, GATEWAY, GATEWAY6, port_mappings},
    traffic::{TcpServer, UdpServer, tcp_request, udp_request},
};
use serde_json::json;

fn host_processes_reach_host_ports_by_every_local_address(backend: Backend) {
    let sim = SimHost::on(backend, "ha-local", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp"), (5353, 53, "udp")]));
    for family in Family::BOTH {
        let web = TcpServer::start(&c1.netns, c1.at(family, 80), "c1 web");
        let _dns = UdpServer::start(&c1.netns, c1.at(family, 53), "c1 dns");
        let addresses: [IpAddr; 3] = match family {
            Family::V4 => [
                Ipv4Addr::LOCALHOST.into(),
                sim.uplink(family, 0).ip(),
                GATEWAY.into(),
            ],
            Family::V6 => [
                Ipv6Addr::LOCALHOST.into(),
                sim.uplink(family, 0).ip(),
                GATEWAY6.into(),
            ],
        };
        for address in addresses {
            let target = SocketAddr::new(address, 8080);
            // [::1] needs the socket hooks: nftables cannot translate it (docs/datapath.md); 127.0.0.1 it
            // does, as the reference portmap.
            if backend == Backend::Nftables && address.is_ipv6() && address.is_loopback() {
                let outcome = sim.host_client("tcp", target);
                assert!(
                    outcome.is_err(),
                    "nftables: {target} is not translated: {outcome:?}"
                );
                continue;
            }
            let (answer, peer) = sim
                .host_client("tcp", target)
                .unwrap_or_else(|error| panic!("host process -> {target}: {error}"));
            assert_eq!(answer, "c1 web", "host process -> {target}");
            assert_eq!(
                peer, target,
                "getpeername shows the address the application asked for"
            );

            let target = SocketAddr::new(address, 5353);
            let (answer, from) = sim
                .host_client("udp", target)
                .unwrap_or_else(|error| panic!("host process -> udp {target}: {error}"));
            assert_eq!(
                (answer.as_str(), from),
                ("c1 dns", target),
                "UDP answers come from the address asked"
            );
        }
        if backend == Backend::Nftables && family == Family::V6 {
            let inspect = sim.inspect();
            let notes = inspect["attachments"][0]["notes"].to_string();
            assert!(
                notes.contains("[::1]:8080/tcp"),
                "inspect says [::1] is out of reach: {inspect}"
            );
        }
        assert!(
            web.peers()
                .iter()
                .all(|peer| peer.ip() != c1.at(family, 0).ip()),
            "the container sees the host, not itself: {:?}",
            web.peers()
        );
    }
}

#[test]
fn a_process_in_another_namespace_keeps_its_own_loopback() {
    let sim = SimHost::new("ha-netns", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let _container_web = TcpServer::start(&c1.netns, c1.at(Family::V4, 80), "container");
    let _own = TcpServer::start(
        &sim.outside,
        "127.0.0.1:8080".parse().expect("literal"),
        "outside's own",
    );
    // Same cgroup as the host processes, other network namespace: not translated.
    let (answer, _) = sim
        .client_in(
            &sim.outside,
            "tcp",
            "127.0.0.1:8080".parse().expect("literal"),
        )
        .unwrap_or_else(|error| panic!("outside -> its own 127.0.0.1:8080: {error}"));
    assert_eq!(answer, "outside's own");
    // The same request from the host namespace is translated.
    let (answer, _) = sim
        .host_client("tcp", "127.0.0.1:8080".parse().expect("literal"))
        .unwrap_or_else(|error| panic!("host -> 127.0.0.1:8080: {error}"));
    assert_eq!(answer, "container");
}

/// CVE-2020-8558: with `route_localnet` on the bridge (nftables turns it on for 127.0.0.1
/// hostPorts, as the reference portmap), a neighbour that routes 127.0.0.0/8 to the host
/// would reach services bound to the host's loopback. Packets to 127.0.0.0/8 that arrive from
/// outside the host are dropped, as kube-proxy drops them.
fn containers_never_reach_the_hosts_loopback(backend: Backend) {
    let sim = SimHost::on(backend, "ha-cve", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let _web = TcpServer::start(&c1.netns, c1.at(Family::V4, 80), "c1 web");
    let private: SocketAddr = "127.0.0.1:9999".parse().expect("literal");
    let _private = TcpServer::start(&sim.host, private, "the host's loopback");
    let _private_udp = UdpServer::start(&sim.host, private, "the host's loopback");
    // The host reaches the hostPort by 127.0.0.1: the bridge now carries loopback sources.
    let (answer, _) = sim
        .host_client("tcp", "127.0.0.1:8080".parse().expect("literal"))
        .unwrap_or_else(|error| panic!("host -> 127.0.0.1:8080: {error}"));
    assert_eq!(answer, "c1 web");
    // The attacker: a neighbour that sends 127.0.0.1 to the host instead of its own loopback.
    let attacker = sim.container("c2", json!({}));
    attacker
        .netns
        .exec(&["sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1"]);
    attacker
        .netns
        .exec(&["sysctl", "-qw", "net.ipv4.conf.eth0.route_localnet=1"]);
    // Its own loopback goes, so 127.0.0.1 is routed to the host.
    attacker
        .netns
        .exec(&["ip", "address", "del", "127.0.0.1/8", "dev", "lo"]);
    attacker.netns.exec(&[
        "ip",
        "route",
        "add",
        "127.0.0.1/32",
        "via",
        &GATEWAY.to_string(),
        "dev",
        "eth0",
    ]);
    let outcome = tcp_request(&attacker.netns, private);
    assert!(
        outcome.is_err(),
        "{backend:?}: a container reached a service on the host's loopback: {outcome:?}"
    );
    let outcome = udp_request(&attacker.netns, private);
    assert!(outcome.is_err(), "{backend:?}: nor by UDP: {outcome:?}");
    if backend == Backend::Nftables {
        // A packet without a conntrack entry walks no NAT chain, where the guard meets a
        // connection's first packet: the host's firewall exempting the loopback from
        // conntrack (`notrack`) opens no way in.
        sim.host.exec(&[
            "nft",
            "add table ip ha_notrack; \
             add chain ip ha_notrack raw { type filter hook prerouting priority raw; }; \
             add rule ip ha_notrack raw ip daddr 127.0.0.0/8 notrack",
        ]);
        let outcome = tcp_request(&attacker.netns, private);
        assert!(outcome.is_err(), "untracked, by TCP: {outcome:?}");
        let outcome = udp_request(&attacker.netns, private);
        assert!(outcome.is_err(), "untracked, by UDP: {outcome:?}");
        sim.host.exec(&["nft", "delete table ip ha_notrack"]);
        // The host's own redirect to a service on its loopback (a local resolver) is the
        // host's to make: the guard judges a packet by the destination it had on the wire.
        sim.host.exec(&[
            "nft",
            "add table ip ha_redirect; \
             add chain ip ha_redirect pre { type nat hook prerouting priority dstnat; }; \
             add rule ip ha_redirect pre udp dport 5353 dnat to 127.0.0.1:5353",
        ]);
        let resolver: SocketAddr = "127.0.0.1:5353".parse().expect("literal");
        let _resolver = UdpServer::start(&sim.host, resolver, "the host's resolver");
        let answer =
            udp_request(&c1.netns, SocketAddr::new(GATEWAY.into(), 5353)).map(|(answer, _)| answer);
        assert_eq!(
            answer.as_deref(),
            Ok("the host's resolver"),
            "a container redirected to the host's loopback by the host's own rule"
        );
        sim.host.exec(&["nft", "delete table ip ha_redirect"]);
        // The exposure is real: route_localnet is on, and without the guard the attack works.
        assert_eq!(
            sim.host
                .exec(&[
                    "sysctl",
                    "-n",
                    &format!("net.ipv4.conf.{BRIDGE}.route_localnet")
                ])
                .trim(),
            "1"
        );
        sim.host
            .exec(&["nft", "flush", "chain", "inet", "cnibpf", "localnet_guard"]);
        assert_eq!(
            tcp_request(&attacker.netns, private).as_deref(),
            Ok("the host's loopback"),
            "without the guard the attack would work (the test's attack is real)"
        );
    }
}

for_both_backends!(
    host_processes_reach_host_ports_by_every_local_address,
    containers_never_reach_the_hosts_loopback
);
