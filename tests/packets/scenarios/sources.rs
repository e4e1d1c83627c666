//! Source address verification: a container sends from its own addresses only, and announces
//! only those by ARP and neighbour advertisement; anything else is dropped and counted.

use std::net::Ipv6Addr;

use cnibpf_common::drops::DropReason;
use cnibpf_tests::{
    packet::{ETH_P_IP, SYN, UDP, arp_announcement, ipv4, neighbour_advertisement, udp},
    topology::{GATEWAY, GATEWAY6},
};
use serde_json::{Value, json};

use super::{
    Bench, Body, Expect::*, Frame, Hook::*, Peer::*, Scenario, Step, Then::*, step, v4, v6,
};

const fn custom(frame: fn(&Bench) -> Vec<u8>, expect: super::Expect) -> Step {
    Step {
        hook: FromContainer,
        frame: Frame::Custom(frame),
        expect,
        then: NoState,
    }
}

const TABLE: &[Scenario] = &[
    Scenario {
        name: "what the container sends from its own addresses passes",
        steps: &[
            step(
                FromContainer,
                v4(C1, 44_001, Far, 53, Body::Udp),
                Untouched,
                NoState,
            ),
            step(
                FromContainer,
                v6(C1, 44_001, Far, 53, Body::Udp),
                Untouched,
                NoState,
            ),
        ],
    },
    Scenario {
        name: "an address not its own is dropped, both families",
        steps: &[
            step(
                FromContainer,
                v4(Stranger, 44_002, Far, 53, Body::Udp),
                Dropped(DropReason::SourceCheckAddress),
                NoState,
            ),
            step(
                FromContainer,
                v6(Stranger, 44_002, Far, 80, Body::Tcp(SYN)),
                Dropped(DropReason::SourceCheckAddress),
                NoState,
            ),
        ],
    },
    Scenario {
        name: "its neighbour's address is not its own",
        steps: &[custom(
            neighbours_address,
            Dropped(DropReason::SourceCheckAddress),
        )],
    },
    Scenario {
        name: "an ARP announcement of its own address passes, of the gateway's is dropped",
        steps: &[
            custom(own_arp, Untouched),
            custom(gateway_arp, Dropped(DropReason::SourceCheckArp)),
        ],
    },
    Scenario {
        name: "a neighbour advertisement of its link-local address passes, of the gateway's is dropped, behind options too",
        steps: &[
            custom(own_advertisement, Untouched),
            custom(
                gateway_advertisement,
                Dropped(DropReason::SourceCheckNeighbourAdvertisement),
            ),
            custom(
                gateway_advertisement_behind_options,
                Dropped(DropReason::SourceCheckNeighbourAdvertisement),
            ),
        ],
    },
    Scenario {
        name: "a frame that is neither IP nor ARP is dropped",
        steps: &[custom(lldp, Dropped(DropReason::SourceCheckNotIp))],
    },
];

/// A datagram from c2's address, sent by c1.
fn neighbours_address(bench: &Bench) -> Vec<u8> {
    let (src, dst) = (bench.c2.address, std::net::Ipv4Addr::new(198, 51, 100, 9));
    let datagram = udp(src.into(), dst.into(), 44_003, 53, b"spoofed", true);
    bench.c1_frame(ETH_P_IP, &ipv4(src, dst, UDP, &[], (false, 0), &datagram))
}

fn own_arp(bench: &Bench) -> Vec<u8> {
    arp_announcement(bench.c1_mac(), bench.c1.address)
}

fn gateway_arp(bench: &Bench) -> Vec<u8> {
    arp_announcement(bench.c1_mac(), GATEWAY)
}

/// c1's link-local address: the kernel's EUI-64 of its MAC.
fn link_local(mac: [u8; 6]) -> Ipv6Addr {
    let word = |high: u8, low: u8| u16::from_be_bytes([high, low]);
    Ipv6Addr::new(
        0xfe80,
        0,
        0,
        0,
        word(mac[0] ^ 0x02, mac[1]),
        word(mac[2], 0xff),
        word(0xfe, mac[3]),
        word(mac[4], mac[5]),
    )
}

fn own_advertisement(bench: &Bench) -> Vec<u8> {
    let own = link_local(bench.c1_mac());
    neighbour_advertisement(bench.c1_mac(), own, own, false)
}

fn gateway_advertisement(bench: &Bench) -> Vec<u8> {
    neighbour_advertisement(bench.c1_mac(), link_local(bench.c1_mac()), GATEWAY6, false)
}

fn gateway_advertisement_behind_options(bench: &Bench) -> Vec<u8> {
    neighbour_advertisement(bench.c1_mac(), link_local(bench.c1_mac()), GATEWAY6, true)
}

/// An LLDP frame (ethertype 0x88cc).
fn lldp(bench: &Bench) -> Vec<u8> {
    let mut frame = bench.c1_frame(0x88cc, &[0x02, 0x07, 0x04, 0, 0, 0, 0, 0, 1, 0, 0]);
    frame[..6].copy_from_slice(&[0x01, 0x80, 0xc2, 0, 0, 0x0e]);
    frame
}

#[test]
fn source_check_scenarios() {
    let bench = Bench::new("sc-sources", json!({}), &Value::Null);
    super::run(&bench, TABLE);
}
