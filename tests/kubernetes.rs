//! A node shaped like a Kubernetes one: `br_netfilter` on (`bridge-nf-call-iptables=1`, as
//! kube-proxy requires) and kube-proxy's rules in the host (its iptables and its nftables mode).
//! The node's netfilter keeps its word for pods on both backends: pods reach Services whose
//! endpoints are off the node and on it, a connection netfilter `dnat`s into a pod is answered
//! from the address the client reached; the host's own connections stay the host's, however
//! their ports meet a hostPort's or a pod's masqueraded flow's; the node's addresses are
//! followed without a call.

use std::{
    io::ErrorKind,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
    time::Duration,
};

use cnibpf_tests::{
    Container, SimHost, eventually, for_both_backends,
    kube_proxy::{self, Mode, NodePort, Service},
    topology::{Backend, Family, SUBNET, SUBNET6, UPLINK, port_mappings},
    traffic::{
        CLIENT_TIMEOUT, Conversation, StreamEchoServer, TcpServer, UdpServer, report_icmp_errors,
        tcp_request, udp_request, uninterrupted,
    },
};
use serde_json::{Value, json};

const CLUSTER_CIDRS: [&str; 2] = [SUBNET, SUBNET6];

fn node(backend: Backend, id: &str) -> SimHost {
    SimHost::kubernetes_node(backend, id, json!({ "ipMasq": true }))
}

/// A Service address (ClusterIP) of `family`: `index` 10 and up.
fn cluster_ip(family: Family, index: u16, port: u16) -> SocketAddr {
    match family {
        Family::V4 => SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 96, 0, index as u8)), port),
        Family::V6 => SocketAddr::new(
            IpAddr::V6(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, index)),
            port,
        ),
    }
}

fn outside(family: Family, port: u16) -> SocketAddr {
    SocketAddr::new(family.outside(), port)
}

/// `base` for IPv4, another port for IPv6: a family's sockets never meet the other's
/// (dual-stack wildcard binds, TIME_WAIT).
fn port(family: Family, base: u16) -> u16 {
    match family {
        Family::V4 => base,
        Family::V6 => base + 100,
    }
}

/// Whether the outside's server saw `peer` come from the node (the uplink's address).
fn from_the_node(sim: &SimHost, family: Family, peer: SocketAddr) -> bool {
    peer.ip() == sim.uplink(family, 0).ip()
}

/// A pod reaches, through kube-proxy's `dnat` of a ClusterIP, an endpoint outside the node
/// (masqueraded there: the outside has no route back to pods) and one on the node, another pod
/// (with its own address: pod to pod is never masqueraded), over TCP and UDP, both families,
/// whichever of kube-proxy's modes wrote the rules. The answers come from the Service address.
fn pods_reach_services_through_kube_proxys_dnat(backend: Backend) {
    let sim = node(backend, "k8-svc");
    let client = sim.container("c1", Value::Null);
    let endpoint = sim.container("c2", Value::Null);
    let mut servers = Vec::new();
    let mut services = Vec::new();
    for family in Family::BOTH {
        servers.push((
            TcpServer::start(&sim.outside, family.any(port(family, 9000)), "outside"),
            UdpServer::start(&sim.outside, family.any(port(family, 9053)), "outside dns"),
            TcpServer::start(&endpoint.netns, endpoint.at(family, 80), "c2"),
            UdpServer::start(&endpoint.netns, endpoint.at(family, 53), "c2 dns"),
        ));
        services.extend([
            Service {
                address: cluster_ip(family, 10, 80),
                protocol: "tcp",
                endpoint: outside(family, port(family, 9000)),
            },
            Service {
                address: cluster_ip(family, 10, 53),
                protocol: "udp",
                endpoint: outside(family, port(family, 9053)),
            },
            Service {
                address: cluster_ip(family, 11, 80),
                protocol: "tcp",
                endpoint: endpoint.at(family, 80),
            },
            Service {
                address: cluster_ip(family, 11, 53),
                protocol: "udp",
                endpoint: endpoint.at(family, 53),
            },
        ]);
    }
    for mode in Mode::BOTH {
        kube_proxy::install(&sim.host, mode, CLUSTER_CIDRS, &services, &[]);
        for (family, (outside_web, outside_dns, pod_web, pod_dns)) in
            Family::BOTH.into_iter().zip(&servers)
        {
            let what = |service: &str| format!("{mode:?}, {family:?}: c1 -> {service}");
            let web = cluster_ip(family, 10, 80);
            assert_eq!(
                tcp_request(&client.netns, web).as_deref(),
                Ok("outside"),
                "{}",
                what("Service off the node (TCP)")
            );
            let peer = outside_web.peers().pop().expect("a connection");
            assert!(
                from_the_node(&sim, family, peer),
                "{}: masqueraded, the outside saw {peer}",
                what("Service off the node")
            );
            let dns = cluster_ip(family, 10, 53);
            let (answer, from) = udp_request(&client.netns, dns)
                .unwrap_or_else(|error| panic!("{}: {error}", what("Service off the node (UDP)")));
            assert_eq!(
                (answer.as_str(), from),
                ("outside dns", dns),
                "{}",
                what("Service off the node (UDP)")
            );
            let peer = outside_dns.peers().pop().expect("a datagram");
            assert!(
                from_the_node(&sim, family, peer),
                "{}: masqueraded, the outside saw {peer}",
                what("Service off the node (UDP)")
            );
            let web = cluster_ip(family, 11, 80);
            assert_eq!(
                tcp_request(&client.netns, web).as_deref(),
                Ok("c2"),
                "{}",
                what("Service on the node (TCP)")
            );
            let peer = pod_web.peers().pop().expect("a connection");
            assert_eq!(
                peer.ip(),
                client.at(family, 0).ip(),
                "{}: the endpoint sees the pod",
                what("Service on the node")
            );
            let dns = cluster_ip(family, 11, 53);
            let (answer, from) = udp_request(&client.netns, dns)
                .unwrap_or_else(|error| panic!("{}: {error}", what("Service on the node (UDP)")));
            assert_eq!(
                (answer.as_str(), from),
                ("c2 dns", dns),
                "{}",
                what("Service on the node (UDP)")
            );
            let peer = pod_dns.peers().pop().expect("a datagram");
            assert_eq!(
                peer.ip(),
                client.at(family, 0).ip(),
                "{}: the endpoint sees the pod",
                what("Service on the node (UDP)")
            );
        }
        kube_proxy::uninstall(&sim.host);
    }
}

/// A NodePort with `externalTrafficPolicy: Local` (and CRI-O's hostPorts, which CRI-O writes
/// as the same kind of rule): the node's netfilter `dnat`s the client's connection into a
/// masqueraded pod with the client's address kept. The pod's answers leave from the address
/// and port the client reached, TCP and UDP, both families.
fn a_dnat_into_a_pod_is_answered_from_the_address_the_client_reached(backend: Backend) {
    let sim = node(backend, "k8-local");
    let pod = sim.container("c1", Value::Null);
    let mut servers = Vec::new();
    let mut node_ports = Vec::new();
    for family in Family::BOTH {
        servers.push((
            TcpServer::start(&pod.netns, pod.at(family, 80), "c1"),
            UdpServer::start(&pod.netns, pod.at(family, 53), "c1 dns"),
        ));
        node_ports.extend([
            NodePort {
                port: 30080,
                protocol: "tcp",
                endpoint: pod.at(family, 80),
            },
            NodePort {
                port: 30053,
                protocol: "udp",
                endpoint: pod.at(family, 53),
            },
        ]);
    }
    for mode in Mode::BOTH {
        kube_proxy::install(&sim.host, mode, CLUSTER_CIDRS, &[], &node_ports);
        for (family, (web, _)) in Family::BOTH.into_iter().zip(&servers) {
            let node_port = sim.uplink(family, 30080);
            assert_eq!(
                tcp_request(&sim.outside, node_port).as_deref(),
                Ok("c1"),
                "{mode:?}, {family:?}: outside -> NodePort {node_port}"
            );
            let peer = web.peers().pop().expect("a connection");
            assert_eq!(
                peer.ip(),
                family.outside(),
                "{mode:?}, {family:?}: the pod sees the client"
            );
            let node_port = sim.uplink(family, 30053);
            let (answer, from) = udp_request(&sim.outside, node_port).unwrap_or_else(|error| {
                panic!("{mode:?}, {family:?}: outside -> {node_port}: {error}")
            });
            assert_eq!(
                (answer.as_str(), from),
                ("c1 dns", node_port),
                "{mode:?}, {family:?}: the answer comes from the NodePort"
            );
        }
        kube_proxy::uninstall(&sim.host);
    }
}

/// A pod publishes hostPort 40000 (TCP and UDP). A host process that uses 40000 as its own
/// source port — towards a server outside, and towards another pod (the hairpin path) —
/// keeps its connections and answers: a TCP connection held across an outside client's visit
/// to the hostPort, a connected UDP socket, the port unreachable the server's host answers for
/// a closed port. Meanwhile outside clients reach the pod through the hostPort.
fn the_hosts_own_connections_on_a_host_ports_number_stay_the_hosts(backend: Backend) {
    let sim = node(backend, "k8-hsock");
    let pod = sim.container(
        "c1",
        port_mappings(&[(40_000, 80, "tcp"), (40_000, 53, "udp")]),
    );
    let other = sim.container("c2", Value::Null);
    for family in Family::BOTH {
        let _pod_web = TcpServer::start(&pod.netns, pod.at(family, 80), "pod");
        let _pod_dns = UdpServer::start(&pod.netns, pod.at(family, 53), "pod dns");
        let _echo = StreamEchoServer::start(&sim.outside, family.any(port(family, 9000)));
        let _other_echo =
            StreamEchoServer::start(&other.netns, other.at(family, port(family, 9000)));
        let _dns = UdpServer::start(&sim.outside, family.any(port(family, 9053)), "outside dns");
        let host_port = sim.uplink(family, 40_000);
        for (peer, server) in [
            ("outside", outside(family, port(family, 9000))),
            ("another pod", other.at(family, port(family, 9000))),
        ] {
            let what = format!("{family:?}: the host's connection from port 40000 to {peer}");
            let mut held = Conversation::open_from(&sim.host, host_port, server)
                .unwrap_or_else(|error| panic!("{what}: {error}"));
            held.exchange(b"first", CLIENT_TIMEOUT)
                .unwrap_or_else(|error| panic!("{what}: {error}"));
            assert_eq!(
                tcp_request(&sim.outside, host_port).as_deref(),
                Ok("pod"),
                "{family:?}: an outside client reaches the pod meanwhile"
            );
            held.exchange(b"later", CLIENT_TIMEOUT)
                .unwrap_or_else(|error| panic!("{what}, held: {error}"));
        }
        let socket = sim.host.run(move || {
            let socket = UdpSocket::bind(host_port).expect("bind the host's UDP socket");
            socket
                .set_read_timeout(Some(CLIENT_TIMEOUT))
                .expect("timeout");
            socket
        });
        socket
            .connect(outside(family, port(family, 9053)))
            .expect("connect");
        for round in ["first", "second"] {
            socket.send(b"ping").expect("send");
            let mut buffer = [0u8; 64];
            let length = uninterrupted(|| socket.recv(&mut buffer)).unwrap_or_else(|error| {
                panic!("{family:?}: the host's UDP answer from port 40000 ({round}): {error}")
            });
            assert_eq!(&buffer[..length], b"outside dns");
        }
        let (answer, _) = udp_request(&sim.outside, host_port)
            .unwrap_or_else(|error| panic!("{family:?}: outside -> UDP hostPort: {error}"));
        assert_eq!(answer, "pod dns", "{family:?}");
        // The server's host answers for a closed port: the error quotes the host's datagram.
        socket.connect(outside(family, 9999)).expect("connect");
        socket.send(b"ping").expect("send");
        let mut buffer = [0u8; 64];
        let refused = uninterrupted(|| socket.recv(&mut buffer)).map(|_| ());
        assert_eq!(
            refused.map_err(|error| error.kind()),
            Err(ErrorKind::ConnectionRefused),
            "{family:?}: port unreachable reaches the host's socket"
        );
    }
}

/// A pod publishes hostPort 40000/udp on every address and 40001/udp on the uplink's. A host
/// process's unconnected UDP socket on either number — bound to the uplink's address and to
/// the wildcard, both families — that sends to a server outside and to another pod (the
/// hairpin path) gets their answers, and the port unreachable a closed port's host sends back,
/// as conntrack keeps them for the host; a new outside client reaches the pod meanwhile, and
/// before the socket sent anything (a socket that only listens does not outrank the hostPort).
fn a_host_socket_sending_unconnected_from_a_host_ports_number_gets_its_answers(backend: Backend) {
    let sim = node(backend, "k8-hudp");
    let mut mappings = port_mappings(&[(40_000, 53, "udp")]);
    for family in Family::BOTH {
        mappings["portMappings"]
            .as_array_mut()
            .expect("a list")
            .push(json!({
                "hostPort": 40_001, "containerPort": 53, "protocol": "udp",
                "hostIP": sim.uplink(family, 0).ip().to_string(),
            }));
    }
    let pod = sim.container("c1", mappings);
    let other = sim.container("c2", Value::Null);
    let pod_answers = |what: &str, host_port: SocketAddr| {
        let (answer, _) = udp_request(&sim.outside, host_port)
            .unwrap_or_else(|error| panic!("{what}: outside -> UDP hostPort: {error}"));
        assert_eq!(
            answer, "pod dns",
            "{what}: a new outside client reaches the pod"
        );
    };
    for family in Family::BOTH {
        let _pod_dns = UdpServer::start(&pod.netns, pod.at(family, 53), "pod dns");
        let sockets = [40_000, 40_001].into_iter().flat_map(|number| {
            [sim.uplink(family, number), family.any(number)].map(|bind| (number, bind))
        });
        // Servers of their own for each socket: one's host flow is no other's.
        for (index, (number, bind)) in sockets.enumerate() {
            let server_port = port(family, 9053) + index as u16;
            let host_port = sim.uplink(family, number);
            let what = format!("{family:?}: the host's unconnected socket on {bind}");
            let _dns = UdpServer::start(&sim.outside, family.any(server_port), "outside dns");
            let _other_dns =
                UdpServer::start(&other.netns, other.at(family, server_port), "other pod dns");
            let socket = sim.host_udp_socket(bind);
            pod_answers(&format!("{what}, which sent nothing yet"), host_port);
            for (server, greeting) in [
                (outside(family, server_port), "outside dns"),
                (other.at(family, server_port), "other pod dns"),
            ] {
                for round in ["first", "second", "after an outside client's"] {
                    socket.send_to(b"ping", server).expect("send");
                    let mut buffer = [0u8; 64];
                    let (length, from) = uninterrupted(|| socket.recv_from(&mut buffer))
                        .unwrap_or_else(|error| {
                            panic!("{what}: the answer of {server} ({round}): {error}")
                        });
                    assert_eq!(
                        (&buffer[..length], from),
                        (greeting.as_bytes(), server),
                        "{what}: {round}"
                    );
                    pod_answers(&what, host_port);
                }
            }
            // The server's host answers for a closed port: the error quotes the host's datagram.
            report_icmp_errors(&socket);
            socket
                .send_to(b"ping", outside(family, 9999))
                .expect("send");
            let mut buffer = [0u8; 64];
            let refused = uninterrupted(|| socket.recv_from(&mut buffer)).map(|_| ());
            assert_eq!(
                refused.map_err(|error| error.kind()),
                Err(ErrorKind::ConnectionRefused),
                "{what}: port unreachable reaches the host's socket"
            );
        }
    }
}

/// A pod's masqueraded connection holds its own source port P towards a server; then a host
/// socket bound to P opens one towards the same server. Both keep working and neither gets
/// the other's packets: the later one, the host's, leaves from another port (as conntrack
/// moves it), TCP and UDP, both families. The moves are counted.
fn a_host_flow_on_a_port_a_pods_masqueraded_flow_holds_loses_nothing(backend: Backend) {
    let sim = node(backend, "k8-clash");
    let pod = sim.container("c1", Value::Null);
    for family in Family::BOTH {
        let (echo_port, dns_port) = (port(family, 9000), port(family, 9053));
        let (udp_port, tcp_port) = (port(family, 45_000), port(family, 45_001));
        let _echo = StreamEchoServer::start(&sim.outside, family.any(echo_port));
        let dns = UdpServer::start(&sim.outside, family.any(dns_port), "outside dns");
        let target = outside(family, dns_port);
        let exchange = |socket: &UdpSocket, who: &str| {
            socket.send_to(b"ping", target).expect("send");
            let mut buffer = [0u8; 64];
            let (length, _) = uninterrupted(|| socket.recv_from(&mut buffer))
                .unwrap_or_else(|error| panic!("{family:?}: {who}'s UDP answer: {error}"));
            assert_eq!(&buffer[..length], b"outside dns", "{family:?}: {who}");
        };
        let pod_socket = pod.netns.run(move || {
            let socket = UdpSocket::bind(family.any(udp_port)).expect("bind the pod's socket");
            socket
                .set_read_timeout(Some(CLIENT_TIMEOUT))
                .expect("timeout");
            socket
        });
        exchange(&pod_socket, "the pod");
        // The host's socket comes after the pod's flow took the port.
        let host_socket = sim.host.run({
            let local = sim.uplink(family, udp_port);
            move || {
                let socket = UdpSocket::bind(local).expect("bind the host's socket");
                socket
                    .set_read_timeout(Some(CLIENT_TIMEOUT))
                    .expect("timeout");
                socket
            }
        });
        exchange(&host_socket, "the host");
        exchange(&pod_socket, "the pod, after the host");
        exchange(&host_socket, "the host, again");
        let ports: Vec<u16> = dns.peers().iter().map(SocketAddr::port).collect();
        assert_eq!(
            ports[0], udp_port,
            "{family:?}: the pod's flow keeps its port: {ports:?}"
        );
        assert_ne!(
            ports[1], udp_port,
            "{family:?}: the host's flow moved: {ports:?}"
        );
        assert_eq!(
            (ports[2], ports[3]),
            (ports[0], ports[1]),
            "{family:?}: each keeps its own: {ports:?}"
        );

        let server = outside(family, echo_port);
        let mut pod_connection = Conversation::open_from(&pod.netns, family.any(tcp_port), server)
            .unwrap_or_else(|error| panic!("{family:?}: the pod's connection: {error}"));
        pod_connection
            .exchange(b"pod", CLIENT_TIMEOUT)
            .expect("the pod's first exchange");
        let mut host_connection =
            Conversation::open_from(&sim.host, sim.uplink(family, tcp_port), server)
                .unwrap_or_else(|error| panic!("{family:?}: the host's connection: {error}"));
        for round in 0..3 {
            host_connection
                .exchange(b"host", CLIENT_TIMEOUT)
                .unwrap_or_else(|error| {
                    panic!("{family:?}: the host's TCP exchange {round}: {error}")
                });
            pod_connection
                .exchange(b"pod", CLIENT_TIMEOUT)
                .unwrap_or_else(|error| {
                    panic!("{family:?}: the pod's TCP exchange {round}: {error}")
                });
        }
    }
    if backend == Backend::Ebpf {
        let moved = sim.inspect()["counters"]["ebpf"]["host flows moved off a container's port"]
            .as_u64()
            .unwrap_or(0);
        assert!(
            moved >= 4,
            "every host flow that met a pod's was counted: {moved}"
        );
    }
}

/// The uplink re-addressed under a running pod, with no CNI call and no `install --watch`: a
/// wildcard hostPort serves the new address to outside clients within a second (nftables: the
/// kernel says it is the address of the interface the packet came in by; eBPF: it is the
/// address the host answers the client from, out of that interface), both families; pods
/// reach it once it is recorded (here by a CHECK).
fn wildcard_host_ports_follow_a_readdressed_uplink_without_a_call(backend: Backend) {
    let sim = node(backend, "k8-addr");
    let pod = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let other = sim.container("c2", Value::Null);
    let _web = Family::BOTH.map(|family| TcpServer::start(&pod.netns, pod.at(family, 80), "pod"));
    sim.host
        .sysctl(&format!("net.ipv4.conf.{UPLINK}.promote_secondaries"), "1");
    let mut moved = Vec::new();
    for (family, old, new) in [
        (Family::V4, "203.0.113.1/24", "203.0.113.7/24"),
        (Family::V6, "2001:db8:1::1/64", "2001:db8:1::7/64"),
    ] {
        sim.host
            .exec(&["ip", "addr", "add", new, "dev", UPLINK, "nodad"]);
        sim.host.exec(&["ip", "addr", "del", old, "dev", UPLINK]);
        let address: IpAddr = new
            .split('/')
            .next()
            .and_then(|text| text.parse().ok())
            .expect("literal");
        let target = SocketAddr::new(address, 8080);
        assert!(
            eventually(Duration::from_secs(1), || tcp_request(&sim.outside, target)
                .as_deref()
                == Ok("pod")),
            "{family:?}: outside -> {target} within a second"
        );
        moved.push(target);
    }
    sim.check(&pod)
        .unwrap_or_else(|error| panic!("CHECK records the new addresses: {error}"));
    for target in moved {
        assert_eq!(
            tcp_request(&other.netns, target).as_deref(),
            Ok("pod"),
            "a pod -> {target} once recorded"
        );
    }
}

/// Two pods use the same source port towards one server at the same time, with br_netfilter
/// on: masquerade moves the second, and both connections live, three rounds of them.
fn pods_on_the_same_source_port_towards_one_server_both_connect(backend: Backend) {
    let sim = node(backend, "k8-same");
    let pods: Vec<Container> = (0..2)
        .map(|index| sim.container(&format!("c{index}"), Value::Null))
        .collect();
    for family in Family::BOTH {
        let _echo = StreamEchoServer::start(&sim.outside, family.any(port(family, 9000)));
        for round in 0..3_u16 {
            let local = family.any(port(family, 46_000) + round);
            let server = outside(family, port(family, 9000));
            let opened: Vec<_> = pods
                .iter()
                .map(|pod| {
                    let netns = pod.netns.path();
                    std::thread::spawn(move || {
                        Conversation::open_from(&cnibpf_tests::Netns::at(&netns), local, server)
                    })
                })
                .collect();
            for (index, handle) in opened.into_iter().enumerate() {
                let mut connection = handle.join().expect("no panic").unwrap_or_else(|error| {
                    panic!("{family:?} round {round}: pod {index}: {error}")
                });
                connection
                    .exchange(b"hello", CLIENT_TIMEOUT)
                    .unwrap_or_else(|error| {
                        panic!("{family:?} round {round}: pod {index}: {error}")
                    });
            }
        }
    }
}

for_both_backends!(
    pods_reach_services_through_kube_proxys_dnat,
    a_dnat_into_a_pod_is_answered_from_the_address_the_client_reached,
    the_hosts_own_connections_on_a_host_ports_number_stay_the_hosts,
    a_host_socket_sending_unconnected_from_a_host_ports_number_gets_its_answers,
    a_host_flow_on_a_port_a_pods_masqueraded_flow_holds_loses_nothing,
    wildcard_host_ports_follow_a_readdressed_uplink_without_a_call,
    pods_on_the_same_source_port_towards_one_server_both_connect,
);
