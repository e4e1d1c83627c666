//! Masquerade: a container's new connection crosses the host stack and leaves the uplink's
//! egress from the uplink's address, its replies come back to it, its later packets take the
//! fast path, ICMP errors are translated both ways (packet too big included), a port
//! another container holds is not taken twice, exclusions and the containers' own subnet are
//! left alone, and what cannot be translated makes no state.
//!
//! Both containers are masqueraded, `ipMasqExclude` is 192.168.0.0/16 and fd00:99::/64.

use cnibpf_common::connections::PART_SNAT;
use cnibpf_tests::packet::{ACK, RST, SYN};
use serde_json::{Value, json};

use super::{
    Bench, Body, Expect::*, Hook::*, Peer::*, Port, Scenario, Then::*, at, run, step, v4, v6,
};

/// The datagram c1 sent from `port` to Far's port 53, as it left (from the uplink's address)
/// and as the remote quotes it back in an ICMP error.
const fn sent_from(port: u16) -> super::Packet {
    v4(Uplink, port, Far, 53, Body::Udp)
}

const TABLE: &[Scenario] = &[
    Scenario {
        name: "a TCP SYN leaves from the uplink's address, keeping its port",
        steps: &[
            step(
                FromContainer,
                v4(C1, 42_001, Far, 443, Body::Tcp(SYN)),
                Untouched,
                NoState,
            ),
            step(
                UplinkEgress,
                v4(C1, 42_001, Far, 443, Body::Tcp(SYN)),
                Rewritten(at(Uplink, 42_001), at(Far, 443)),
                Parts(PART_SNAT),
            ),
        ],
    },
    Scenario {
        name: "the same over IPv6",
        steps: &[
            step(
                FromContainer,
                v6(C1, 42_002, Far, 443, Body::Tcp(SYN)),
                Untouched,
                NoState,
            ),
            step(
                UplinkEgress,
                v6(C1, 42_002, Far, 443, Body::Tcp(SYN)),
                Rewritten(at(Uplink, 42_002), at(Far, 443)),
                Parts(PART_SNAT),
            ),
        ],
    },
    Scenario {
        name: "a TCP connection's replies come back to the container, its later segments go out alike",
        steps: &[
            step(
                FromContainer,
                v4(C1, 42_003, Far, 443, Body::Tcp(SYN)),
                Untouched,
                NoState,
            ),
            step(
                UplinkEgress,
                v4(C1, 42_003, Far, 443, Body::Tcp(SYN)),
                Rewritten(at(Uplink, 42_003), at(Far, 443)),
                Parts(PART_SNAT),
            ),
            step(
                UplinkIngress,
                v4(Far, 443, Uplink, 42_003, Body::Tcp(SYN | ACK)),
                Redirected(at(Far, 443), at(C1, 42_003)),
                Parts(PART_SNAT),
            ),
            step(
                FromContainer,
                v4(C1, 42_003, Far, 443, Body::Tcp(ACK)),
                Redirected(at(Uplink, 42_003), at(Far, 443)),
                Parts(PART_SNAT),
            ),
        ],
    },
    Scenario {
        name: "a UDP flow's reply comes back, both families",
        steps: &[
            step(
                FromContainer,
                v4(C1, 42_004, Far, 53, Body::Udp),
                Untouched,
                NoState,
            ),
            step(
                UplinkEgress,
                v4(C1, 42_004, Far, 53, Body::Udp),
                Rewritten(at(Uplink, 42_004), at(Far, 53)),
                Parts(PART_SNAT),
            ),
            step(
                UplinkIngress,
                v4(Far, 53, Uplink, 42_004, Body::Udp),
                Redirected(at(Far, 53), at(C1, 42_004)),
                Parts(PART_SNAT),
            ),
            step(
                FromContainer,
                v6(C1, 42_004, Far, 53, Body::Udp),
                Untouched,
                NoState,
            ),
            step(
                UplinkEgress,
                v6(C1, 42_004, Far, 53, Body::Udp),
                Rewritten(at(Uplink, 42_004), at(Far, 53)),
                Parts(PART_SNAT),
            ),
            step(
                UplinkIngress,
                v6(Far, 53, Uplink, 42_004, Body::Udp),
                Redirected(at(Far, 53), at(C1, 42_004)),
                Parts(PART_SNAT),
            ),
        ],
    },
    Scenario {
        name: "a ping goes out and its echo reply comes back (through the host stack: conntrack is not asked about ICMP)",
        steps: &[
            step(
                FromContainer,
                v4(C1, 42_005, Far, 0, Body::EchoRequest),
                Untouched,
                NoState,
            ),
            step(
                UplinkEgress,
                v4(C1, 42_005, Far, 0, Body::EchoRequest),
                Rewritten(at(Uplink, 0), at(Far, 0)),
                Nothing,
            ),
            step(
                UplinkIngress,
                v4(Far, 0, Uplink, 42_005, Body::EchoReply),
                Rewritten(at(Far, 0), at(C1, 0)),
                Nothing,
            ),
        ],
    },
    Scenario {
        name: "an IPv6 ping goes out and its echo reply comes back, through the host stack",
        steps: &[
            step(
                FromContainer,
                v6(C1, 42_016, Far, 0, Body::EchoRequest),
                Untouched,
                NoState,
            ),
            step(
                UplinkEgress,
                v6(C1, 42_016, Far, 0, Body::EchoRequest),
                Rewritten(at(Uplink, 0), at(Far, 0)),
                Nothing,
            ),
            step(
                UplinkIngress,
                v6(Far, 0, Uplink, 42_016, Body::EchoReply),
                Rewritten(at(Far, 0), at(C1, 0)),
                Nothing,
            ),
        ],
    },
    Scenario {
        name: "an SCTP association leaves masqueraded, its CRC32c valid, and its reply comes back through the host stack",
        steps: &[
            step(
                FromContainer,
                v4(C1, 42_017, Far, 9_000, Body::Sctp),
                Untouched,
                NoState,
            ),
            step(
                UplinkEgress,
                v4(C1, 42_017, Far, 9_000, Body::Sctp),
                Rewritten(at(Uplink, 42_017), at(Far, 9_000)),
                Parts(PART_SNAT),
            ),
            step(
                UplinkIngress,
                v4(Far, 9_000, Uplink, 42_017, Body::Sctp),
                Rewritten(at(Far, 9_000), at(C1, 42_017)),
                Parts(PART_SNAT),
            ),
        ],
    },
    Scenario {
        name: "a reset from the remote reaches the container",
        steps: &[
            step(
                FromContainer,
                v4(C1, 42_018, Far, 443, Body::Tcp(SYN)),
                Untouched,
                NoState,
            ),
            step(
                UplinkEgress,
                v4(C1, 42_018, Far, 443, Body::Tcp(SYN)),
                Rewritten(at(Uplink, 42_018), at(Far, 443)),
                Parts(PART_SNAT),
            ),
            step(
                UplinkIngress,
                v4(Far, 443, Uplink, 42_018, Body::Tcp(RST | ACK)),
                Redirected(at(Far, 443), at(C1, 42_018)),
                Nothing,
            ),
        ],
    },
    Scenario {
        name: "a second container sending from a port the first holds gets another port",
        steps: &[
            step(
                FromContainer,
                v4(C1, 42_006, Far, 443, Body::Tcp(SYN)),
                Untouched,
                NoState,
            ),
            step(
                UplinkEgress,
                v4(C1, 42_006, Far, 443, Body::Tcp(SYN)),
                Rewritten(at(Uplink, 42_006), at(Far, 443)),
                Parts(PART_SNAT),
            ),
            step(
                FromContainer,
                v4(C2, 42_006, Far, 443, Body::Tcp(SYN)),
                Untouched,
                NoState,
            ),
            step(
                UplinkEgress,
                v4(C2, 42_006, Far, 443, Body::Tcp(SYN)),
                Rewritten((Uplink, Port::Not(42_006)), at(Far, 443)),
                Parts(PART_SNAT),
            ),
        ],
    },
    Scenario {
        name: "a port unreachable about a masqueraded datagram reaches the container, translated",
        steps: &[
            step(
                FromContainer,
                v4(C1, 42_007, Far, 53, Body::Udp),
                Untouched,
                NoState,
            ),
            step(
                UplinkEgress,
                v4(C1, 42_007, Far, 53, Body::Udp),
                Rewritten(at(Uplink, 42_007), at(Far, 53)),
                Parts(PART_SNAT),
            ),
            step(
                UplinkIngress,
                v4(Far, 0, Uplink, 0, Body::Unreachable(&sent_from(42_007))),
                Redirected(at(Far, 0), at(C1, 42_007)),
                Nothing,
            ),
        ],
    },
    Scenario {
        name: "a packet too big about a masqueraded segment reaches the container (PMTU)",
        steps: &[
            step(
                FromContainer,
                v4(C1, 42_008, Far, 53, Body::Udp),
                Untouched,
                NoState,
            ),
            step(
                UplinkEgress,
                v4(C1, 42_008, Far, 53, Body::Udp),
                Rewritten(at(Uplink, 42_008), at(Far, 53)),
                Parts(PART_SNAT),
            ),
            step(
                UplinkIngress,
                v4(Far, 0, Uplink, 0, Body::TooBig(1280, &sent_from(42_008))),
                Redirected(at(Far, 0), at(C1, 42_008)),
                Nothing,
            ),
        ],
    },
    Scenario {
        name: "an ICMPv6 packet too big about a masqueraded datagram reaches the container",
        steps: &[
            step(
                FromContainer,
                v6(C1, 42_009, Far, 53, Body::Udp),
                Untouched,
                NoState,
            ),
            step(
                UplinkEgress,
                v6(C1, 42_009, Far, 53, Body::Udp),
                Rewritten(at(Uplink, 42_009), at(Far, 53)),
                Parts(PART_SNAT),
            ),
            step(
                UplinkIngress,
                v6(
                    Far,
                    0,
                    Uplink,
                    0,
                    Body::TooBig(1280, &v6(Uplink, 42_009, Far, 53, Body::Udp)),
                ),
                Redirected(at(Far, 0), at(C1, 42_009)),
                Nothing,
            ),
        ],
    },
    Scenario {
        name: "a port unreachable the container sends about a reply goes to the host stack untouched (the uplink's egress translates it)",
        steps: &[
            step(
                FromContainer,
                v4(C1, 42_010, Far, 53, Body::Udp),
                Untouched,
                NoState,
            ),
            step(
                UplinkEgress,
                v4(C1, 42_010, Far, 53, Body::Udp),
                Rewritten(at(Uplink, 42_010), at(Far, 53)),
                Parts(PART_SNAT),
            ),
            step(
                FromContainer,
                v4(
                    C1,
                    0,
                    Far,
                    0,
                    Body::Unreachable(&v4(Far, 53, C1, 42_010, Body::Udp)),
                ),
                Untouched,
                NoState,
            ),
        ],
    },
    Scenario {
        name: "an ICMP error about a connection never seen makes no state (the uplink's egress drops it)",
        steps: &[step(
            FromContainer,
            v4(
                C1,
                0,
                Far,
                0,
                Body::Unreachable(&v4(Far, 53, C1, 42_011, Body::Udp)),
            ),
            Untouched,
            NoState,
        )],
    },
    Scenario {
        name: "a destination in ipMasqExclude is left to the host, both families",
        steps: &[
            step(
                FromContainer,
                v4(C1, 42_013, Excluded, 80, Body::Tcp(SYN)),
                Untouched,
                NoState,
            ),
            step(
                FromContainer,
                v6(C1, 42_013, Excluded, 80, Body::Tcp(SYN)),
                Untouched,
                NoState,
            ),
        ],
    },
    Scenario {
        name: "a neighbour on the bridge is reached with the container's own address",
        steps: &[step(
            FromContainer,
            v4(C1, 42_014, C2, 80, Body::Tcp(SYN)),
            Untouched,
            NoState,
        )],
    },
    Scenario {
        name: "a reply for a port no connection holds is the host's",
        steps: &[step(
            UplinkIngress,
            v4(Far, 53, Uplink, 42_015, Body::Udp),
            Untouched,
            NoState,
        )],
    },
];

#[test]
fn masquerade_scenarios() {
    let keys = json!({
        "ipMasq": true,
        "ipMasqExclude": ["192.168.0.0/16", "fd00:99::/64"],
    });
    let bench = Bench::new("sc-masq", keys, &Value::Null);
    run(&bench, TABLE);
}
