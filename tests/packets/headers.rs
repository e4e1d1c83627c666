//! Headers the parser walks or refuses: truncations, IPv4 options, IPv6 extension headers,
//! ICMP errors quoting cut packets.

use super::*;

#[test]
fn every_truncation_passes_untouched_and_makes_no_state() {
    let bench = bench("pk-truncate");
    let echo = icmp(8, 0, [0, 7, 0, 1], b"ping");
    let frames = [
        ("TCP", syn_v4(SYN)),
        ("UDP", {
            let datagram = udp(
                OUTSIDE_ADDR.into(),
                HOST_UPLINK_ADDR.into(),
                1,
                5353,
                b"q",
                true,
            );
            outside_v4(UDP, &datagram)
        }),
        ("SCTP", outside_v4(SCTP, &sctp(1, 9999, b"c"))),
        ("ICMP echo", outside_v4(ICMP, &echo)),
        ("TCP over IPv6", {
            let segment = tcp(
                OUTSIDE_ADDR6.into(),
                HOST_UPLINK_ADDR6.into(),
                1,
                8080,
                SYN,
                b"",
            );
            outside_v6(TCP, &segment)
        }),
    ];
    for (what, frame) in frames {
        // The whole frame, cut anywhere short of its transport header's end: the headers say
        // more than is there.
        let transport_end = frame.len() - 1;
        for length in 0..transport_end.min(frame.len()) {
            bench.expect_untouched(&frame[..length], &format!("{what} cut at {length}"));
        }
    }
}

#[test]
fn ipv4_options_are_translated_past_and_bad_header_lengths_are_not() {
    let bench = bench("pk-options");
    for words in 1..=10usize {
        let options = vec![1u8; words * 4]; // NOPs
        let segment = tcp(
            OUTSIDE_ADDR.into(),
            HOST_UPLINK_ADDR.into(),
            40_100,
            8080,
            SYN,
            b"",
        );
        let frame = ethernet(
            [0x02, 0xaa, 0, 0, 0, 1],
            OUTSIDE_MAC,
            ETH_P_IP,
            &ipv4(
                OUTSIDE_ADDR,
                HOST_UPLINK_ADDR,
                TCP,
                &options,
                (false, 0),
                &segment,
            ),
        );
        bench.expect_translated(&frame, 80, &format!("{} bytes of options", words * 4));
    }
    for ihl in 0..5u8 {
        let mut frame = syn_v4(SYN);
        frame[14] = 0x40 | ihl;
        bench.expect_untouched(&frame, &format!("IHL {ihl}"));
    }
}

#[test]
fn ipv6_extension_headers_are_translated_past() {
    let bench = bench("pk-exthdr");
    let segment = tcp(
        OUTSIDE_ADDR6.into(),
        HOST_UPLINK_ADDR6.into(),
        40_200,
        8080,
        SYN,
        b"",
    );
    // An 8-byte header of `kind` leading to `next` (PadN options; a routing header of type 0
    // with `segments_left`).
    let header = |next: u8, kind: u8, segments_left: u8| {
        if kind == 43 {
            vec![next, 0, 0, segments_left, 0, 0, 0, 0]
        } else {
            vec![next, 0, 1, 4, 0, 0, 0, 0]
        }
    };
    // Hop-by-hop, routing with no segments left (the destination is final), destination
    // options, and all three in a row: translated past, the checksum verified by the test.
    for (first, headers) in [
        (0u8, header(TCP, 0, 0)),
        (43, header(TCP, 43, 0)),
        (60, header(TCP, 60, 0)),
        (
            0,
            [header(43, 0, 0), header(60, 43, 0), header(TCP, 60, 0)].concat(),
        ),
    ] {
        let mut payload = headers.clone();
        payload.extend(&segment);
        bench.expect_translated(
            &outside_v6(first, &payload),
            80,
            &format!("extension headers from {first}, {} bytes", headers.len()),
        );
    }
    // A routing header with segments left (the destination is not the final one), an
    // experimental header, five headers (more than are walked): left alone.
    let mut routed = header(TCP, 43, 1);
    routed.extend(&segment);
    bench.expect_untouched(&outside_v6(43, &routed), "segments left");
    let mut experimental = header(TCP, 253, 0);
    experimental.extend(&segment);
    bench.expect_untouched(&outside_v6(253, &experimental), "experimental header");
    let mut five = [
        header(60, 0, 0),
        header(60, 60, 0),
        header(60, 60, 0),
        header(60, 60, 0),
        header(TCP, 60, 0),
    ]
    .concat();
    five.extend(&segment);
    bench.expect_untouched(&outside_v6(0, &five), "five extension headers");
}

/// The arrangements of IPv6 extension headers a sender puts before the transport header:
/// hop-by-hop, routing with no segments left, destination options, and all three in a row —
/// (the first header's number, the headers, leading to `next`).
fn extension_chains(next: u8) -> Vec<(u8, Vec<u8>)> {
    vec![
        (0, extension_header(0, next, 1)),
        (43, extension_header(43, next, 1)),
        (60, extension_header(60, next, 2)),
        (
            0,
            [
                extension_header(0, 43, 1),
                extension_header(43, 60, 1),
                extension_header(60, next, 1),
            ]
            .concat(),
        ),
    ]
}

/// IPv6 extension headers in front of what masquerade and the filter read: a container's
/// segment with each arrangement leaves masqueraded (from the uplink's address, the headers as
/// they were, every checksum valid; its connection's later segment one hop fewer); the filter's rules see the ports past
/// them, both ways — an egress rule drops the container's segment to its port and an ingress
/// rule the hostPort segment to its container port, while the next port passes.
#[test]
fn ipv6_extension_headers_are_masqueraded_and_filtered_past() {
    let bench = bench_with(
        "pk-ext6",
        json!({ "ipMasq": true, "filter": [
            { "index": 1, "direction": "egress", "proto": "tcp", "dport": 9, "target": "DROP" },
            { "index": 2, "direction": "ingress", "proto": "tcp", "dport": 80, "target": "DROP" },
        ]}),
    );
    let far: Ipv6Addr = "2001:db8:9::9".parse().expect("literal");
    let own = bench.container.address6;
    for ((first, headers), (_, udp_headers)) in
        extension_chains(TCP).into_iter().zip(extension_chains(UDP))
    {
        let what = format!("extension headers from {first}, {} bytes", headers.len());
        let with_headers = |segment: Vec<u8>| [headers.clone(), segment].concat();
        let frame = bench.sent_by_container_v6(
            first,
            far,
            &with_headers(tcp(own.into(), far.into(), 41_200, 443, SYN, b"")),
        );
        let (verdict, out) = bench
            .run_first_out(&frame)
            .unwrap_or_else(|| panic!("{what}: the kernel refused the run"));
        assert_eq!(verdict, NEXT, "{what}: masqueraded out of the uplink");
        let parsed = verify(&out).unwrap_or_else(|error| panic!("{what}: {error}: {out:02x?}"));
        assert_eq!(
            parsed.src,
            IpAddr::V6(HOST_UPLINK_ADDR6),
            "{what}: from the uplink's address"
        );
        let later = bench.sent_by_container_v6(
            first,
            far,
            &with_headers(tcp(own.into(), far.into(), 41_200, 443, ACK, b"")),
        );
        let (verdict, fast) = bench
            .run_from_container(&later)
            .unwrap_or_else(|| panic!("{what}: the kernel refused the run"));
        assert_eq!(
            verdict, REDIRECT,
            "{what}: the later segment sent out of the uplink"
        );
        verify(&fast).unwrap_or_else(|error| panic!("{what}, later: {error}: {fast:02x?}"));
        assert_eq!(fast[14 + 7], later[14 + 7] - 1, "{what}: one hop fewer");
        assert_eq!(
            out[14 + 40..14 + 40 + headers.len()],
            headers[..],
            "{what}: the extension headers as they were"
        );
        let dropped = bench.sent_by_container_v6(
            first,
            far,
            &with_headers(tcp(own.into(), far.into(), 41_201, 9, SYN, b"")),
        );
        assert_eq!(
            bench
                .run_from_container(&dropped)
                .map(|(verdict, _)| verdict),
            Some(DROP),
            "{what}: the egress rule sees the port past them"
        );
        let (outside, uplink) = (OUTSIDE_ADDR6.into(), HOST_UPLINK_ADDR6.into());
        let to_tcp_host_port = outside_v6(
            first,
            &with_headers(tcp(outside, uplink, 40_300, 8080, SYN, b"")),
        );
        let (verdict, _) = bench
            .run(&to_tcp_host_port)
            .unwrap_or_else(|| panic!("{what}: the kernel refused the run"));
        assert_eq!(
            verdict, DROP,
            "{what}: the ingress rule sees container port 80 past them"
        );
        let to_udp_host_port = outside_v6(
            first,
            &[udp_headers, udp(outside, uplink, 40_301, 5353, b"q", true)].concat(),
        );
        bench.expect_translated(&to_udp_host_port, 53, &what);
    }
}

/// ICMPv6 errors (destination unreachable, packet too big) quoting a masqueraded datagram cut
/// at every length: none makes state or leaves changed, however little of the quote is left.
#[test]
fn icmpv6_errors_quoting_cut_packets_make_no_state() {
    let bench = bench("pk-icmp6");
    let far: Ipv6Addr = "2001:db8:9::9".parse().expect("literal");
    let sent = ipv6(
        HOST_UPLINK_ADDR6,
        far,
        UDP,
        &udp(HOST_UPLINK_ADDR6.into(), far.into(), 50_000, 53, b"q", true),
    );
    for (kind, code, rest, name) in [
        (1u8, 4u8, [0u8; 4], "port unreachable"),
        (2, 0, 1280u32.to_be_bytes(), "packet too big"),
    ] {
        for length in 0..=sent.len() {
            let error = icmpv6(
                OUTSIDE_ADDR6,
                HOST_UPLINK_ADDR6,
                kind,
                code,
                rest,
                &sent[..length],
            );
            bench.expect_untouched(
                &outside_v6(ICMPV6, &error),
                &format!("{name} quoting {length} bytes"),
            );
        }
    }
}

#[test]
fn icmp_errors_quoting_cut_packets_make_no_state() {
    let bench = bench("pk-icmp");
    // What the host once sent out (a masqueraded datagram), quoted back by a router.
    let sent = ipv4(
        HOST_UPLINK_ADDR,
        Ipv4Addr::new(198, 51, 100, 9),
        UDP,
        &[],
        (false, 0),
        &udp(
            HOST_UPLINK_ADDR.into(),
            Ipv4Addr::new(198, 51, 100, 9).into(),
            50_000,
            53,
            b"q",
            true,
        ),
    );
    for length in 0..=sent.len() {
        let error = icmp(3, 3, [0; 4], &sent[..length]);
        bench.expect_untouched(
            &outside_v4(ICMP, &error),
            &format!("port unreachable quoting {length} bytes"),
        );
    }
}
