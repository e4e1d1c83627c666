//! Packets beyond a plain flow: fragments, ICMP errors, path MTU discovery, datagrams too
//! big for the uplink.

use super::*;

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

/// What netfilter's conntrack calls INVALID skips its NAT, and an ICMP error about a
/// connection never seen has nothing to be translated by (plugins#816, moby#18630): neither may
/// leave the uplink with the container's own address. The container sends each kind raw — an
/// out-of-window ACK on a just-closed connection's tuple, a RST and a FIN+ACK for tuples never
/// opened, a SYN+FIN, an ICMP and an ICMPv6 port unreachable about datagrams that never were —
/// while a sniffer watches the outside link; what cannot leave translated is dropped and
/// counted with its reason.
fn no_packet_leaves_the_uplink_with_the_containers_own_address(backend: Backend) {
    let host = masquerading(backend, "mq-guard");
    let container = host.container("c1", Value::Null);
    let _server = TcpServer::start(&host.outside, Family::V4.any(8080), "hello");
    let target = SocketAddr::new(Family::V4.outside(), 8080);
    // The uplink's IPv6 neighbour resolved, as a running pod finds it: a packet that waits for
    // the solicitation's answer reaches the uplink's egress a second later, or never.
    assert!(
        ping(&container.netns, Family::V6.outside()),
        "an IPv6 ping before the crafted packets"
    );
    let closed_port = container.netns.run(move || {
        let mut stream = std::net::TcpStream::connect_timeout(&target, CLIENT_TIMEOUT)
            .expect("a connection to close");
        let mut greeting = String::new();
        std::io::Read::read_to_string(&mut stream, &mut greeting).expect("the greeting");
        stream.local_addr().expect("its local address").port()
    });
    let (gateway, mac) = (host.host.mac(BRIDGE), container.netns.mac("eth0"));
    let (me, outside) = (IpAddr::V4(container.address), IpAddr::V4(OUTSIDE_ADDR));
    let (me6, outside6) = (container.address6, OUTSIDE_ADDR6);
    let v4 = |protocol, payload: Vec<u8>| {
        let packet = ipv4(
            container.address,
            OUTSIDE_ADDR,
            protocol,
            &[],
            (false, 0),
            &payload,
        );
        ethernet(gateway, mac, ETH_P_IP, &packet)
    };
    let v6 = |protocol, payload: Vec<u8>| {
        ethernet(
            gateway,
            mac,
            ETH_P_IPV6,
            &ipv6(me6, outside6, protocol, &payload),
        )
    };
    let never_sent = ipv4(
        OUTSIDE_ADDR,
        container.address,
        UDP,
        &[],
        (false, 0),
        &udp(outside, me, 53, 40_004, b"never", true),
    );
    let never_sent6 = ipv6(
        outside6,
        me6,
        UDP,
        &udp(
            IpAddr::V6(outside6),
            IpAddr::V6(me6),
            53,
            40_004,
            b"never",
            true,
        ),
    );
    let frames = [
        v4(TCP, tcp(me, outside, closed_port, 8080, ACK, b"late")),
        v4(TCP, tcp(me, outside, 40_001, 8081, RST, b"")),
        v4(TCP, tcp(me, outside, 40_002, 8082, SYN | FIN, b"")),
        v4(TCP, tcp(me, outside, 40_003, 8083, FIN | ACK, b"")),
        v4(ICMP, icmp(3, 3, [0; 4], &never_sent)),
        v6(
            TCP,
            tcp(
                IpAddr::V6(me6),
                IpAddr::V6(outside6),
                40_001,
                8081,
                RST,
                b"",
            ),
        ),
        v6(ICMPV6, icmpv6(me6, outside6, 1, 4, [0; 4], &never_sent6)),
    ];
    let sniffer = Sniffer::start(&host.outside, "eth0");
    for frame in frames {
        send_frame(&container.netns, "eth0", frame);
    }
    let untranslatable = || {
        host.inspect()["drops"][backend.name()]["masquerade_untranslatable"]["packets"]
            .as_u64()
            .unwrap_or_default()
    };
    // The ICMPv6 error goes last: once it is counted, every frame before it has left or not.
    let counted = eventually(Duration::from_secs(5), || untranslatable() >= 2);
    let leaked: Vec<String> = sniffer
        .frames()
        .iter()
        .filter_map(|frame| source_of(frame))
        .filter(|source| *source == me || *source == IpAddr::V6(me6))
        .map(|source| source.to_string())
        .collect();
    assert!(
        leaked.is_empty(),
        "left the uplink with the container's address: {leaked:?}"
    );
    assert!(
        counted,
        "the ICMP errors about nothing at least are dropped and counted: {}",
        untranslatable()
    );
    assert_eq!(
        tcp_request(&container.netns, target).as_deref(),
        Ok("hello"),
        "what can be translated still is"
    );
}

/// The IP source address of an Ethernet frame, if it carries IPv4 or IPv6.
fn source_of(frame: &[u8]) -> Option<IpAddr> {
    match frame.get(12..14)? {
        [0x08, 0x00] => {
            let bytes: [u8; 4] = frame.get(26..30)?.try_into().ok()?;
            Some(IpAddr::from(bytes))
        }
        [0x86, 0xdd] => {
            let bytes: [u8; 16] = frame.get(22..38)?.try_into().ok()?;
            Some(IpAddr::from(bytes))
        }
        _ => None,
    }
}

for_both_backends!(
    a_datagram_too_big_for_the_uplink_goes_through_the_stack_between_small_ones,
    fragmented_udp_datagrams_are_masqueraded_both_ways,
    icmp_errors_reach_the_container_translated,
    no_packet_leaves_the_uplink_with_the_containers_own_address,
    path_mtu_discovery_works_through_the_nat,
);
