//! hostPorts: DNAT from outside (IPv4 and IPv6; TCP, UDP, SCTP; wildcard and hostIP), the
//! container's replies, hairpin from a neighbour and from itself, and what is no one's.
//!
//! c1 maps 8080 → 80/tcp, 5353 → 53/udp and 9999 → 9999/sctp on every address of the node,
//! and 8443 → 443/tcp on the uplink's IPv4 address only.

use cnibpf_common::connections::PART_DNAT;
use cnibpf_tests::packet::{ACK, FIN, RST, SYN};
use serde_json::json;

use super::{Bench, Body, Expect::*, Hook::*, Peer::*, Scenario, Then::*, at, run, step, v4, v6};

const TABLE: &[Scenario] = &[
    Scenario {
        name: "a TCP SYN to the wildcard hostPort reaches the container's port",
        steps: &[step(
            UplinkIngress,
            v4(Outside, 41_001, Uplink, 8080, Body::Tcp(SYN)),
            Redirected(at(Outside, 41_001), at(C1, 80)),
            Parts(PART_DNAT),
        )],
    },
    Scenario {
        name: "the same over IPv6",
        steps: &[step(
            UplinkIngress,
            v6(Outside, 41_002, Uplink, 8080, Body::Tcp(SYN)),
            Redirected(at(Outside, 41_002), at(C1, 80)),
            Parts(PART_DNAT),
        )],
    },
    Scenario {
        name: "a UDP datagram to the hostPort, both families",
        steps: &[
            step(
                UplinkIngress,
                v4(Outside, 41_003, Uplink, 5353, Body::Udp),
                Redirected(at(Outside, 41_003), at(C1, 53)),
                Parts(PART_DNAT),
            ),
            step(
                UplinkIngress,
                v6(Outside, 41_003, Uplink, 5353, Body::Udp),
                Redirected(at(Outside, 41_003), at(C1, 53)),
                Parts(PART_DNAT),
            ),
        ],
    },
    Scenario {
        name: "an SCTP packet to the hostPort, its CRC32c valid",
        steps: &[step(
            UplinkIngress,
            v4(Outside, 41_004, Uplink, 9999, Body::Sctp),
            Redirected(at(Outside, 41_004), at(C1, 9999)),
            Parts(PART_DNAT),
        )],
    },
    Scenario {
        name: "a hostIP mapping takes its address",
        steps: &[step(
            UplinkIngress,
            v4(Outside, 41_005, Uplink, 8443, Body::Tcp(SYN)),
            Redirected(at(Outside, 41_005), at(C1, 443)),
            Parts(PART_DNAT),
        )],
    },
    Scenario {
        name: "a hostIP of IPv4 maps nothing over IPv6",
        steps: &[step(
            UplinkIngress,
            v6(Outside, 41_006, Uplink, 8443, Body::Tcp(SYN)),
            Untouched,
            NoState,
        )],
    },
    Scenario {
        name: "a hostPort on an address the node does not own is no one's",
        steps: &[step(
            UplinkIngress,
            v4(Outside, 41_007, Stranger, 8080, Body::Tcp(SYN)),
            Untouched,
            NoState,
        )],
    },
    Scenario {
        name: "a port without a mapping, and a mapped port of another protocol, are the host's",
        steps: &[
            step(
                UplinkIngress,
                v4(Outside, 41_008, Uplink, 8081, Body::Tcp(SYN)),
                Untouched,
                NoState,
            ),
            step(
                UplinkIngress,
                v4(Outside, 41_008, Uplink, 8080, Body::Udp),
                Untouched,
                NoState,
            ),
        ],
    },
    Scenario {
        name: "the handshake's replies come back from the hostPort, and the connection closes",
        steps: &[
            step(
                UplinkIngress,
                v4(Outside, 41_009, Uplink, 8080, Body::Tcp(SYN)),
                Redirected(at(Outside, 41_009), at(C1, 80)),
                Parts(PART_DNAT),
            ),
            step(
                FromContainer,
                v4(C1, 80, Outside, 41_009, Body::Tcp(SYN | ACK)),
                Redirected(at(Uplink, 8080), at(Outside, 41_009)),
                Parts(PART_DNAT),
            ),
            step(
                UplinkIngress,
                v4(Outside, 41_009, Uplink, 8080, Body::Tcp(ACK)),
                Redirected(at(Outside, 41_009), at(C1, 80)),
                Parts(PART_DNAT),
            ),
            step(
                FromContainer,
                v4(C1, 80, Outside, 41_009, Body::Tcp(FIN | ACK)),
                Redirected(at(Uplink, 8080), at(Outside, 41_009)),
                Nothing,
            ),
            step(
                UplinkIngress,
                v4(Outside, 41_009, Uplink, 8080, Body::Tcp(FIN | ACK)),
                Redirected(at(Outside, 41_009), at(C1, 80)),
                Nothing,
            ),
        ],
    },
    Scenario {
        name: "an IPv6 reply comes back from the hostPort",
        steps: &[
            step(
                UplinkIngress,
                v6(Outside, 41_010, Uplink, 5353, Body::Udp),
                Redirected(at(Outside, 41_010), at(C1, 53)),
                Parts(PART_DNAT),
            ),
            step(
                FromContainer,
                v6(C1, 53, Outside, 41_010, Body::Udp),
                Redirected(at(Uplink, 5353), at(Outside, 41_010)),
                Parts(PART_DNAT),
            ),
        ],
    },
    Scenario {
        name: "a reset from the container ends the translation's connection, a new SYN opens it again",
        steps: &[
            step(
                UplinkIngress,
                v4(Outside, 41_011, Uplink, 8080, Body::Tcp(SYN)),
                Redirected(at(Outside, 41_011), at(C1, 80)),
                Parts(PART_DNAT),
            ),
            step(
                FromContainer,
                v4(C1, 80, Outside, 41_011, Body::Tcp(RST | ACK)),
                Redirected(at(Uplink, 8080), at(Outside, 41_011)),
                Nothing,
            ),
            step(
                UplinkIngress,
                v4(Outside, 41_011, Uplink, 8080, Body::Tcp(SYN)),
                Redirected(at(Outside, 41_011), at(C1, 80)),
                Parts(PART_DNAT),
            ),
        ],
    },
    Scenario {
        name: "a port unreachable from the container about a hostPort datagram goes to the host stack untouched (the uplink's egress translates it)",
        steps: &[
            step(
                UplinkIngress,
                v4(Outside, 41_012, Uplink, 5353, Body::Udp),
                Redirected(at(Outside, 41_012), at(C1, 53)),
                Parts(PART_DNAT),
            ),
            step(
                FromContainer,
                v4(
                    C1,
                    0,
                    Outside,
                    41_012,
                    Body::Unreachable(&v4(Outside, 41_012, C1, 53, Body::Udp)),
                ),
                Untouched,
                NoState,
            ),
        ],
    },
    Scenario {
        name: "a neighbour reaches the hostPort through the node's address (hairpin)",
        steps: &[step(
            FromContainer,
            v4(C2, 41_013, Uplink, 8080, Body::Tcp(SYN)),
            Redirected(at(C2, 41_013), at(C1, 80)),
            Nothing,
        )],
    },
    Scenario {
        name: "a neighbour's hairpin connection gets its replies from the hostPort",
        steps: &[
            step(
                FromContainer,
                v4(C2, 41_014, Uplink, 5353, Body::Udp),
                Redirected(at(C2, 41_014), at(C1, 53)),
                Nothing,
            ),
            step(
                FromContainer,
                v4(C1, 53, C2, 41_014, Body::Udp),
                Redirected(at(Uplink, 5353), at(C2, 41_014)),
                Nothing,
            ),
        ],
    },
    Scenario {
        name: "a container reaches its own hostPort, its source made the gateway",
        steps: &[step(
            FromContainer,
            v4(C1, 41_015, Uplink, 8080, Body::Tcp(SYN)),
            Redirected(at(Gateway, 41_015), at(C1, 80)),
            Nothing,
        )],
    },
    Scenario {
        name: "IPv6 hairpin",
        steps: &[step(
            FromContainer,
            v6(C2, 41_016, Uplink, 8080, Body::Tcp(SYN)),
            Redirected(at(C2, 41_016), at(C1, 80)),
            Nothing,
        )],
    },
];

#[test]
fn host_port_scenarios() {
    let mappings = json!({ "portMappings": [
        { "hostPort": 8080, "containerPort": 80, "protocol": "tcp" },
        { "hostPort": 5353, "containerPort": 53, "protocol": "udp" },
        { "hostPort": 9999, "containerPort": 9999, "protocol": "sctp" },
        { "hostPort": 8443, "containerPort": 443, "protocol": "tcp", "hostIP": "203.0.113.1" },
    ]});
    let bench = Bench::new("sc-dnat", json!({ "ipMasq": true }), &mappings);
    run(&bench, TABLE);
}
