//! hostPort conditions (the reference portmap's `conditionsV4`/`conditionsV6`): a mapping is
//! translated for the clients they admit only, per family, from outside and for hairpin.
//!
//! c1 maps 8080 → 80/tcp and 5353 → 53/udp; IPv4 clients must come from 198.51.100.0/24 and
//! not from 198.51.100.66, IPv6 ones from 2001:db8:1::/64.

use cnibpf_common::connections::PART_DNAT;
use cnibpf_tests::packet::SYN;
use serde_json::json;

use super::{Bench, Body, Expect::*, Hook::*, Peer::*, Scenario, Then::*, at, run, step, v4, v6};

const ADMITTED: super::Peer = At("198.51.100.9");
const EXCLUDED: super::Peer = At("198.51.100.66");

const TABLE: &[Scenario] = &[
    Scenario {
        name: "a client the conditions admit is translated",
        steps: &[
            step(
                UplinkIngress,
                v4(ADMITTED, 46_001, Uplink, 8080, Body::Tcp(SYN)),
                Redirected(at(ADMITTED, 46_001), at(C1, 80)),
                Parts(PART_DNAT),
            ),
            step(
                UplinkIngress,
                v4(ADMITTED, 46_001, Uplink, 5353, Body::Udp),
                Redirected(at(ADMITTED, 46_001), at(C1, 53)),
                Parts(PART_DNAT),
            ),
        ],
    },
    Scenario {
        name: "a client outside the admitted source is the host's",
        steps: &[step(
            UplinkIngress,
            v4(Outside, 46_002, Uplink, 8080, Body::Tcp(SYN)),
            Untouched,
            NoState,
        )],
    },
    Scenario {
        name: "a negated source inside the admitted one is the host's",
        steps: &[step(
            UplinkIngress,
            v4(EXCLUDED, 46_003, Uplink, 8080, Body::Tcp(SYN)),
            Untouched,
            NoState,
        )],
    },
    Scenario {
        name: "each family follows its own conditions",
        steps: &[step(
            UplinkIngress,
            v6(Outside, 46_004, Uplink, 8080, Body::Tcp(SYN)),
            Redirected(at(Outside, 46_004), at(C1, 80)),
            Parts(PART_DNAT),
        )],
    },
    Scenario {
        name: "a neighbour outside the admitted source gets no hairpin",
        steps: &[step(
            FromContainer,
            v4(C2, 46_005, Uplink, 8080, Body::Tcp(SYN)),
            Untouched,
            NoState,
        )],
    },
];

#[test]
fn host_port_condition_scenarios() {
    let keys = json!({
        "conditionsV4": ["-s", "198.51.100.0/24", "!", "-s", "198.51.100.66"],
        "conditionsV6": ["-s", "2001:db8:1::/64"],
    });
    let mappings = json!({ "portMappings": [
        { "hostPort": 8080, "containerPort": 80, "protocol": "tcp" },
        { "hostPort": 5353, "containerPort": 53, "protocol": "udp" },
    ]});
    run(&Bench::new("sc-cond", keys, &mappings), TABLE);
}
