//! Every path a user reaches a hostPort by, IPv4 and IPv6: from outside through an uplink,
//! hairpin from containers, many containers, owner changes.

use std::{
    net::{SocketAddr, UdpSocket},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use cnibpf_tests::{
    SimHost, for_both_backends,
    topology::{
        BRIDGE, Backend, Family, GATEWAY, GATEWAY6, UPLINK, bridge_netfilter, port_mappings,
    },
    traffic::{
        CLIENT_TIMEOUT, TcpServer, UdpServer, kernel_has_sctp, tcp_request, udp_error,
        udp_exchange_with, udp_request, uninterrupted,
    },
};
use serde_json::json;

fn outside_clients_reach_tcp_and_udp_host_ports_over_both_families(backend: Backend) {
    let sim = SimHost::on(backend, "hp-outside", json!({}));
    let c1 = sim.container(
        "c1",
        port_mappings(&[(8080, 80, "tcp"), (8443, 443, "tcp"), (5353, 53, "udp")]),
    );
    for family in Family::BOTH {
        let web = TcpServer::start(&c1.netns, c1.at(family, 80), "web");
        let tls = TcpServer::start(&c1.netns, c1.at(family, 443), "tls");
        let dns = UdpServer::start(&c1.netns, c1.at(family, 53), "dns");

        for (port, expected) in [(8080, "web"), (8443, "tls")] {
            let answer = tcp_request(&sim.outside, sim.uplink(family, port));
            assert_eq!(
                answer.as_deref(),
                Ok(expected),
                "{family:?} TCP via hostPort {port}"
            );
        }
        let (answer, from) = udp_request(&sim.outside, sim.uplink(family, 5353))
            .unwrap_or_else(|error| panic!("{family:?} UDP via hostPort 5353: {error}"));
        assert_eq!(answer, "dns");
        assert_eq!(
            from,
            sim.uplink(family, 5353),
            "{family:?}: the reply comes from the hostPort"
        );
        for server_peers in [web.peers(), tls.peers(), dns.peers()] {
            assert!(
                server_peers
                    .iter()
                    .all(|peer| peer.ip() == family.outside()),
                "{family:?}: the container must see the client's own address, saw {server_peers:?}"
            );
            assert_eq!(server_peers.len(), 1);
        }
    }
}

fn an_ipv6_host_ip_restricts_the_mapping_to_ipv6(backend: Backend) {
    let sim = SimHost::on(backend, "hp-hostip6", json!({}));
    let mapping = json!({ "portMappings": [{ "hostPort": 8080, "containerPort": 80, "hostIP": "2001:db8:1::1" }] });
    let c1 = sim.container("c1", mapping);
    let _v6 = TcpServer::start(&c1.netns, c1.at(Family::V6, 80), "c1 over v6");
    let _v4 = TcpServer::start(&c1.netns, c1.at(Family::V4, 80), "c1 over v4");
    assert_eq!(
        tcp_request(&sim.outside, sim.uplink(Family::V6, 8080)).as_deref(),
        Ok("c1 over v6")
    );
    let v4 = tcp_request(&sim.outside, sim.uplink(Family::V4, 8080));
    assert!(v4.is_err(), "the IPv6 hostIP must not open IPv4: {v4:?}");
}

fn sctp_mappings_are_installed(backend: Backend) {
    let sim = SimHost::on(backend, "hp-sctp", json!({}));
    let _c1 = sim.container(
        "c1",
        port_mappings(&[(9999, 9999, "sctp"), (9132, 132, "sctp")]),
    );
    let inspect = sim.inspect();
    let mappings = &inspect["attachments"][0]["portMappings"];
    assert_eq!(
        mappings.as_array().map(Vec::len),
        Some(4),
        "each SCTP mapping once per family: {mappings}"
    );
    assert!(
        mappings
            .as_array()
            .into_iter()
            .flatten()
            .all(|mapping| mapping["protocol"] == "sctp")
    );
}

/// SCTP associations through hostPorts, the second to another container port (the datapath
/// updates SCTP's CRC32c for it): needs a kernel with SCTP.
fn sctp_carries_traffic_through_host_ports(backend: Backend) {
    if !kernel_has_sctp() {
        cnibpf_tests::skip("this kernel has no SCTP");
        return;
    }
    let sim = SimHost::on(backend, "hp-sctpt", json!({}));
    let c1 = sim.container(
        "c1",
        port_mappings(&[(9999, 9999, "sctp"), (9132, 132, "sctp")]),
    );
    for (host_port, container_port) in [(9999, 9999), (9132, 132)] {
        let answer = cnibpf_tests::traffic::sctp_request(
            &sim.outside,
            &c1.netns,
            sim.uplink(Family::V4, host_port),
            c1.at(Family::V4, container_port),
        );
        assert_eq!(
            answer.as_deref(),
            Ok("sctp"),
            "SCTP through hostPort {host_port}"
        );
    }
}

/// Datagrams larger than the MTU, both ways: the outside client's fragments reach the
/// container behind the hostPort (the first carries the ports, the later ones follow it), and
/// the container's fragmented answer comes back from the hostPort.
fn fragmented_datagrams_reach_a_host_port_and_come_back(backend: Backend) {
    let sim = SimHost::on(backend, "hp-frag", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(5353, 53, "udp")]));
    let answer = "a".repeat(4000);
    for family in Family::BOTH {
        let _server = UdpServer::start(&c1.netns, family.any(53), &answer);
        let target = sim.uplink(family, 5353);
        let (received, from) = sim
            .outside
            .run(move || udp_exchange_with(0, target, &[7; 4000], CLIENT_TIMEOUT))
            .unwrap_or_else(|error| panic!("{family:?}: fragmented exchange: {error}"));
        assert_eq!(
            (received.len(), from),
            (4000, target),
            "{family:?}: the whole answer, from the hostPort"
        );
    }
}

fn hairpin_reaches_the_container_itself_and_its_neighbour_without_netfilter_help(backend: Backend) {
    let sim = SimHost::on(backend, "hp-hairpin", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp"), (5353, 53, "udp")]));
    let c2 = sim.container("c2", port_mappings(&[(8081, 80, "tcp")]));
    // None of the crutches the reference portmap needs for hairpin (but the run's own
    // br_netfilter, a Kubernetes node's, when it has it on).
    if !bridge_netfilter() {
        assert_eq!(
            sim.host
                .exec(&["sysctl", "-n", "net.bridge.bridge-nf-call-iptables"])
                .trim(),
            "0"
        );
    }
    assert_eq!(
        sim.host
            .exec(&["sysctl", "-n", "net.ipv4.conf.all.route_localnet"])
            .trim(),
        "0"
    );
    assert!(
        !sim.host
            .exec(&["ip", "link", "show", BRIDGE])
            .contains("PROMISC")
    );

    for family in Family::BOTH {
        let s1 = TcpServer::start(&c1.netns, c1.at(family, 80), "c1");
        let _s2 = TcpServer::start(&c2.netns, c2.at(family, 80), "c2");
        let _dns = UdpServer::start(&c1.netns, c1.at(family, 53), "dns c1");
        let gateway = match family {
            Family::V4 => SocketAddr::from((GATEWAY, 0)),
            Family::V6 => SocketAddr::from((GATEWAY6, 0)),
        };
        for host_address in [sim.uplink(family, 0), gateway] {
            let at = |port| SocketAddr::new(host_address.ip(), port);
            assert_eq!(
                tcp_request(&c1.netns, at(8080)).as_deref(),
                Ok("c1"),
                "{family:?} c1 -> itself via {}",
                at(8080)
            );
            assert_eq!(
                tcp_request(&c1.netns, at(8081)).as_deref(),
                Ok("c2"),
                "{family:?} c1 -> neighbour via {}",
                at(8081)
            );
            assert_eq!(
                tcp_request(&c2.netns, at(8080)).as_deref(),
                Ok("c1"),
                "{family:?} c2 -> neighbour via {}",
                at(8080)
            );
            let (answer, from) = udp_request(&c1.netns, at(5353)).unwrap_or_else(|error| {
                panic!("{family:?} UDP hairpin to itself via {}: {error}", at(5353))
            });
            assert_eq!(
                (answer.as_str(), from),
                ("dns c1", at(5353)),
                "{family:?} UDP hairpin answers from the hostPort"
            );
        }
        let own = c1.at(family, 0).ip();
        // The eBPF datapath hands the reply back itself; nftables masquerades hairpin traffic
        // to the gateway, so that the reply returns through the host (see docs/datapath.md).
        let neighbour = match (backend, family) {
            (Backend::Ebpf, _) => c2.at(family, 0).ip(),
            (Backend::Nftables, Family::V4) => GATEWAY.into(),
            (Backend::Nftables, Family::V6) => GATEWAY6.into(),
        };
        assert!(
            s1.peers().iter().any(|peer| peer.ip() == neighbour),
            "{family:?}: the neighbour's connection arrives from {neighbour}: {:?}",
            s1.peers()
        );
        assert!(
            s1.peers().iter().all(|peer| peer.ip() != own),
            "{family:?}: a container never sees a connection from its own address"
        );
    }
}

fn fifty_containers_with_distinct_mappings_are_all_reachable(backend: Backend) {
    let sim = SimHost::on(backend, "hp-fifty", json!({}));
    let containers: Vec<_> = (0..50u16)
        .map(|n| sim.container(&format!("c{n}"), port_mappings(&[(10_000 + n, 80, "tcp")])))
        .collect();
    let _servers: Vec<_> = containers
        .iter()
        .map(|c| TcpServer::start(&c.netns, Family::V6.any(80), &c.attachment.container_id))
        .collect();
    for family in Family::BOTH {
        for (n, container) in (0..50u16).zip(&containers) {
            let answer = tcp_request(&sim.outside, sim.uplink(family, 10_000 + n));
            assert_eq!(
                answer.as_deref(),
                Ok(container.attachment.container_id.as_str()),
                "{family:?} hostPort {}",
                10_000 + n
            );
        }
    }
}

/// Sends a datagram from one fixed source port every 20 ms until dropped.
struct SteadyUdpClient {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SteadyUdpClient {
    fn start(sim: &SimHost, family: Family, target: SocketAddr) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = Arc::clone(&stop);
            sim.outside.spawn(move || {
                let socket =
                    UdpSocket::bind(family.any(40_000)).expect("bind the fixed client port");
                while !stop.load(Ordering::Relaxed) {
                    let _ = socket.send_to(b"ping", target);
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        };
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for SteadyUdpClient {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn a_host_port_that_changes_owner_reaches_the_new_container_within_a_second(backend: Backend) {
    let sim = SimHost::on(backend, "hp-owner", json!({}));
    for family in Family::BOTH {
        let a = sim.container(
            &format!("a{family:?}"),
            port_mappings(&[(5353, 53, "udp"), (8080, 80, "tcp")]),
        );
        let server_a = UdpServer::start(&a.netns, a.at(family, 53), "a");
        let _web_a = TcpServer::start(&a.netns, a.at(family, 80), "a");
        let client = SteadyUdpClient::start(&sim, family, sim.uplink(family, 5353));
        let deadline = Instant::now() + Duration::from_secs(2);
        while server_a.peers().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            !server_a.peers().is_empty(),
            "{family:?}: A receives the client first"
        );
        assert_eq!(
            tcp_request(&sim.outside, sim.uplink(family, 8080)).as_deref(),
            Ok("a")
        );

        sim.del(&a)
            .unwrap_or_else(|error| panic!("DEL of A: {error}"));
        drop(server_a);
        let b = sim.container(
            &format!("b{family:?}"),
            port_mappings(&[(5353, 53, "udp"), (8080, 80, "tcp")]),
        );
        let server_b = UdpServer::start(&b.netns, b.at(family, 53), "b");
        let _web_b = TcpServer::start(&b.netns, b.at(family, 80), "b");
        let added = Instant::now();
        while server_b.peers().is_empty() && added.elapsed() < Duration::from_secs(3) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let waited = added.elapsed();
        assert!(
            !server_b.peers().is_empty(),
            "{family:?}: B never received the steady client"
        );
        assert!(
            waited < Duration::from_secs(1),
            "{family:?}: B received the client only after {waited:?}"
        );
        assert_eq!(
            server_b.peers()[0].port(),
            40_000,
            "the same client, same source port"
        );
        assert_eq!(
            tcp_request(&sim.outside, sim.uplink(family, 8080)).as_deref(),
            Ok("b"),
            "{family:?}: a reconnecting TCP client reaches B"
        );
        drop(client);
        sim.del(&b)
            .unwrap_or_else(|error| panic!("DEL of B: {error}"));
    }
}

fn a_client_that_switches_from_the_host_port_to_the_container_address_is_not_rewritten(
    backend: Backend,
) {
    let sim = SimHost::on(backend, "hp-stale", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(5353, 53, "udp")]));
    let _dns = UdpServer::start(&c1.netns, c1.at(Family::V4, 53), "dns");
    sim.route_outside_to_containers();
    let (hostport, direct) = (sim.uplink(Family::V4, 5353), c1.at(Family::V4, 53));
    let answers = sim.outside.run(move || {
        let socket = UdpSocket::bind("0.0.0.0:41000").expect("bind the fixed client port");
        socket
            .set_read_timeout(Some(Duration::from_secs(2)))
            .expect("timeout");
        let mut buffer = [0u8; 64];
        let mut ask = |target| {
            socket.send_to(b"ping", target).expect("send");
            uninterrupted(|| socket.recv_from(&mut buffer))
                .map(|(_, from)| from)
                .map_err(|error| error.to_string())
        };
        (ask(hostport), ask(direct))
    });
    assert_eq!(
        answers.0,
        Ok(hostport),
        "through the hostPort the answer comes from the hostPort"
    );
    assert_eq!(
        answers.1,
        Ok(direct),
        "the same client port talking to the container directly must get the container's own answer"
    );
}

/// A second address added to the uplink after the ADD serves wildcard hostPorts to what
/// comes in by the uplink: on nftables from its first packet (the kernel says the address is
/// the incoming interface's, `fib daddr . iif type local`); on eBPF, where the FIB names no
/// interface of a local address, at once only if it is the address the host answers the
/// client from (IPv6's source selection may choose the new one; IPv4 answers from the
/// interface's first address: a re-addressed uplink's is the new one, `kubernetes` suite), and
/// else once cnibpf recorded it as the node's — at the next CNI call (here a CHECK), or at
/// once with `install --watch` (`host_firewall`'s suite). Until then it is a local address
/// that could as well be a Service's, and is left to the host.
fn an_address_added_to_the_uplink_serves_wildcard_host_ports(backend: Backend) {
    let sim = SimHost::on(backend, "hp-newaddr", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let added = [
        (Family::V4, "203.0.113.77", "24"),
        (Family::V6, "2001:db8:1::77", "64"),
    ];
    for (family, address, prefix) in added {
        let _web = TcpServer::start(&c1.netns, c1.at(family, 80), "web");
        let version = if family == Family::V4 { "-4" } else { "-6" };
        sim.host.exec(&[
            "ip",
            version,
            "addr",
            "add",
            &format!("{address}/{prefix}"),
            "dev",
            UPLINK,
            "nodad",
        ]);
        let target = SocketAddr::new(address.parse().expect("literal"), 8080);
        let before = tcp_request(&sim.outside, target);
        match (backend, family) {
            (Backend::Nftables, _) => assert_eq!(
                before.as_deref(),
                Ok("web"),
                "{family:?}: {address} serves at once: it is the uplink's"
            ),
            (Backend::Ebpf, Family::V4) => assert!(
                before.is_err(),
                "{family:?}: {address} is not the node's before it is recorded: {before:?}"
            ),
            // Whichever address the kernel's source selection prefers for the client.
            (Backend::Ebpf, Family::V6) => {}
        }
        sim.check(&c1)
            .unwrap_or_else(|error| panic!("CHECK records the new address: {error}"));
        assert_eq!(
            tcp_request(&sim.outside, target).as_deref(),
            Ok("web"),
            "{family:?}: the new address {address} serves hostPort 8080 once recorded"
        );
    }
}

/// kube-proxy's IPVS mode binds every ClusterIP to `kube-ipvs0` (left down), which makes it a
/// local address of the node: a wildcard hostPort must leave those to the Services (CNI#577,
/// kubeadm#985), from outside, from host processes and from other pods, whether the Service
/// came before the pod or after it, while the node's own address reaches the pod. An explicit
/// hostIP naming a Service address is the operator's choice and takes it.
fn a_wildcard_host_port_leaves_service_addresses_to_the_services(backend: Backend) {
    let sim = SimHost::on(backend, "hp-vip", json!({}));
    // This kernel has no dummy module: a port-less bridge left down holds addresses the same way.
    sim.host
        .exec(&["ip", "link", "add", "kube-ipvs0", "type", "bridge"]);
    sim.outside
        .exec(&["ip", "route", "add", "10.96.0.0/16", "via", "203.0.113.1"]);
    sim.outside.exec(&[
        "ip",
        "-6",
        "route",
        "add",
        "fd00:96::/64",
        "via",
        "2001:db8:1::1",
    ]);
    let add_service = |vip: &str, prefix: &str| {
        sim.host.exec(&[
            "ip",
            "addr",
            "add",
            &format!("{vip}/{prefix}"),
            "dev",
            "kube-ipvs0",
            "nodad",
        ]);
        let address = SocketAddr::new(vip.parse().expect("literal"), 8080);
        TcpServer::start(&sim.host, address, "service")
    };
    let _before = [
        add_service("10.96.0.10", "32"),
        add_service("fd00:96::10", "128"),
    ];
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let explicit = json!({ "portMappings": [{ "hostPort": 9090, "containerPort": 80, "hostIP": "10.96.0.12" }] });
    let c3 = sim.container("c3", explicit);
    let other_pod = sim.container("c2", json!({}));
    let _after = [
        add_service("10.96.0.11", "32"),
        add_service("fd00:96::11", "128"),
    ];
    let _web = [Family::V4, Family::V6]
        .map(|family| TcpServer::start(&c1.netns, c1.at(family, 80), "pod"));
    let _explicit_web = TcpServer::start(&c3.netns, c3.at(Family::V4, 80), "explicit");
    for vip in ["10.96.0.10", "fd00:96::10", "10.96.0.11", "fd00:96::11"] {
        let target = SocketAddr::new(vip.parse().expect("literal"), 8080);
        let answers = [
            ("outside", tcp_request(&sim.outside, target)),
            ("another pod", tcp_request(&other_pod.netns, target)),
            (
                "a host process",
                sim.host_client("tcp", target).map(|(answer, _)| answer),
            ),
        ];
        for (client, answer) in answers {
            assert_eq!(
                answer.as_deref(),
                Ok("service"),
                "{client} -> Service {target}"
            );
        }
    }
    for family in Family::BOTH {
        assert_eq!(
            tcp_request(&sim.outside, sim.uplink(family, 8080)).as_deref(),
            Ok("pod"),
            "{family:?}: the node's address reaches the pod"
        );
    }
    sim.host
        .exec(&["ip", "addr", "add", "10.96.0.12/32", "dev", "kube-ipvs0"]);
    assert_eq!(
        tcp_request(&sim.outside, "10.96.0.12:9090".parse().expect("literal")).as_deref(),
        Ok("explicit"),
        "a hostIP that names a Service address is the operator's choice"
    );
}

/// A datagram to a hostPort whose container port is closed is answered with port
/// unreachable, which leaves from the hostPort, quoting it — as conntrack's NAT translates a
/// RELATED error — so the client's socket learns it; from a masqueraded container too, whose
/// untranslatable packets are dropped.
fn a_closed_container_port_answers_through_the_host_port(backend: Backend) {
    let sim = SimHost::on(backend, "hp-unreach", json!({ "ipMasq": true }));
    let _c1 = sim.container("c1", port_mappings(&[(5353, 53, "udp")]));
    for family in Family::BOTH {
        assert_eq!(
            udp_error(&sim.outside, sim.uplink(family, 5353)),
            std::io::ErrorKind::ConnectionRefused,
            "{family:?}: port unreachable reaches the client from the hostPort"
        );
    }
}

for_both_backends!(
    a_closed_container_port_answers_through_the_host_port,
    an_address_added_to_the_uplink_serves_wildcard_host_ports,
    a_wildcard_host_port_leaves_service_addresses_to_the_services,
    fragmented_datagrams_reach_a_host_port_and_come_back,
    outside_clients_reach_tcp_and_udp_host_ports_over_both_families,
    an_ipv6_host_ip_restricts_the_mapping_to_ipv6,
    sctp_mappings_are_installed,
    sctp_carries_traffic_through_host_ports,
    hairpin_reaches_the_container_itself_and_its_neighbour_without_netfilter_help,
    fifty_containers_with_distinct_mappings_are_all_reachable,
    a_host_port_that_changes_owner_reaches_the_new_container_within_a_second,
    a_client_that_switches_from_the_host_port_to_the_container_address_is_not_rewritten,
);
