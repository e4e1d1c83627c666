//! Property tests: whatever a runtime sends — any bytes, any JSON, a real configuration with any
//! part replaced, keys in any case — is answered with a configuration or a CNI error, never a
//! panic. The JSON is built from the keys cnibpf and the reference plugins read, so that the
//! cases reach past the first check.

use proptest::prelude::*;
use serde_json::{Value, json};

use crate::{
    cni::{args::CniArgs, result::PrevResult},
    config::{CleanupConf, NetConf, RULE_KEYS},
};

fn all_keys() -> Vec<&'static str> {
    KEYS.iter().chain(RULE_KEYS).copied().collect()
}

/// Keys the decoder looks for, besides a filter rule's, so that generated objects reach deep.
const KEYS: &[&str] = &[
    "cniVersion",
    "name",
    "type",
    "prevResult",
    "runtimeConfig",
    "portMappings",
    "hostPort",
    "containerPort",
    "protocol",
    "hostIP",
    "filter",
    "filterDefault",
    "ipMasq",
    "ipMasqExclude",
    "hostFirewall",
    "sourceCheck",
    "backend",
    "pinPath",
    "cgroupPath",
    "uplinks",
    "conditionsV4",
    "conditionsV6",
    "snat",
    "bandwidth",
    "interfaces",
    "ips",
    "address",
    "gateway",
    "interface",
    "mac",
    "sandbox",
    "cni.dev/valid-attachments",
    "cni.dev/attachments",
    "containerID",
    "ifname",
    "HostPort",
];

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(all_keys()).prop_map(str::to_owned),
        1 => prop::sample::select(all_keys()).prop_map(|key| key.to_uppercase()),
        1 => ".{0,12}",
    ]
}

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|number| json!(number)),
        any::<f64>().prop_map(|number| json!(number)),
        prop::sample::select(vec![
            "1.0.0",
            "1.1.0",
            "0.3.1",
            "tcp",
            "UDP",
            "sctp",
            "DROP",
            "allow",
            "10.22.0.2/16",
            "fd00::2/64",
            "0.0.0.0",
            "::",
            "1-65535",
            "65535-1",
            "new",
            "egress",
            "ebpf",
            "nftables",
            "/sys/fs/bpf/x",
            "eth0",
            "-s 10.0.0.0/8",
            "ip saddr != 10.0.0.1",
        ])
        .prop_map(|text| json!(text)),
        ".{0,24}".prop_map(Value::String),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    scalar().prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(key(), inner, 0..6)
                .prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    })
}

/// A configuration an ADD would accept.
fn valid() -> Value {
    json!({
        "cniVersion": "1.0.0", "name": "net", "type": "cnibpf", "ipMasq": true,
        "filter": [{ "index": 1, "target": "DROP", "proto": "tcp", "dport": "80-90" }],
        "runtimeConfig": { "portMappings": [{ "hostPort": 8080, "containerPort": 80, "protocol": "tcp" }] },
        "prevResult": {
            "cniVersion": "1.0.0",
            "interfaces": [{ "name": "veth1", "mac": "02:00:00:00:00:01" },
                           { "name": "eth0", "mac": "02:00:00:00:00:02", "sandbox": "/run/netns/x" }],
            "ips": [{ "address": "10.22.0.2/16", "gateway": "10.22.0.1", "interface": 1 }]
        }
    })
}

/// `valid()` with the value at the path `choices` picks replaced by `replacement`.
fn mutated(choices: &[usize], replacement: Value) -> Value {
    let mut document = valid();
    replace_at(&mut document, choices, replacement);
    document
}

fn replace_at(value: &mut Value, choices: &[usize], replacement: Value) {
    let Some((choice, rest)) = choices.split_first() else {
        *value = replacement;
        return;
    };
    let child = match value {
        Value::Object(map) if !map.is_empty() => {
            let key = map
                .keys()
                .nth(choice % map.len())
                .cloned()
                .unwrap_or_default();
            map.get_mut(&key)
        }
        Value::Array(items) if !items.is_empty() => {
            let index = choice % items.len();
            items.get_mut(index)
        }
        _ => None,
    };
    match child {
        Some(child) => replace_at(child, rest, replacement),
        None => *value = replacement,
    }
}

fn answered(bytes: &[u8]) {
    let _ = NetConf::parse(bytes);
    let _ = CleanupConf::parse(bytes);
    if let Ok(value) = serde_json::from_slice::<Value>(bytes)
        && let Some(prev) = value.get("prevResult")
    {
        let _ = PrevResult::parse(prev, "eth0");
    }
}

// 256 cases each in `./dev test`; more on demand: PROPTEST_CASES=100000 cargo test fuzz.
proptest! {
    #[test]
    fn any_bytes_are_answered(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        answered(&bytes);
    }

    #[test]
    fn any_json_is_answered(document in value()) {
        answered(&serde_json::to_vec(&document).expect("serialisable"));
    }

    #[test]
    fn a_real_configuration_with_any_part_replaced_is_answered(
        choices in prop::collection::vec(any::<usize>(), 0..6),
        replacement in value(),
    ) {
        answered(&serde_json::to_vec(&mutated(&choices, replacement)).expect("serialisable"));
    }

    #[test]
    fn any_cni_args_are_answered(text in "([A-Za-z_]{0,12}(=[^;]{0,16})?;?){0,6}") {
        let _ = CniArgs::parse(&text);
    }

    #[test]
    fn any_text_as_cni_args_is_answered(text in ".{0,64}") {
        let _ = CniArgs::parse(&text);
    }
}

#[test]
fn the_valid_configuration_is_valid() {
    NetConf::parse(&serde_json::to_vec(&valid()).expect("serialisable"))
        .unwrap_or_else(|error| panic!("{error}"));
}
