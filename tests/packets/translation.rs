//! Translated packets leave whole: hostPort DNAT and masquerade with valid checksums, every
//! TCP flag combination, fragments following their first.

use super::*;

#[test]
fn a_packet_to_a_host_port_leaves_translated_with_valid_checksums() {
    let bench = bench("pk-translate");
    bench.expect_translated(&syn_v4(SYN), 80, "TCP SYN");
    let datagram = udp(
        OUTSIDE_ADDR.into(),
        HOST_UPLINK_ADDR.into(),
        40_001,
        5353,
        b"query",
        true,
    );
    bench.expect_translated(&outside_v4(UDP, &datagram), 53, "UDP");
    let unchecked = udp(
        OUTSIDE_ADDR.into(),
        HOST_UPLINK_ADDR.into(),
        40_002,
        5353,
        b"query",
        false,
    );
    let frame = outside_v4(UDP, &unchecked);
    bench.expect_translated(&frame, 53, "UDP without a checksum");
    let (_, out) = bench.run(&frame).expect("runs");
    let udp_checksum = &out[14 + 20 + 6..14 + 20 + 8];
    assert_eq!(
        udp_checksum,
        [0, 0],
        "a datagram without a checksum stays without one"
    );
    bench.expect_translated(
        &outside_v4(SCTP, &sctp(40_003, 9999, b"chunk")),
        9999,
        "SCTP",
    );
    // Another port: the CRC32c is updated for it without reading the chunks, whatever their
    // length; the container's answers get the hostPort back the same way.
    for (client_port, payload) in [(40_010, vec![7u8; 1]), (40_011, vec![0x5a; 1400])] {
        bench.expect_translated(
            &outside_v4(SCTP, &sctp(client_port, 9132, &payload)),
            132,
            &format!("SCTP to another port, {} bytes of chunk", payload.len()),
        );
        let answer = sctp(132, client_port, &payload);
        let (verdict, out) = bench
            .run_from_container(&bench.sent_by_container(SCTP, OUTSIDE_ADDR, &answer))
            .expect("runs");
        assert_ne!(verdict, DROP, "the SCTP answer goes out");
        let parsed = verify(&out).unwrap_or_else(|error| panic!("SCTP answer: {error}"));
        assert_eq!(
            (parsed.src, parsed.ports),
            (IpAddr::V4(HOST_UPLINK_ADDR), Some((9132, client_port))),
            "the answer comes from the hostPort"
        );
    }
    bench.expect_translated(
        &outside_v6(SCTP, &sctp(40_012, 9132, b"chunk")),
        132,
        "SCTP over IPv6 to another port",
    );
    let segment = tcp(
        OUTSIDE_ADDR6.into(),
        HOST_UPLINK_ADDR6.into(),
        40_004,
        8080,
        SYN,
        b"",
    );
    bench.expect_translated(&outside_v6(TCP, &segment), 80, "TCP over IPv6");
    let datagram = udp(
        OUTSIDE_ADDR6.into(),
        HOST_UPLINK_ADDR6.into(),
        40_005,
        5353,
        b"q",
        true,
    );
    bench.expect_translated(&outside_v6(UDP, &datagram), 53, "UDP over IPv6");

    // Masquerade: what the container sends out leaves from the uplink's address.
    let far = Ipv4Addr::new(198, 51, 100, 9);
    let segment = tcp(
        bench.container.address.into(),
        far.into(),
        41_000,
        443,
        SYN,
        b"",
    );
    let (verdict, out) = bench
        .run_first_out(&bench.sent_by_container(TCP, far, &segment))
        .expect("runs");
    assert_eq!(verdict, NEXT, "masqueraded out of the uplink");
    let parsed = verify(&out).unwrap_or_else(|error| panic!("masqueraded: {error}"));
    assert_eq!(
        parsed.src,
        IpAddr::V4(HOST_UPLINK_ADDR),
        "from the uplink's address"
    );
    assert_eq!(parsed.dst, IpAddr::V4(far));
}

/// A masqueraded flow's first packet makes its state at the uplink's egress; the later ones
/// take it at the container's veth (the header rewritten in one write, its checksum computed
/// by the program, one hop fewer): every one leaves from the uplink's address and the flow's
/// port with valid checksums — TCP, UDP, and UDP without a checksum, which stays without one.
#[test]
fn a_masqueraded_flows_later_packets_leave_like_its_first() {
    let bench = bench("pk-masq");
    let far = Ipv4Addr::new(198, 51, 100, 9);
    let own = bench.container.address;
    // What the container sends on each flow: its first segment or datagram, then later ones.
    let segment = |what: &str, payload: &[u8], first: bool| -> (u8, Vec<u8>) {
        match what {
            "TCP" => {
                let flags = if first { SYN } else { ACK };
                (
                    TCP,
                    tcp(own.into(), far.into(), 41_100, 443, flags, payload),
                )
            }
            "UDP" => (UDP, udp(own.into(), far.into(), 41_101, 53, payload, true)),
            _ => (UDP, udp(own.into(), far.into(), 41_102, 53, payload, false)),
        }
    };
    for what in ["TCP", "UDP", "UDP without a checksum"] {
        let mut first_port = None;
        for (index, payload) in [&b""[..], b"one", b"two, a little longer"]
            .iter()
            .enumerate()
        {
            let (protocol, l4) = segment(what, payload, index == 0);
            let frame = bench.sent_by_container(protocol, far, &l4);
            let first = index == 0;
            let (verdict, out) = if first {
                bench.run_first_out(&frame)
            } else {
                bench.run_from_container(&frame)
            }
            .unwrap_or_else(|| panic!("{what} #{index}: the kernel refused the run"));
            let (sent, hops) = if first { (NEXT, 0) } else { (REDIRECT, 1) };
            assert_eq!(verdict, sent, "{what} #{index}: sent out of the uplink");
            let parsed =
                verify(&out).unwrap_or_else(|error| panic!("{what} #{index}: {error}: {out:02x?}"));
            assert_eq!(
                parsed.src,
                IpAddr::V4(HOST_UPLINK_ADDR),
                "{what} #{index}: from the uplink's address"
            );
            assert_eq!(
                out[14 + 8],
                frame[14 + 8] - hops,
                "{what} #{index}: a hop fewer from the veth (the stack takes the first's)"
            );
            let port = parsed.ports.map(|(sport, _)| sport);
            assert_eq!(
                *first_port.get_or_insert(port),
                port,
                "{what} #{index}: the flow's port"
            );
            if what == "UDP without a checksum" {
                assert_eq!(
                    out[14 + 20 + 6..14 + 20 + 8],
                    [0, 0],
                    "{what} #{index}: still without one"
                );
            }
        }
    }
}

#[test]
fn every_tcp_flag_combination_is_translated_whole() {
    let bench = bench("pk-flags");
    for flags in 0..=u8::MAX {
        let segment = tcp(
            OUTSIDE_ADDR.into(),
            HOST_UPLINK_ADDR.into(),
            30_000 + u16::from(flags),
            8080,
            flags,
            b"data",
        );
        bench.expect_translated(
            &outside_v4(TCP, &segment),
            80,
            &format!("flags {flags:#04x}"),
        );
    }
}

/// A fragmented datagram to a hostPort: its first fragment (which carries the ports) is
/// translated as a whole datagram is, the later ones follow it to the same container; the
/// container's fragmented answer leaves from the hostPort, fragment by fragment. A later
/// fragment whose first never came is no one's.
#[test]
fn fragments_of_a_host_port_datagram_follow_their_first() {
    let bench = bench("pk-fragments");
    let whole = udp(
        OUTSIDE_ADDR.into(),
        HOST_UPLINK_ADDR.into(),
        40_300,
        5353,
        &[7u8; 64],
        true,
    );
    let fragment = |source: Ipv4Addr, more: bool, offset: u16, part: &[u8]| {
        ethernet(
            [0x02, 0xaa, 0, 0, 0, 1],
            OUTSIDE_MAC,
            ETH_P_IP,
            &ipv4(source, HOST_UPLINK_ADDR, UDP, &[], (more, offset), part),
        )
    };
    let stranger = Ipv4Addr::new(203, 0, 113, 3);
    bench.expect_untouched(
        &fragment(stranger, true, 4, &whole[32..48]),
        "a later fragment whose first never came",
    );
    bench.expect_translated(
        &fragment(OUTSIDE_ADDR, true, 0, &whole[..32]),
        53,
        "a first fragment",
    );
    for (more, offset, part, what) in [
        (true, 4, &whole[32..48], "a middle fragment"),
        (false, 6, &whole[48..], "the last fragment"),
    ] {
        let (verdict, out) = bench
            .run(&fragment(OUTSIDE_ADDR, more, offset, part))
            .expect("runs");
        assert_eq!(verdict, REDIRECT, "{what}: handed to the container");
        let parsed = verify(&out).unwrap_or_else(|error| panic!("{what}: {error}"));
        assert_eq!(
            (parsed.src, parsed.dst),
            (
                IpAddr::V4(OUTSIDE_ADDR),
                IpAddr::V4(bench.container.address)
            ),
            "{what}: to the container"
        );
        assert_eq!(
            &out[out.len() - part.len()..],
            part,
            "{what}: its payload untouched (it has no transport header to translate)"
        );
    }
    // The answer, in fragments: from the hostPort's address and port.
    let answer = udp(
        bench.container.address.into(),
        OUTSIDE_ADDR.into(),
        53,
        40_300,
        &[9u8; 64],
        true,
    );
    let sent = |more: bool, offset: u16, part: &[u8]| {
        ethernet(
            [0x02, 0xbb, 0, 0, 0, 1],
            bench.container_mac,
            ETH_P_IP,
            &ipv4(
                bench.container.address,
                OUTSIDE_ADDR,
                UDP,
                &[],
                (more, offset),
                part,
            ),
        )
    };
    for (more, offset, part, ports, what) in [
        (true, 0, &answer[..32], Some((5353, 40_300)), "first"),
        (true, 4, &answer[32..48], None, "middle"),
        (false, 6, &answer[48..], None, "last"),
    ] {
        let (verdict, out) = bench
            .run_from_container(&sent(more, offset, part))
            .expect("runs");
        assert_ne!(verdict, DROP, "the answer's {what} fragment goes out");
        let parsed = verify(&out).unwrap_or_else(|error| panic!("{what}: {error}"));
        assert_eq!(
            (parsed.src, parsed.dst, parsed.ports),
            (
                IpAddr::V4(HOST_UPLINK_ADDR),
                IpAddr::V4(OUTSIDE_ADDR),
                ports
            ),
            "the answer's {what} fragment comes from the hostPort"
        );
        if ports.is_none() {
            assert_eq!(
                &out[out.len() - part.len()..],
                part,
                "the answer's {what} fragment: its payload untouched"
            );
        }
    }
}

/// A closed hostPort connection's tuple, opened again by the container (a SYN from its port
/// to the client's): a new connection of its own, masqueraded, not a reply of the closed one
/// leaving from the hostPort.
#[test]
fn a_container_opening_a_closed_host_port_tuple_is_not_its_reply() {
    let bench = bench("pk-reopen");
    let from_outside = |flags: u8| {
        outside_v4(
            TCP,
            &tcp(
                OUTSIDE_ADDR.into(),
                HOST_UPLINK_ADDR.into(),
                40_020,
                8080,
                flags,
                b"",
            ),
        )
    };
    let own = bench.container.address;
    let from_container = |flags: u8| {
        bench.sent_by_container(
            TCP,
            OUTSIDE_ADDR,
            &tcp(own.into(), OUTSIDE_ADDR.into(), 80, 40_020, flags, b""),
        )
    };
    let source_of = |frame: &[u8], what: &str| {
        let (verdict, out) = bench
            .run_from_container(frame)
            .unwrap_or_else(|| panic!("{what}: the kernel refused the run"));
        assert_ne!(verdict, DROP, "{what}: goes out");
        let parsed = verify(&out).unwrap_or_else(|error| panic!("{what}: {error}: {out:02x?}"));
        (parsed.src, parsed.ports.map(|(sport, _)| sport))
    };
    bench.expect_translated(&from_outside(SYN), 80, "the client's SYN");
    assert_eq!(
        source_of(&from_container(SYN | ACK), "the container's SYN-ACK"),
        (IpAddr::V4(HOST_UPLINK_ADDR), Some(8080)),
        "a reply leaves from the hostPort"
    );
    bench.expect_translated(&from_outside(RST | ACK), 80, "the client's RST");
    let (verdict, out) = bench
        .run_first_out(&from_container(SYN))
        .expect("the container's new SYN runs");
    assert_eq!(verdict, NEXT, "the container's new SYN goes out");
    let parsed = verify(&out).unwrap_or_else(|error| panic!("the new SYN: {error}: {out:02x?}"));
    let (source, port) = (parsed.src, parsed.ports.map(|(sport, _)| sport));
    assert_eq!(
        source,
        IpAddr::V4(HOST_UPLINK_ADDR),
        "masqueraded to the uplink's address"
    );
    assert_ne!(
        port,
        Some(8080),
        "a connection of its own, not the closed one's reply from the hostPort"
    );
}
