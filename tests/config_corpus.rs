//! Bad configurations: each must fail with the right code and a message naming the key and the
//! bad value, and must leave no kernel state behind (no pins, no attached programs, no lock).

use cnibpf_tests::{
    Netns, SimHost, assertions::assert_cni_error, chain::Attachment, topology::UPLINK,
};
use serde_json::{Value, json};

fn base_config(sim: &SimHost) -> Value {
    json!({
        "cniVersion": "1.0.0",
        "name": sim.network(),
        "type": "cnibpf",
        "pinPath": sim.pin_path,
        "backend": "auto",
        "ipMasq": false,
        "ipMasqExclude": ["192.168.0.0/16"],
        "filterDefault": "ALLOW",
        "capabilities": { "portMappings": true },
        "runtimeConfig": { "portMappings": [{ "hostPort": 8080, "containerPort": 80, "protocol": "tcp" }] },
        "prevResult": {
            "cniVersion": "1.0.0",
            "interfaces": [
                { "name": "cni0", "mac": "02:00:00:00:00:01" },
                { "name": "veth0123", "mac": "02:00:00:00:00:02" },
                { "name": "eth0", "mac": "02:00:00:00:00:03", "sandbox": "/run/netns/x" }
            ],
            "ips": [{ "address": "10.22.0.5/16", "gateway": "10.22.0.1", "interface": 2 }]
        }
    })
}

/// Applies `changes` (top-level keys; `null` removes the key) to the base configuration.
fn with(sim: &SimHost, changes: Value) -> String {
    let mut config = base_config(sim);
    let object = config.as_object_mut().expect("object");
    for (key, value) in changes.as_object().expect("changes are an object") {
        if value.is_null() {
            object.remove(key);
        } else {
            object.insert(key.clone(), value.clone());
        }
    }
    config.to_string()
}

fn rule(extra: Value) -> Value {
    let mut rule = json!({ "index": 1, "target": "ALLOW" });
    for (key, value) in extra.as_object().expect("object") {
        if value.is_null() {
            rule.as_object_mut().expect("object").remove(key);
        } else {
            rule[key] = value.clone();
        }
    }
    json!([rule])
}

fn mappings(entries: Value) -> Value {
    json!({ "portMappings": entries })
}

#[test]
fn every_bad_configuration_fails_cleanly() {
    let sim = SimHost::new("corpus", json!({}));
    let container = Netns::create("cbt-corpus-c");
    let attachment = Attachment {
        container_id: "corpus-c".to_owned(),
        ifname: "eth0".to_owned(),
        netns: container.path(),
        capability_args: Value::Null,
        cni_args: String::new(),
    };
    let too_many: Vec<Value> = (0..257)
        .map(|index| json!({ "index": index, "target": "DROP" }))
        .collect();
    let cases: Vec<(&str, String, u64, &str)> = vec![
        (
            "not JSON",
            "{\"cniVersion\": ".to_owned(),
            6,
            "not valid JSON",
        ),
        ("JSON array", "[]".to_owned(), 7, "expected a JSON object"),
        (
            "no cniVersion",
            with(&sim, json!({ "cniVersion": null })),
            7,
            "cniVersion: is required",
        ),
        (
            "old cniVersion",
            with(&sim, json!({ "cniVersion": "0.2.0" })),
            1,
            "unsupported cniVersion \"0.2.0\"",
        ),
        (
            "numeric cniVersion",
            with(&sim, json!({ "cniVersion": 1 })),
            7,
            "cniVersion: expected a string, got number 1",
        ),
        (
            "no name",
            with(&sim, json!({ "name": null })),
            7,
            "name: is required",
        ),
        (
            "bad name",
            with(&sim, json!({ "name": "my net!" })),
            7,
            "\"my net!\" is not a valid network name",
        ),
        (
            "no prevResult",
            with(&sim, json!({ "prevResult": null })),
            7,
            "chained plugin",
        ),
        (
            "prevResult string",
            with(&sim, json!({ "prevResult": "x" })),
            7,
            "prevResult: expected an object",
        ),
        (
            "backend typo",
            with(&sim, json!({ "backend": "bpf" })),
            7,
            "backend: expected \"auto\", \"ebpf\" or \"nftables\", got \"bpf\"",
        ),
        (
            "ipMasq string",
            with(&sim, json!({ "ipMasq": "yes" })),
            7,
            "ipMasq: expected true or false, got string \"yes\"",
        ),
        (
            "sourceCheck string",
            with(&sim, json!({ "sourceCheck": "off" })),
            7,
            "sourceCheck: expected true or false, got string \"off\"",
        ),
        (
            "more addresses of a family than the source check holds",
            with(
                &sim,
                json!({ "runtimeConfig": null, "prevResult": {
                    "cniVersion": "1.0.0",
                    "interfaces": base_config(&sim)["prevResult"]["interfaces"],
                    "ips": (2..11).map(|n| json!({ "address": format!("10.22.0.{n}/16"), "interface": 2 })).collect::<Vec<_>>(),
                } }),
            ),
            7,
            "sourceCheck: the container has 9 IPv4 addresses",
        ),
        (
            "ipMasqExclude string",
            with(&sim, json!({ "ipMasqExclude": "10.0.0.0/8" })),
            7,
            "ipMasqExclude: expected an array",
        ),
        (
            "ipMasqExclude bad CIDR",
            with(&sim, json!({ "ipMasqExclude": ["10.0.0.0/33"] })),
            7,
            "ipMasqExclude[0]: expected a CIDR",
        ),
        (
            "filter object",
            with(&sim, json!({ "filter": {} })),
            7,
            "filter: expected an array",
        ),
        (
            "rule without index",
            with(&sim, json!({ "filter": rule(json!({ "index": null })) })),
            7,
            "filter[0].index: is required",
        ),
        (
            "rule without target",
            with(&sim, json!({ "filter": rule(json!({ "target": null })) })),
            7,
            "filter[0].target: is required",
        ),
        (
            "negative index",
            with(&sim, json!({ "filter": rule(json!({ "index": -1 })) })),
            7,
            "filter[0].index: expected an integer",
        ),
        (
            "unknown target",
            with(
                &sim,
                json!({ "filter": rule(json!({ "target": "REFUSE" })) }),
            ),
            7,
            "filter[0].target: expected \"ALLOW\", \"DROP\" or \"REJECT\", got \"REFUSE\"",
        ),
        (
            "log not a boolean",
            with(&sim, json!({ "filter": rule(json!({ "log": "yes" })) })),
            7,
            "filter[0].log: expected true or false, got string \"yes\"",
        ),
        (
            "srcNetwork empty",
            with(&sim, json!({ "filter": rule(json!({ "srcNetwork": "" })) })),
            7,
            "filter[0].srcNetwork: \"\" is not a valid network name",
        ),
        (
            "duplicate index",
            with(
                &sim,
                json!({ "filter": [{ "index": 5, "target": "DROP" }, { "index": 5, "target": "ALLOW" }] }),
            ),
            7,
            "filter[1].index: index 5 is already used by filter[0]",
        ),
        (
            "unknown rule key",
            with(&sim, json!({ "filter": rule(json!({ "dports": 80 })) })),
            7,
            "filter[0].dports: unknown rule key",
        ),
        (
            "bad src",
            with(
                &sim,
                json!({ "filter": rule(json!({ "src": "10.0.0.300/8" })) }),
            ),
            7,
            "filter[0].src: expected a CIDR",
        ),
        (
            "bad proto",
            with(&sim, json!({ "filter": rule(json!({ "proto": "gre" })) })),
            7,
            "filter[0].proto: expected tcp, udp, sctp, icmp, icmpv6 or any, got \"gre\"",
        ),
        (
            "dport without proto",
            with(&sim, json!({ "filter": rule(json!({ "dport": 80 })) })),
            7,
            "filter[0].dport: ports need proto",
        ),
        (
            "empty range",
            with(
                &sim,
                json!({ "filter": rule(json!({ "proto": "tcp", "dport": "90-80" })) }),
            ),
            7,
            "range 90-80 is empty",
        ),
        (
            "port too big",
            with(
                &sim,
                json!({ "filter": rule(json!({ "proto": "tcp", "dport": 70000 })) }),
            ),
            7,
            "filter[0].dport: expected a port 1-65535",
        ),
        (
            "port word",
            with(
                &sim,
                json!({ "filter": rule(json!({ "proto": "udp", "sport": "abc" })) }),
            ),
            7,
            "filter[0].sport: expected a port",
        ),
        (
            "connstate related",
            with(
                &sim,
                json!({ "filter": rule(json!({ "connstate": "related" })) }),
            ),
            7,
            "filter[0].connstate: expected new, established or any",
        ),
        (
            "direction in",
            with(
                &sim,
                json!({ "filter": rule(json!({ "direction": "in" })) }),
            ),
            7,
            "filter[0].direction: expected ingress, egress or both",
        ),
        (
            "icmp to IPv6",
            with(
                &sim,
                json!({ "filter": rule(json!({ "proto": "icmp", "dst": "2001:db8::/32" })) }),
            ),
            7,
            "icmp cannot match address 2001:db8::/32",
        ),
        (
            "mixed families",
            with(
                &sim,
                json!({ "filter": rule(json!({ "src": "10.0.0.0/8", "dst": "2001:db8::1" })) }),
            ),
            7,
            "different address families",
        ),
        (
            "257 rules",
            with(&sim, json!({ "filter": too_many })),
            7,
            "257 rules, at most 256",
        ),
        (
            "filterDefault REJECT",
            with(&sim, json!({ "filterDefault": "REJECT" })),
            7,
            "filterDefault: is \"ALLOW\" or \"DROP\"",
        ),
        (
            "uplinks string",
            with(&sim, json!({ "uplinks": "eth0" })),
            7,
            "uplinks: expected an array",
        ),
        (
            "uplinks empty",
            with(&sim, json!({ "uplinks": [] })),
            7,
            "uplinks: must name at least one interface",
        ),
        (
            "uplink name too long",
            with(&sim, json!({ "uplinks": ["name-longer-than-15"] })),
            7,
            "uplinks[0]: interface name \"name-longer-than-15\" is longer than 15 bytes",
        ),
        (
            "maxFlows below its bound",
            with(&sim, json!({ "maxFlows": 100 })),
            7,
            "maxFlows: must be between 1024 and 4194304, got 100",
        ),
        (
            "maxAttachments as a string",
            with(&sim, json!({ "maxAttachments": "4096" })),
            7,
            "maxAttachments: invalid type: string",
        ),
        (
            "maxHostPorts above its bound",
            with(&sim, json!({ "maxHostPorts": 1_000_000 })),
            7,
            "maxHostPorts: must be between 64 and 262144, got 1000000",
        ),
        (
            "relative pinPath",
            with(&sim, json!({ "pinPath": "relative/dir" })),
            7,
            "pinPath: expected an absolute path without '..', got \"relative/dir\"",
        ),
        (
            "pinPath with ..",
            with(&sim, json!({ "pinPath": "/sys/fs/bpf/../escape" })),
            7,
            "pinPath: expected an absolute path",
        ),
        (
            "cgroupPath number",
            with(&sim, json!({ "cgroupPath": 5 })),
            7,
            "cgroupPath: expected a string, got number 5",
        ),
        (
            "runtimeConfig string",
            with(&sim, json!({ "runtimeConfig": "x" })),
            7,
            "runtimeConfig: expected an object",
        ),
        (
            "portMappings object",
            with(&sim, json!({ "runtimeConfig": mappings(json!({})) })),
            7,
            "runtimeConfig.portMappings: expected an array",
        ),
        (
            "hostPort 0",
            with(
                &sim,
                json!({ "runtimeConfig": mappings(json!([{ "hostPort": 0, "containerPort": 80 }])) }),
            ),
            7,
            "runtimeConfig.portMappings[0].hostPort: expected a port 1-65535, got number 0",
        ),
        (
            "hostPort 65536",
            with(
                &sim,
                json!({ "runtimeConfig": mappings(json!([{ "hostPort": 65536, "containerPort": 80 }])) }),
            ),
            7,
            "hostPort: expected a port 1-65535, got number 65536",
        ),
        (
            "hostPort string",
            with(
                &sim,
                json!({ "runtimeConfig": mappings(json!([{ "hostPort": "8080", "containerPort": 80 }])) }),
            ),
            7,
            "hostPort: expected a port 1-65535, got string \"8080\"",
        ),
        (
            "no containerPort",
            with(
                &sim,
                json!({ "runtimeConfig": mappings(json!([{ "hostPort": 8080 }])) }),
            ),
            7,
            "runtimeConfig.portMappings[0].containerPort: is required",
        ),
        (
            "protocol icmp",
            with(
                &sim,
                json!({ "runtimeConfig": mappings(json!([{ "hostPort": 1, "containerPort": 1, "protocol": "icmp" }])) }),
            ),
            7,
            "protocol: expected \"tcp\", \"udp\" or \"sctp\", got \"icmp\"",
        ),
        (
            "bad hostIP",
            with(
                &sim,
                json!({ "runtimeConfig": mappings(json!([{ "hostPort": 1, "containerPort": 1, "hostIP": "1.2.3" }])) }),
            ),
            7,
            "hostIP: expected an IPv4 or IPv6 address, got \"1.2.3\"",
        ),
        (
            "duplicate mapping",
            with(
                &sim,
                json!({ "runtimeConfig": mappings(json!([{ "hostPort": 80, "containerPort": 1 }, { "hostPort": 80, "containerPort": 2, "protocol": "TCP" }])) }),
            ),
            7,
            "runtimeConfig.portMappings[1]: tcp/* hostPort 80 overlaps runtimeConfig.portMappings[0]",
        ),
        (
            "wildcard over specific",
            with(
                &sim,
                json!({ "runtimeConfig": mappings(json!([{ "hostPort": 80, "containerPort": 1, "hostIP": "203.0.113.1" }, { "hostPort": 80, "containerPort": 2, "hostIP": "0.0.0.0" }])) }),
            ),
            7,
            "overlaps runtimeConfig.portMappings[0]",
        ),
        (
            "capability not boolean",
            with(&sim, json!({ "capabilities": { "portMappings": "yes" } })),
            7,
            "capabilities.portMappings: expected true or false",
        ),
        (
            "prevResult address without prefix",
            with(
                &sim,
                json!({ "prevResult": { "cniVersion": "1.0.0", "ips": [{ "address": "10.22.0.5" }] } }),
            ),
            7,
            "prevResult.ips[0].address: expected a CIDR address",
        ),
        (
            "mapping for a family the container lacks",
            with(
                &sim,
                json!({ "prevResult": { "cniVersion": "1.0.0", "ips": [{ "address": "2001:db8::5/64" }] }, "runtimeConfig": mappings(json!([{ "hostPort": 1, "containerPort": 1, "hostIP": "203.0.113.1" }])) }),
            ),
            7,
            "hostIP 203.0.113.1 is IPv4 but the container has no IPv4 address",
        ),
        (
            "ipMasq without container addresses",
            with(
                &sim,
                json!({ "ipMasq": true, "runtimeConfig": null, "prevResult": { "cniVersion": "1.0.0", "ips": [] } }),
            ),
            7,
            "ipMasq: needs the container's addresses",
        ),
        (
            "portmap's iptables backend",
            with(&sim, json!({ "backend": "iptables" })),
            101,
            "backend: cnibpf has no iptables backend",
        ),
        (
            "masqAll",
            with(&sim, json!({ "masqAll": true })),
            101,
            "masqAll: cnibpf keeps the client's address",
        ),
        (
            "bridge's ipMasqBackend",
            with(&sim, json!({ "ipMasqBackend": "nftables" })),
            101,
            "ipMasqBackend: cnibpf masquerades itself",
        ),
        (
            "a condition cnibpf cannot enforce",
            with(
                &sim,
                json!({ "conditionsV4": ["-m", "set", "--match-set", "allowed", "src"] }),
            ),
            101,
            "conditionsV4: \"-m\" is not a condition cnibpf can enforce",
        ),
        (
            "condition for the other family",
            with(&sim, json!({ "conditionsV6": ["-s", "192.0.2.0/24"] })),
            7,
            "conditionsV6: 192.0.2.0/24 is not an IPv6 address",
        ),
        (
            "condition flag and value in one element",
            with(&sim, json!({ "conditionsV4": ["-s 192.0.2.0/24"] })),
            7,
            "each iptables flag and value is an element of its own",
        ),
        (
            "condition on a missing interface",
            with(&sim, json!({ "conditionsV4": ["!", "-i", "nosuchif0"] })),
            103,
            "no interface named \"nosuchif0\"",
        ),
        (
            "markMasqBit out of range",
            with(&sim, json!({ "markMasqBit": 32 })),
            7,
            "markMasqBit: must be between 0 and 31, got 32",
        ),
        (
            "markMasqBit with externalSetMarkChain",
            with(
                &sim,
                json!({ "markMasqBit": 13, "externalSetMarkChain": "KUBE-MARK-MASQ" }),
            ),
            7,
            "externalSetMarkChain: cannot be used with markMasqBit",
        ),
        (
            "a rule key that is not ours in any case",
            with(
                &sim,
                json!({ "filter": [{ "Index": 1, "Target": "DROP", "DPorts": 80 }] }),
            ),
            7,
            "filter[0].DPorts: unknown rule key",
        ),
        (
            "two spellings of one rule key",
            with(
                &sim,
                json!({ "filter": [{ "index": 1, "target": "ALLOW", "src": "10.0.0.0/8", "SRC": "0.0.0.0/0" }] }),
            ),
            7,
            "both name \"src\"",
        ),
    ];
    assert!(
        cases.len() >= 40,
        "the corpus must stay at 40 cases or more"
    );
    for (name, stdin, code, fragment) in &cases {
        let output = sim.invoke_cnibpf("ADD", Some(&attachment), stdin);
        assert_cni_error(&output, *code, fragment);
        assert!(
            output.stderr.contains("cnibpf: ADD"),
            "{name}: the error is also logged on stderr"
        );
        assert!(!sim.pin_path.exists(), "{name}: pinned state was created");
        assert!(
            !sim.lock_file().exists(),
            "{name}: the lock was taken before validation finished"
        );
        assert!(
            sim.tcx_programs(UPLINK).is_empty(),
            "{name}: programs were attached"
        );
    }
}
