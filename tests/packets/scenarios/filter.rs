//! The filter: rules in index order, first match wins; `connstate` new and established;
//! `direction`; replies of allowed connections pass without a rule; rules between neighbours
//! on the bridge; per-rule counters; the default verdict; link-local control always passes.

use cnibpf_common::drops::DropReason;
use cnibpf_tests::packet::{ACK, SYN, arp_announcement};
use serde_json::{Value, json};

use super::{
    Bench, Body, Expect::*, Frame, Hook::*, Peer::*, Scenario, Step, Then::*, at, run, step, v4,
};

/// Rule positions (the rules sorted by index) of [`filter_scenarios`]' configuration.
const SOURCE_DROP: usize = 0;
const NEW_80: usize = 1;
const ESTABLISHED_80: usize = 2;
const ANY_81: usize = 3;
const EGRESS_53: usize = 4;

const TABLE: &[Scenario] = &[
    Scenario {
        name: "rules are evaluated in index order: a source's DROP before an ALLOW of its port",
        steps: &[step(
            UplinkIngress,
            v4(At("198.51.100.66"), 43_001, Uplink, 8080, Body::Tcp(SYN)),
            Dropped(DropReason::FilterRule),
            Rule(SOURCE_DROP),
        )],
    },
    Scenario {
        name: "connstate new allows a connection's first packet, established judges its later ones",
        steps: &[
            step(
                UplinkIngress,
                v4(Outside, 43_002, Uplink, 8080, Body::Tcp(SYN)),
                Redirected(at(Outside, 43_002), at(C1, 80)),
                Rule(NEW_80),
            ),
            step(
                UplinkIngress,
                v4(Outside, 43_002, Uplink, 8080, Body::Tcp(ACK)),
                Dropped(DropReason::FilterRule),
                Rule(ESTABLISHED_80),
            ),
        ],
    },
    Scenario {
        name: "an allowed connection's replies pass without a rule, its later packets are counted",
        steps: &[
            step(
                UplinkIngress,
                v4(Outside, 43_003, Uplink, 8081, Body::Tcp(SYN)),
                Redirected(at(Outside, 43_003), at(C1, 81)),
                Rule(ANY_81),
            ),
            step(
                FromContainer,
                v4(C1, 81, Outside, 43_003, Body::Tcp(SYN | ACK)),
                Redirected(at(Uplink, 8081), at(Outside, 43_003)),
                Nothing,
            ),
            step(
                UplinkIngress,
                v4(Outside, 43_003, Uplink, 8081, Body::Tcp(ACK)),
                Redirected(at(Outside, 43_003), at(C1, 81)),
                Rule(ANY_81),
            ),
        ],
    },
    Scenario {
        name: "an egress rule drops what the container sends to the port, not what it receives on it",
        steps: &[
            step(
                FromContainer,
                v4(C1, 43_004, Far, 53, Body::Udp),
                Dropped(DropReason::FilterRule),
                Rule(EGRESS_53),
            ),
            step(
                UplinkIngress,
                v4(Outside, 43_004, Uplink, 5353, Body::Udp),
                Redirected(at(Outside, 43_004), at(C1, 53)),
                Nothing,
            ),
        ],
    },
    Scenario {
        name: "rules hold between neighbours on the bridge",
        steps: &[
            step(
                ToContainer,
                v4(C2, 43_005, C1, 80, Body::Tcp(SYN)),
                Untouched,
                Rule(NEW_80),
            ),
            step(
                ToContainer,
                v4(C2, 43_005, C1, 80, Body::Tcp(ACK)),
                Dropped(DropReason::FilterRule),
                Rule(ESTABLISHED_80),
            ),
        ],
    },
    Scenario {
        name: "what no rule matches takes the default, ALLOW",
        steps: &[
            step(
                FromContainer,
                v4(C1, 43_006, Far, 443, Body::Tcp(SYN)),
                Untouched,
                Nothing,
            ),
            step(
                UplinkEgress,
                v4(C1, 43_006, Far, 443, Body::Tcp(SYN)),
                Rewritten(at(Uplink, 43_006), at(Far, 443)),
                Nothing,
            ),
        ],
    },
];

#[test]
fn filter_scenarios() {
    let keys = json!({ "ipMasq": true, "filter": [
        { "index": 10, "src": "198.51.100.66/32", "target": "DROP" },
        { "index": 20, "proto": "tcp", "dport": 80, "connstate": "new", "direction": "ingress", "target": "ALLOW" },
        { "index": 30, "proto": "tcp", "dport": 80, "connstate": "established", "direction": "ingress", "target": "DROP" },
        { "index": 40, "proto": "tcp", "dport": 81, "direction": "ingress", "target": "ALLOW" },
        { "index": 50, "proto": "udp", "dport": 53, "direction": "egress", "target": "DROP" },
    ]});
    let mappings = json!({ "portMappings": [
        { "hostPort": 8080, "containerPort": 80, "protocol": "tcp" },
        { "hostPort": 8081, "containerPort": 81, "protocol": "tcp" },
        { "hostPort": 5353, "containerPort": 53, "protocol": "udp" },
    ]});
    run(&Bench::new("sc-filter", keys, &mappings), TABLE);
}

const ALLOW_443: usize = 0;

const DEFAULT_DROP: &[Scenario] = &[
    Scenario {
        name: "an ALLOW before a default DROP lets its connection out, and its replies in",
        steps: &[
            step(
                FromContainer,
                v4(C1, 43_101, Far, 443, Body::Tcp(SYN)),
                Untouched,
                Rule(ALLOW_443),
            ),
            step(
                UplinkEgress,
                v4(C1, 43_101, Far, 443, Body::Tcp(SYN)),
                Rewritten(at(Uplink, 43_101), at(Far, 443)),
                Nothing,
            ),
            step(
                UplinkIngress,
                v4(Far, 443, Uplink, 43_101, Body::Tcp(SYN | ACK)),
                Redirected(at(Far, 443), at(C1, 43_101)),
                Nothing,
            ),
        ],
    },
    Scenario {
        name: "an ICMP error about an allowed connection reaches the container without a rule",
        steps: &[
            step(
                FromContainer,
                v4(C1, 43_104, Far, 443, Body::Tcp(SYN)),
                Untouched,
                Rule(ALLOW_443),
            ),
            step(
                UplinkEgress,
                v4(C1, 43_104, Far, 443, Body::Tcp(SYN)),
                Rewritten(at(Uplink, 43_104), at(Far, 443)),
                Nothing,
            ),
            step(
                UplinkIngress,
                v4(
                    Far,
                    0,
                    Uplink,
                    0,
                    Body::Unreachable(&v4(Uplink, 43_104, Far, 443, Body::Tcp(SYN))),
                ),
                Redirected(at(Far, 0), at(C1, 43_104)),
                Nothing,
            ),
        ],
    },
    Scenario {
        name: "what no rule matches is dropped by the default, and counted as such",
        steps: &[step(
            FromContainer,
            v4(C1, 43_102, Far, 444, Body::Tcp(SYN)),
            Dropped(DropReason::FilterDefault),
            NoState,
        )],
    },
    Scenario {
        name: "a packet of an unknown connection from outside is no reply: the default drops it",
        steps: &[step(
            ToContainer,
            v4(C2, 43_103, C1, 80, Body::Tcp(ACK)),
            Dropped(DropReason::FilterDefault),
            NoState,
        )],
    },
    Scenario {
        name: "link-local control (ARP) passes whatever the rules",
        steps: &[Step {
            hook: FromContainer,
            frame: Frame::Custom(own_arp),
            expect: Untouched,
            then: NoState,
        }],
    },
];

/// c1 announcing its own address.
fn own_arp(bench: &Bench) -> Vec<u8> {
    arp_announcement(bench.c1_mac(), bench.c1.address)
}

#[test]
fn default_drop_scenarios() {
    let keys = json!({ "ipMasq": true, "filterDefault": "DROP", "filter": [
        { "index": 10, "proto": "tcp", "dport": 443, "direction": "egress", "target": "ALLOW" },
    ]});
    run(&Bench::new("sc-drop", keys, &Value::Null), DEFAULT_DROP);
}
