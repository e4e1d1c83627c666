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

for_both_backends!(
    a_datagram_too_big_for_the_uplink_goes_through_the_stack_between_small_ones,
    fragmented_udp_datagrams_are_masqueraded_both_ways,
    icmp_errors_reach_the_container_translated,
    path_mtu_discovery_works_through_the_nat,
);
