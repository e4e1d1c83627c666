//! The datapath packet by packet: the pinned programs of a live attachment run on crafted
//! frames with `BPF_PROG_TEST_RUN`, no traffic, no topology between them. For each frame: the
//! verdict; where a translation applies, the bytes that leave, their checksums verified here
//! independently of the datapath; and no state for a frame that must not make any. Then a
//! seeded random run (`CNIBPF_PACKET_SEED`, `CNIBPF_PACKETS`; 2,000 frames by default).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use cnibpf_tests::{
    Container, SimHost,
    packet::{
        ACK, ETH_P_IP, ETH_P_IPV6, ICMP, ICMPV6, SCTP, SYN, TCP, UDP, ethernet, icmp, icmpv6, ipv4,
        ipv6, sctp, tcp, tcp_with_options, udp, verify,
    },
    topology::{
        HOST_UPLINK_ADDR, HOST_UPLINK_ADDR6, OUTSIDE_ADDR, OUTSIDE_ADDR6, UPLINK, port_mappings,
    },
};
use serde_json::json;

/// `TCX_NEXT` (`TC_ACT_UNSPEC`): on to whatever comes after cnibpf.
const NEXT: i32 = -1;
const DROP: i32 = 2;
/// `bpf_redirect_peer` / `bpf_redirect`: straight to the container (or out of the uplink).
const REDIRECT: i32 = 7;

const OUTSIDE_MAC: [u8; 6] = [0x02, 0xee, 0, 0, 0, 2];
const UPLINK_PROGRAM: &str = "uplink_ingress";

struct Bench {
    sim: SimHost,
    container: Container,
    uplink: u32,
    /// The container's host-side veth.
    veth: u32,
    container_mac: [u8; 6],
}

fn bench(id: &str) -> Bench {
    bench_with(id, json!({ "ipMasq": true }))
}

/// [`bench`] with cnibpf's entry holding `keys`.
fn bench_with(id: &str, keys: serde_json::Value) -> Bench {
    let sim = SimHost::new(id, keys);
    let mut mappings = port_mappings(&[(8080, 80, "tcp"), (5353, 53, "udp")]);
    mappings["portMappings"]
        .as_array_mut()
        .expect("a list")
        .extend([
            json!({ "hostPort": 9999, "containerPort": 9999, "protocol": "sctp" }),
            json!({ "hostPort": 9132, "containerPort": 132, "protocol": "sctp" }),
        ]);
    let container = sim.container("c1", mappings);
    let uplink = interface_index(&sim, UPLINK);
    let veth = interface_index(&sim, &sim.host_interface(&container));
    let container_mac = container.result["interfaces"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|interface| interface.get("sandbox").is_some())
        .and_then(|interface| interface["mac"].as_str())
        .map(mac)
        .expect("the container's MAC in its result");
    Bench {
        sim,
        container,
        uplink,
        veth,
        container_mac,
    }
}

fn interface_index(sim: &SimHost, name: &str) -> u32 {
    let line = sim.host.exec(&["ip", "-o", "link", "show", "dev", name]);
    line.split(':')
        .next()
        .and_then(|index| index.trim().parse().ok())
        .unwrap_or_else(|| panic!("no index for {name} in {line:?}"))
}

fn mac(text: &str) -> [u8; 6] {
    let bytes: Vec<u8> = text
        .split(':')
        .map(|part| u8::from_str_radix(part, 16).expect("hex"))
        .collect();
    bytes.try_into().expect("six bytes")
}

fn outside_v4(protocol: u8, l4: &[u8]) -> Vec<u8> {
    ethernet(
        [0x02, 0xaa, 0, 0, 0, 1],
        OUTSIDE_MAC,
        ETH_P_IP,
        &ipv4(
            OUTSIDE_ADDR,
            HOST_UPLINK_ADDR,
            protocol,
            &[],
            (false, 0),
            l4,
        ),
    )
}

fn outside_v6(next_header: u8, payload: &[u8]) -> Vec<u8> {
    ethernet(
        [0x02, 0xaa, 0, 0, 0, 1],
        OUTSIDE_MAC,
        ETH_P_IPV6,
        &ipv6(OUTSIDE_ADDR6, HOST_UPLINK_ADDR6, next_header, payload),
    )
}

fn syn_v4(flags: u8) -> Vec<u8> {
    outside_v4(
        TCP,
        &tcp(
            OUTSIDE_ADDR.into(),
            HOST_UPLINK_ADDR.into(),
            40_000,
            8080,
            flags,
            b"",
        ),
    )
}

impl Bench {
    fn run(&self, frame: &[u8]) -> Option<(i32, Vec<u8>)> {
        self.sim.test_run(UPLINK_PROGRAM, self.uplink, frame)
    }

    /// Runs `frame` as the container sends it (its veth's tcx ingress).
    fn run_from_container(&self, frame: &[u8]) -> Option<(i32, Vec<u8>)> {
        self.sim.test_run("from_container", self.veth, frame)
    }

    /// A frame the container sends to `dst` (IPv4).
    fn sent_by_container(&self, protocol: u8, dst: Ipv4Addr, l4: &[u8]) -> Vec<u8> {
        ethernet(
            [0x02, 0xbb, 0, 0, 0, 1],
            self.container_mac,
            ETH_P_IP,
            &ipv4(self.container.address, dst, protocol, &[], (false, 0), l4),
        )
    }

    /// A frame the container sends to `dst` (IPv6), `payload` starting with `next_header`'s.
    fn sent_by_container_v6(&self, next_header: u8, dst: Ipv6Addr, payload: &[u8]) -> Vec<u8> {
        ethernet(
            [0x02, 0xbb, 0, 0, 0, 1],
            self.container_mac,
            ETH_P_IPV6,
            &ipv6(self.container.address6, dst, next_header, payload),
        )
    }

    /// Runs `frame` through the uplink's ingress, expecting it translated to the container's
    /// `port`: the verdict, the address, the port, the MAC, and every checksum.
    fn expect_translated(&self, frame: &[u8], port: u16, what: &str) {
        let (verdict, out) = self
            .run(frame)
            .unwrap_or_else(|| panic!("{what}: the kernel refused the run"));
        assert_eq!(verdict, REDIRECT, "{what}: handed to the container");
        let parsed = verify(&out).unwrap_or_else(|error| panic!("{what}: {error}: {out:02x?}"));
        let family = if parsed.dst.is_ipv4() {
            cnibpf_tests::topology::Family::V4
        } else {
            cnibpf_tests::topology::Family::V6
        };
        assert_eq!(
            parsed.dst,
            self.container.at(family, 0).ip(),
            "{what}: to the container"
        );
        assert_eq!(
            parsed.ports.map(|(_, dport)| dport),
            Some(port),
            "{what}: its port"
        );
        assert_eq!(parsed.dst_mac, self.container_mac, "{what}: its MAC");
    }

    /// Runs `frame` expecting it passed on untouched, and no flow state made for it.
    fn expect_untouched(&self, frame: &[u8], what: &str) {
        let before = self.sim.flow_counts();
        match self.run(frame) {
            None => assert!(refusable(frame), "{what}: the kernel refused a run"),
            Some((verdict, out)) => {
                assert!(
                    verdict == NEXT || verdict == DROP,
                    "{what}: verdict {verdict} for a frame that is no one's"
                );
                if verdict == NEXT {
                    assert_eq!(out, frame, "{what}: passed on changed");
                }
            }
        }
        assert_eq!(self.sim.flow_counts(), before, "{what}: made state");
    }
}

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
        .run_from_container(&bench.sent_by_container(TCP, far, &segment))
        .expect("runs");
    assert_eq!(verdict, REDIRECT, "sent straight out of the uplink");
    let parsed = verify(&out).unwrap_or_else(|error| panic!("masqueraded: {error}"));
    assert_eq!(
        parsed.src,
        IpAddr::V4(HOST_UPLINK_ADDR),
        "from the uplink's address"
    );
    assert_eq!(parsed.dst, IpAddr::V4(far));
}

/// A masqueraded flow's first packet makes its state; the later ones take it (the header
/// rewritten in one write, its checksum computed by the program): every one leaves from the
/// uplink's address and the flow's port, one hop fewer, with valid checksums — TCP, UDP, and
/// UDP without a checksum, which stays without one.
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
            let (verdict, out) = bench
                .run_from_container(&frame)
                .unwrap_or_else(|| panic!("{what} #{index}: the kernel refused the run"));
            assert_eq!(verdict, REDIRECT, "{what} #{index}: sent out of the uplink");
            let parsed =
                verify(&out).unwrap_or_else(|error| panic!("{what} #{index}: {error}: {out:02x?}"));
            assert_eq!(
                parsed.src,
                IpAddr::V4(HOST_UPLINK_ADDR),
                "{what} #{index}: from the uplink's address"
            );
            assert_eq!(
                out[14 + 8],
                frame[14 + 8] - 1,
                "{what} #{index}: one hop fewer"
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
/// segment with each arrangement leaves masqueraded (from the uplink's address, one hop fewer,
/// the headers as they were, every checksum valid); the filter's rules see the ports past
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
            .run_from_container(&frame)
            .unwrap_or_else(|| panic!("{what}: the kernel refused the run"));
        assert_eq!(verdict, REDIRECT, "{what}: masqueraded out of the uplink");
        let parsed = verify(&out).unwrap_or_else(|error| panic!("{what}: {error}: {out:02x?}"));
        assert_eq!(
            parsed.src,
            IpAddr::V6(HOST_UPLINK_ADDR6),
            "{what}: from the uplink's address"
        );
        assert_eq!(out[14 + 7], frame[14 + 7] - 1, "{what}: one hop fewer");
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

/// Whether the kernel refuses to run a program on `frame`: it builds an skb of an Ethernet
/// header and a whole IP header at least.
fn refusable(frame: &[u8]) -> bool {
    let network = match frame.get(12..14) {
        Some([0x86, 0xdd]) => 40,
        _ => 20,
    };
    frame.len() < 14 + network
}

/// xorshift64*: the random run must be reproducible from its seed.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, bound: usize) -> usize {
        usize::try_from(self.next() % bound as u64).unwrap_or(0)
    }
}

/// A TCP option of `kind` with random contents: MSS, window scale, SACK permitted, timestamps,
/// or a NOP.
fn tcp_option(random: &mut Random) -> Vec<u8> {
    let mut bytes = |count: usize| -> Vec<u8> {
        (0..count)
            .map(|_| u8::try_from(random.next() & 0xff).unwrap_or(0))
            .collect()
    };
    match bytes(1)[0] % 5 {
        0 => [vec![2, 4], bytes(2)].concat(),
        1 => [vec![3, 3], bytes(1)].concat(),
        2 => vec![4, 2],
        3 => [vec![8, 10], bytes(8)].concat(),
        _ => vec![1],
    }
}

/// An IPv6 extension header of `kind` (hop-by-hop, routing with no segments left, destination
/// options), `words` times 8 bytes, leading to `next`.
fn extension_header(kind: u8, next: u8, words: u8) -> Vec<u8> {
    let length = usize::from(words) * 8;
    let mut header = vec![0u8; length];
    header[0] = next;
    header[1] = words - 1;
    if kind == 43 {
        // Type 0, no segments left: the destination is the final one.
        return header;
    }
    // One PadN option filling the rest.
    header[2] = 1;
    header[3] = u8::try_from(length - 4).expect("short");
    header
}

/// A well-formed frame with random fields, and whether the container sends it (else it comes
/// from outside to the uplink): family, protocol, ports (mostly the mapped ones inward), TCP
/// flags and options, payload length, IPv4 options, IPv6 extension headers; every checksum
/// valid.
fn random_frame(bench: &Bench, random: &mut Random) -> (Vec<u8>, bool) {
    let outward = random.below(3) == 0;
    let v6 = random.below(2) == 0;
    let far4 = Ipv4Addr::new(198, 51, 100, 9);
    let far6: Ipv6Addr = "2001:db8:9::9".parse().expect("literal");
    let hairpin = random.below(4) == 0;
    let (src, dst): (IpAddr, IpAddr) = match (outward, v6, hairpin) {
        (false, false, _) => (OUTSIDE_ADDR.into(), HOST_UPLINK_ADDR.into()),
        (false, true, _) => (OUTSIDE_ADDR6.into(), HOST_UPLINK_ADDR6.into()),
        (true, false, true) => (bench.container.address.into(), HOST_UPLINK_ADDR.into()),
        (true, false, false) => (bench.container.address.into(), far4.into()),
        (true, true, true) => (bench.container.address6.into(), HOST_UPLINK_ADDR6.into()),
        (true, true, false) => (bench.container.address6.into(), far6.into()),
    };
    let protocol = [TCP, TCP, UDP, UDP, SCTP, if v6 { ICMPV6 } else { ICMP }][random.below(6)];
    let random_port = |random: &mut Random| u16::try_from(1 + random.below(65_535)).unwrap_or(1);
    let sport = random_port(random);
    // Mostly a port that protocol has a hostPort on (or a service, for the container).
    let dport = match (random.below(5), protocol) {
        (0, _) => random_port(random),
        (1, _) => [443, 53][random.below(2)],
        (_, TCP) => 8080,
        (_, UDP) => 5353,
        (_, SCTP) => [9999, 9132][random.below(2)],
        _ => random_port(random),
    };
    let payload: Vec<u8> = (0..random.below(200))
        .map(|_| u8::try_from(random.next() & 0xff).unwrap_or(0))
        .collect();
    let l4 = match protocol {
        TCP => {
            let options: Vec<u8> = (0..random.below(5))
                .flat_map(|_| tcp_option(random))
                .take(40)
                .collect();
            let flags = u8::try_from(random.next() & 0x3f).unwrap_or(SYN);
            tcp_with_options(src, dst, sport, dport, flags, &options, &payload)
        }
        UDP => udp(src, dst, sport, dport, &payload, v6 || random.below(4) != 0),
        SCTP => sctp(sport, dport, &payload),
        _ => {
            let [id_high, id_low] = sport.to_be_bytes();
            let rest = [id_high, id_low, 0, 1];
            match (src, dst) {
                (IpAddr::V6(src), IpAddr::V6(dst)) => icmpv6(src, dst, 128, 0, rest, &payload),
                _ => icmp(8, 0, rest, &payload),
            }
        }
    };
    let packet = match (src, dst) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => {
            let options = vec![1u8; 4 * random.below(3) * random.below(4)];
            ipv4(src, dst, protocol, &options, (false, 0), &l4)
        }
        (IpAddr::V6(src), IpAddr::V6(dst)) => {
            let kinds: Vec<u8> = (0..random.below(4))
                .map(|_| [0u8, 43, 60][random.below(3)])
                .collect();
            // Hop-by-hop only first, as a sender puts it.
            let kinds: Vec<u8> = kinds
                .iter()
                .enumerate()
                .filter(|(position, kind)| **kind != 0 || *position == 0)
                .map(|(_, kind)| *kind)
                .collect();
            let mut payload = Vec::new();
            for (position, kind) in kinds.iter().enumerate() {
                let next = kinds.get(position + 1).copied().unwrap_or(protocol);
                let words = u8::try_from(1 + random.below(2)).unwrap_or(1);
                payload.extend(extension_header(*kind, next, words));
            }
            payload.extend(&l4);
            ipv6(
                src,
                dst,
                kinds.first().copied().unwrap_or(protocol),
                &payload,
            )
        }
        _ => unreachable!("addresses of one family"),
    };
    let frame = if outward {
        ethernet(
            [0x02, 0xbb, 0, 0, 0, 1],
            bench.container_mac,
            if v6 { ETH_P_IPV6 } else { ETH_P_IP },
            &packet,
        )
    } else {
        ethernet(
            [0x02, 0xaa, 0, 0, 0, 1],
            OUTSIDE_MAC,
            if v6 { ETH_P_IPV6 } else { ETH_P_IP },
            &packet,
        )
    };
    (frame, outward)
}

/// The container port a hostPort maps `protocol`/`port` to (the bench's mappings).
fn mapped(protocol: u8, port: u16) -> Option<u16> {
    match (protocol, port) {
        (TCP, 8080) => Some(80),
        (UDP, 5353) => Some(53),
        (SCTP, 9999) => Some(9999),
        (SCTP, 9132) => Some(132),
        _ => None,
    }
}

/// Well-formed frames with random fields, and a tenth of them damaged: the kernel runs every
/// one, the verdict is one of cnibpf's, and whatever leaves from a well-formed frame carries
/// valid checksums (or is the frame itself); one from outside to a mapped hostPort goes to the
/// container's port. Prints the share of frames whose output was compared.
#[test]
fn random_frames_never_leave_with_broken_checksums() {
    let bench = bench("pk-random");
    let seed = std::env::var("CNIBPF_PACKET_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or(0x5eed_c0de_u64);
    let count: usize = std::env::var("CNIBPF_PACKETS")
        .ok()
        .and_then(|count| count.parse().ok())
        .unwrap_or(2_000);
    let mut random = Random(seed | 1);
    let (mut well_formed, mut compared, mut translated) = (0, 0, 0);
    for round in 0..count {
        let (mut frame, outward) = random_frame(&bench, &mut random);
        let damaged = random.below(10) == 0;
        if damaged {
            for _ in 0..1 + random.below(4) {
                let at = 14 + random.below(frame.len() - 14);
                frame[at] = u8::try_from(random.next() & 0xff).unwrap_or(0);
            }
            match random.below(3) {
                0 => frame.truncate(14 + random.below(frame.len() - 13)),
                1 => frame.extend(std::iter::repeat_n(0xa5, random.below(64))),
                _ => {}
            }
        }
        let parsed_in = verify(&frame).ok();
        let ran = if outward {
            bench.run_from_container(&frame)
        } else {
            bench.run(&frame)
        };
        let context = format!("round {round} (seed {seed:#x}): {frame:02x?}");
        let Some((verdict, out)) = ran else {
            assert!(refusable(&frame), "{context}: the kernel refused the run");
            continue;
        };
        assert!(
            [NEXT, DROP, REDIRECT].contains(&verdict),
            "{context}: verdict {verdict}"
        );
        let Some(parsed_in) = parsed_in else {
            continue;
        };
        well_formed += 1;
        if verdict == DROP {
            continue;
        }
        compared += 1;
        // Only an undamaged frame is known to be for the hostPort: a damaged one that still
        // verifies may have lost that (SCTP's checksum covers no IP header).
        let to_host_port = !outward && !damaged;
        let mapped_port = mapped(
            parsed_in.protocol,
            parsed_in.ports.map_or(0, |(_, dport)| dport),
        )
        .filter(|_| to_host_port);
        if out != frame {
            let parsed_out =
                verify(&out).unwrap_or_else(|error| panic!("{context}: {error} -> {out:02x?}"));
            if let Some(port) = mapped_port {
                assert_eq!(verdict, REDIRECT, "{context}: handed to the container");
                let family = if parsed_out.dst.is_ipv4() {
                    cnibpf_tests::topology::Family::V4
                } else {
                    cnibpf_tests::topology::Family::V6
                };
                assert_eq!(
                    (parsed_out.dst, parsed_out.ports.map(|(_, dport)| dport)),
                    (bench.container.at(family, 0).ip(), Some(port)),
                    "{context}: to the container's port"
                );
                translated += 1;
            }
        } else if let Some(port) = mapped_port {
            panic!("{context}: a frame to a hostPort (container port {port}) left untranslated");
        }
    }
    let share = |part: usize| part * 100 / count.max(1);
    eprintln!(
        "random frames (seed {seed:#x}): {count} run, {well_formed} well-formed ({}%), {compared} outputs compared ({}%), {translated} translated to a container and checked",
        share(well_formed),
        share(compared)
    );
    assert!(
        share(compared) >= 75,
        "only {compared} of {count} outputs were compared"
    );
    assert!(
        translated > count / 5,
        "only {translated} frames reached a hostPort"
    );
}
