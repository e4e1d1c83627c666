//! Host processes reach hostPorts through the socket hooks: by 127.0.0.1, ::1, an uplink
//! address or the bridge gateway, TCP and UDP, seeing the address they asked for.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use cnibpf_tests::{
    SimHost, for_both_backends,
    topology::{Backend, Family, GATEWAY, GATEWAY6, port_mappings},
    traffic::{TcpServer, UdpServer},
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
            // Loopback needs the socket hooks: nftables does not translate it (README).
            if backend == Backend::Nftables && address.is_loopback() {
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

for_both_backends!(host_processes_reach_host_ports_by_every_local_address);
