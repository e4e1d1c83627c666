//! What the parser walks, follows or leaves alone: IPv4 options, IPv6 extension headers,
//! fragments of a hostPort datagram, and malformed frames, none of which makes state.

use cnibpf_common::connections::PART_DNAT;
use cnibpf_tests::{
    packet::{ETH_P_IP, ETH_P_IPV6, SYN, TCP, UDP, ipv4, ipv6, tcp, udp},
    topology::{HOST_UPLINK_ADDR, HOST_UPLINK_ADDR6, OUTSIDE_ADDR, OUTSIDE_ADDR6},
};
use serde_json::json;

use super::{Bench, Expect, Expect::*, Frame, Hook::*, Peer::*, Scenario, Step, Then, Then::*, at};
use crate::extension_header;

const fn outside(frame: fn(&Bench) -> Vec<u8>, expect: Expect, then: Then) -> Step {
    Step {
        hook: UplinkIngress,
        frame: Frame::Custom(frame),
        expect,
        then,
    }
}

const TABLE: &[Scenario] = &[
    Scenario {
        name: "a SYN with IPv4 options is translated past them",
        steps: &[outside(
            with_options,
            Redirected(at(Outside, 45_001), at(C1, 80)),
            Parts(PART_DNAT),
        )],
    },
    Scenario {
        name: "a SYN behind hop-by-hop, routing (no segments left) and destination options headers is translated past them",
        steps: &[outside(
            behind_extension_headers,
            Redirected(at(Outside, 45_002), at(C1, 80)),
            Parts(PART_DNAT),
        )],
    },
    Scenario {
        name: "a routing header with segments left is not for this host: left alone",
        steps: &[outside(routed_onwards, Untouched, NoState)],
    },
    Scenario {
        name: "a hostPort datagram in two fragments: the later follows its first to the container",
        steps: &[
            outside(
                first_fragment,
                Redirected(at(Outside, 45_004), at(C1, 53)),
                Nothing,
            ),
            outside(
                later_fragment,
                Redirected(at(Outside, 0), at(C1, 0)),
                Nothing,
            ),
        ],
    },
    Scenario {
        name: "a later fragment whose first never came is the host's",
        steps: &[outside(orphan_fragment, Untouched, NoState)],
    },
    Scenario {
        name: "an IPv4 header length below five words is no packet to translate",
        steps: &[outside(short_header_length, Untouched, NoState)],
    },
    Scenario {
        name: "a SYN cut inside its TCP header is no packet to translate",
        steps: &[outside(cut_segment, Untouched, NoState)],
    },
];

fn syn(sport: u16) -> Vec<u8> {
    tcp(
        OUTSIDE_ADDR.into(),
        HOST_UPLINK_ADDR.into(),
        sport,
        8080,
        SYN,
        b"",
    )
}

fn to_uplink(
    bench: &Bench,
    options: &[u8],
    protocol: u8,
    fragment: (bool, u16),
    payload: &[u8],
) -> Vec<u8> {
    let packet = ipv4(
        OUTSIDE_ADDR,
        HOST_UPLINK_ADDR,
        protocol,
        options,
        fragment,
        payload,
    );
    bench.outside_frame(ETH_P_IP, &packet)
}

fn with_options(bench: &Bench) -> Vec<u8> {
    to_uplink(bench, &[1; 12], TCP, (false, 0), &syn(45_001))
}

fn to_uplink6(bench: &Bench, first: u8, headers: &[u8], segment: &[u8]) -> Vec<u8> {
    let payload = [headers, segment].concat();
    bench.outside_frame(
        ETH_P_IPV6,
        &ipv6(OUTSIDE_ADDR6, HOST_UPLINK_ADDR6, first, &payload),
    )
}

fn syn6(sport: u16) -> Vec<u8> {
    tcp(
        OUTSIDE_ADDR6.into(),
        HOST_UPLINK_ADDR6.into(),
        sport,
        8080,
        SYN,
        b"",
    )
}

fn behind_extension_headers(bench: &Bench) -> Vec<u8> {
    let headers = [
        extension_header(0, 43, 1),
        extension_header(43, 60, 1),
        extension_header(60, TCP, 2),
    ]
    .concat();
    to_uplink6(bench, 0, &headers, &syn6(45_002))
}

fn routed_onwards(bench: &Bench) -> Vec<u8> {
    let mut routing = extension_header(43, TCP, 1);
    routing[3] = 1;
    to_uplink6(bench, 43, &routing, &syn6(45_003))
}

/// A UDP datagram from port `sport` to hostPort 5353, 32 bytes in all: its first 24 bytes and
/// its last 8, as two fragments.
fn datagram(sport: u16) -> Vec<u8> {
    udp(
        OUTSIDE_ADDR.into(),
        HOST_UPLINK_ADDR.into(),
        sport,
        5353,
        &[7; 24],
        true,
    )
}

fn first_fragment(bench: &Bench) -> Vec<u8> {
    to_uplink(bench, &[], UDP, (true, 0), &datagram(45_004)[..24])
}

fn later_fragment(bench: &Bench) -> Vec<u8> {
    to_uplink(bench, &[], UDP, (false, 3), &datagram(45_004)[24..])
}

fn orphan_fragment(bench: &Bench) -> Vec<u8> {
    let mut frame = to_uplink(bench, &[], UDP, (false, 3), &datagram(45_005)[24..]);
    // Another identification than the first fragment's above (every crafted one has 0x1234).
    frame[14 + 4..14 + 6].copy_from_slice(&0x4321u16.to_be_bytes());
    frame[14 + 10..14 + 12].fill(0);
    let sum = cnibpf_tests::packet::checksum(&[&frame[14..34]]);
    frame[14 + 10..14 + 12].copy_from_slice(&sum.to_be_bytes());
    frame
}

fn short_header_length(bench: &Bench) -> Vec<u8> {
    let mut frame = to_uplink(bench, &[], TCP, (false, 0), &syn(45_006));
    frame[14] = 0x44;
    frame
}

fn cut_segment(bench: &Bench) -> Vec<u8> {
    let frame = to_uplink(bench, &[], TCP, (false, 0), &syn(45_007));
    frame[..14 + 20 + 12].to_vec()
}

#[test]
fn header_scenarios() {
    let mappings = json!({ "portMappings": [
        { "hostPort": 8080, "containerPort": 80, "protocol": "tcp" },
        { "hostPort": 5353, "containerPort": 53, "protocol": "udp" },
    ]});
    let bench = Bench::new("sc-headers", json!({ "ipMasq": true }), &mappings);
    super::run(&bench, TABLE);
}
