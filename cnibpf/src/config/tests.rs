//! Parsing and validation of the whole configuration, key by key.

use serde_json::json;

use super::*;
use crate::model::{Direction, NetworkName, PortRange, RuleChange, RuleProtocol};

fn parse_value(extra: Value) -> Result<NetConf, ConfigError> {
    let mut config = json!({ "cniVersion": "1.0.0", "name": "n", "type": "cnibpf" });
    for (key, value) in extra.as_object().expect("object") {
        config[key] = value.clone();
    }
    NetConf::parse(config.to_string().as_bytes())
}

fn parse(extra: Value) -> NetConf {
    parse_value(extra).expect("valid configuration")
}

fn error(extra: Value) -> String {
    parse_value(extra).expect_err("invalid").to_string()
}

#[test]
fn a_del_for_the_replaced_portmap_is_built_as_libcni_builds_a_chained_plugins() {
    let portmap =
        json!({ "type": "portmap", "snat": true, "capabilities": { "portMappings": true } });
    let mappings = json!([{ "hostPort": 8080, "containerPort": 80, "protocol": "tcp" }]);
    let del = |entry: Value| {
        let mut config = json!({ "cniVersion": "0.4.0", "name": "k8s", "type": "cnibpf" });
        for (key, value) in entry.as_object().expect("object") {
            config[key] = value.clone();
        }
        CleanupConf::parse(config.to_string().as_bytes())
            .expect("a DEL's configuration")
            .replaced_portmap
            .map(|bytes| serde_json::from_slice::<Value>(&bytes).expect("JSON"))
    };
    let built = del(json!({
        "cnibpfInstall": { "source": "10-k8s.conflist", "replacedPortmap": portmap, "portmapIndex": 1 },
        "runtimeConfig": { "portMappings": mappings, "bandwidth": { "ingressRate": 1 } },
        "prevResult": { "cniVersion": "0.4.0", "ips": [] },
    }));
    assert_eq!(
        built,
        Some(json!({ "type": "portmap", "snat": true,
            "capabilities": { "portMappings": true },
            "cniVersion": "0.4.0", "name": "k8s",
            "runtimeConfig": { "portMappings": mappings },
            "prevResult": { "cniVersion": "0.4.0", "ips": [] } }))
    );
    let no_host_ports = del(json!({
        "cnibpfInstall": { "replacedPortmap": portmap },
        "runtimeConfig": { "portMappings": [] },
    }));
    assert_eq!(no_host_ports, None, "portmap's DEL would do nothing");
    assert_eq!(
        del(json!({ "runtimeConfig": { "portMappings": mappings } })),
        None,
        "no portmap replaced"
    );
    assert_eq!(
        del(json!({ "cnibpfInstall": { "replacedPortmap": "portmap" },
            "runtimeConfig": { "portMappings": mappings } })),
        None,
        "a record that is not a plugin is none"
    );
}

#[test]
fn rules_are_evaluated_in_index_order_whatever_the_array_order() {
    let conf = parse(json!({ "filter": [
        { "index": 20, "target": "allow", "proto": "TCP", "dport": "1000-2000" },
        { "index": 10, "target": "Drop", "src": "172.64.0.0/13" },
    ] }));
    let indexes: Vec<u32> = conf.plugin.filter.iter().map(|rule| rule.index).collect();
    assert_eq!(indexes, [10, 20]);
    assert_eq!(conf.plugin.filter[0].target, Target::Drop);
    assert_eq!(conf.plugin.filter[1].protocol, RuleProtocol::Tcp);
    assert_eq!(
        conf.plugin.filter[1].dport,
        Some(PortRange {
            low: 1000,
            high: 2000
        })
    );
    assert_eq!(conf.plugin.filter[1].direction, Direction::Both);
}

/// The CNI filter proposal writes an `action` on each rule: a configuration's rules are
/// added whichever way it says so, and `delete`, which only a running attachment's rules can
/// take (`cnibpf filter apply`), is refused naming the key.
#[test]
fn a_rules_action_adds_it_and_delete_is_refused_in_a_configuration() {
    let with_actions = parse(json!({ "filter": [
        { "index": 20, "action": "Append", "target": "ALLOW", "proto": "tcp" },
        { "index": 10, "action": "insert", "target": "DROP", "src": "172.64.0.0/13" },
    ] }));
    let without = parse(json!({ "filter": [
        { "index": 20, "target": "ALLOW", "proto": "tcp" },
        { "index": 10, "target": "DROP", "src": "172.64.0.0/13" },
    ] }));
    assert_eq!(with_actions.plugin.filter, without.plugin.filter);
    let message = error(json!({ "filter": [
        { "index": 10, "target": "DROP" },
        { "index": 20, "action": "delete", "target": "DROP" },
    ] }));
    assert!(
        message.starts_with("filter[1].action: \"delete\" removes a rule of a running attachment"),
        "{message}"
    );
    let message =
        error(json!({ "filter": [{ "index": 1, "action": "replace", "target": "DROP" }] }));
    assert!(
        message.starts_with("filter[0].action: expected insert, append or delete"),
        "{message}"
    );
}

/// `cnibpf filter apply`'s list: each rule's action is required, insert and delete need an
/// index, append may leave it out, delete with more than the index gives the rule it must
/// match; every other key is validated as in a configuration, with the same message.
#[test]
fn rule_changes_need_an_action_and_are_validated_as_rules() {
    let changes = |value: Value| parse_rule_changes(value.to_string().as_bytes());
    let parsed = changes(json!([
        { "action": "insert", "index": 15, "target": "DROP", "src": "203.0.113.0/24" },
        { "action": "append", "target": "ALLOW", "proto": "udp" },
        { "action": "delete", "index": 10 },
        { "action": "Delete", "index": 20, "target": "allow" },
    ]))
    .expect("valid changes");
    assert!(matches!(&parsed[0], RuleChange::Insert(rule) if rule.index == 15));
    assert!(
        matches!(&parsed[1], RuleChange::Append { index_given: false, rule }
        if rule.protocol == RuleProtocol::Udp)
    );
    assert_eq!(
        parsed[2],
        RuleChange::Delete {
            index: 10,
            matching: None
        }
    );
    assert!(
        matches!(&parsed[3], RuleChange::Delete { index: 20, matching: Some(rule) }
        if rule.target == Target::Allow)
    );
    let message = |value: Value| changes(value).expect_err("invalid").to_string();
    assert_eq!(
        message(json!([{ "index": 1, "target": "DROP" }])),
        "filter[0].action: is required: insert, append or delete"
    );
    assert_eq!(
        message(json!([{ "action": "insert", "target": "DROP" }])),
        "filter[0].index: is required"
    );
    assert_eq!(
        message(json!([{ "action": "delete" }])),
        "filter[0].index: is required"
    );
    assert_eq!(message(json!([])), "filter: the list holds no change");
    // The same message as a configuration's rule gets.
    let in_a_configuration =
        error(json!({ "filter": [{ "index": 1, "target": "DROP", "sport": 80 }] }));
    assert_eq!(
        message(json!([{ "action": "append", "index": 1, "target": "DROP", "sport": 80 }])),
        in_a_configuration
    );
    assert!(
        message(json!([{ "action": "append", "target": "DROP", "dports": 80 }]))
            .starts_with("filter[0].dports: unknown rule key"),
    );
}

#[test]
fn defaults_and_wildcards() {
    let conf = parse(json!({ "runtimeConfig": { "portMappings": [
        { "hostPort": 80, "containerPort": 8080, "hostIP": "" },
        { "hostPort": 81, "containerPort": 8081, "hostIP": "::", "protocol": "UDP" },
        { "hostPort": 82, "containerPort": 8082, "hostIP": "10.0.0.1" },
    ] } }));
    assert_eq!(conf.plugin.backend, BackendChoice::Auto);
    assert_eq!(conf.plugin.pin_path, PathBuf::from(paths::DEFAULT_PIN_PATH));
    assert_eq!(conf.plugin.filter_default, Target::Allow);
    assert!(!conf.plugin.ip_masq);
    assert_eq!(conf.port_mappings[0].host_ip, None);
    assert_eq!(conf.port_mappings[0].protocol, Protocol::Tcp);
    assert_eq!(conf.port_mappings[1].host_ip, None);
    assert_eq!(conf.port_mappings[1].protocol, Protocol::Udp);
    assert_eq!(
        conf.port_mappings[2].host_ip,
        Some("10.0.0.1".parse().expect("literal"))
    );
}

#[test]
fn containerd_spells_port_mapping_keys_like_go_fields() {
    let conf = parse(json!({
        "runtimeConfig": { "portMappings": [
            { "HostPort": 18080, "ContainerPort": 80, "Protocol": "tcp", "HostIP": "" },
            { "HostPort": 18081, "ContainerPort": 81, "Protocol": "UDP", "HostIP": "127.0.0.1" },
        ], "bandwidth": { "IngressRate": 1 }, "io.kubernetes.cri.pod-annotations": { "a": "b" },
           "cgroupPath": "/kubepods/x", "dns": { "servers": ["10.96.0.10"] }, "ipRanges": [[{ "subnet": "10.0.0.0/8" }]] },
    }));
    assert_eq!(
        conf.port_mappings,
        [
            PortMapping {
                host_port: 18080,
                container_port: 80,
                protocol: Protocol::Tcp,
                host_ip: None
            },
            PortMapping {
                host_port: 18081,
                container_port: 81,
                protocol: Protocol::Udp,
                host_ip: Some("127.0.0.1".parse().expect("literal"))
            },
        ]
    );
}

#[test]
fn plugin_keys_fold_too_but_a_rule_key_that_is_not_ours_stays_an_error() {
    let conf = parse(
        json!({ "IPMasq": true, "Filter": [{ "Index": 1, "TARGET": "DROP", "Src": "10.0.0.0/8" }] }),
    );
    assert!(conf.plugin.ip_masq);
    assert_eq!(
        conf.plugin.filter[0]
            .src
            .map(|net| net.to_string())
            .as_deref(),
        Some("10.0.0.0/8")
    );
    let message = error(json!({ "filter": [{ "index": 1, "target": "DROP", "Dports": 80 }] }));
    assert!(
        message.starts_with("filter[0].Dports: unknown rule key"),
        "{message}"
    );
    let message = error(
        json!({ "filter": [{ "index": 1, "target": "DROP", "src": "10.0.0.0/8", "SRC": "0.0.0.0/0" }] }),
    );
    assert!(message.starts_with("filter[0]: keys"), "{message}");
}

#[test]
fn messages_name_the_key_and_the_value() {
    assert_eq!(
        error(
            json!({ "runtimeConfig": { "portMappings": [{ "hostPort": "8080", "containerPort": 80 }] } })
        ),
        "runtimeConfig.portMappings[0].hostPort: expected a port 1-65535, got string \"8080\""
    );
    assert_eq!(
        error(json!({ "runtimeConfig": { "portMappings": [{ "hostPort": 1 }] } })),
        "runtimeConfig.portMappings[0].containerPort: is required"
    );
    assert_eq!(
        error(json!({ "ipMasq": "yes" })),
        "ipMasq: expected true or false, got string \"yes\""
    );
    assert_eq!(
        error(json!({ "capabilities": { "portMappings": 1 } })),
        "capabilities.portMappings: expected true or false, got number 1"
    );
    assert_eq!(
        error(json!({ "filter": [{ "index": -1, "target": "DROP" }] })),
        "filter[0].index: expected an integer from 0 to 4294967295, got number -1"
    );
    assert_eq!(
        error(
            json!({ "filter": [{ "index": 1, "target": "DROP", "proto": "tcp", "dport": "90-80" }] })
        ),
        "filter[0].dport: range 90-80 is empty: the low port is above the high port"
    );
    assert_eq!(
        error(json!({ "ipMasqExclude": ["10.0.0.0/33"] })),
        "ipMasqExclude[0]: expected a CIDR such as 10.0.0.0/8 or an address, got \"10.0.0.0/33\""
    );
    assert_eq!(
        error(json!({ "cniVersion": 1 })),
        "cniVersion: expected a string, got number 1"
    );
    assert_eq!(
        error(json!({ "prevResult": "x" })),
        "prevResult: expected an object, got string \"x\""
    );
    assert_eq!(
        NetConf::parse(b"[]").expect_err("array").to_string(),
        "(top level): expected a JSON object, got an array"
    );
}

#[test]
fn cidrs_are_normalised_and_addresses_become_host_routes() {
    let conf = parse(json!({ "ipMasqExclude": ["10.1.2.3/8", "2001:db8::1"] }));
    assert_eq!(conf.plugin.ip_masq_exclude[0].to_string(), "10.0.0.0/8");
    assert_eq!(
        conf.plugin.ip_masq_exclude[1].to_string(),
        "2001:db8::1/128"
    );
}

#[test]
fn versions_order_and_verb_minimums() {
    assert!(CniVersion::parse("0.3.1").expect("supported") < CniVersion::V0_4_0);
    assert!(CniVersion::parse("1.1.0").expect("supported") == CniVersion::V1_1_0);
    assert!(CniVersion::parse("2.0.0").is_err());
    let old = parse(json!({ "cniVersion": "0.3.0" }));
    assert!(old.require_version("CHECK").is_err());
    assert!(old.require_version("ADD").is_ok());
    assert_eq!(
        CniVersion::answer_version(br#"{"CNIVERSION":"0.4.0"}"#),
        "0.4.0"
    );
    assert_eq!(CniVersion::answer_version(b"not json"), "1.1.0");
}

#[test]
fn gc_takes_a_null_list_of_valid_attachments_as_empty_and_a_missing_one_as_absent() {
    let null = parse(json!({ "cni.dev/valid-attachments": null }));
    assert_eq!(
        null.valid_attachments,
        Some(Vec::new()),
        "CRI-O without pods"
    );
    let legacy_null = parse(json!({ "cni.dev/attachments": null }));
    assert_eq!(legacy_null.valid_attachments, Some(Vec::new()));
    assert_eq!(parse(json!({})).valid_attachments, None);
}

#[test]
fn gc_reads_either_spelling_of_the_valid_attachments() {
    let conf = parse(json!({ "cni.dev/attachments": [{ "ContainerID": "a", "IfName": "eth0" }] }));
    assert_eq!(
        conf.valid_attachments,
        Some(vec![AttachmentRef {
            container_id: "a".to_owned(),
            ifname: "eth0".to_owned()
        }])
    );
}

/// The keys of the filter proposal's thread: a rule's networks, REJECT, `log` — each bad value
/// refused naming its key; a rule of the attachment's own network for its egress is taken (its
/// source is always a member: the rule matches what the pod sends).
#[test]
fn networks_reject_and_log_are_validated_key_by_key() {
    let rule = |extra: Value| {
        let mut rule = json!({ "index": 1, "target": "ALLOW" });
        for (key, value) in extra.as_object().expect("object") {
            rule[key] = value.clone();
        }
        json!({ "filter": [rule] })
    };
    let conf = parse(rule(
        json!({ "srcNetwork": "dmz", "dstNetwork": "protected",
        "target": "reject", "log": true }),
    ));
    let parsed = &conf.plugin.filter[0];
    assert_eq!(
        (
            parsed.src_network.as_ref().map(NetworkName::as_str),
            parsed.dst_network.as_ref().map(NetworkName::as_str),
            parsed.target,
            parsed.log
        ),
        (Some("dmz"), Some("protected"), Target::Reject, true)
    );
    let own = parse(rule(json!({ "srcNetwork": "n", "direction": "egress" })));
    assert_eq!(
        own.plugin.filter[0]
            .src_network
            .as_ref()
            .map(NetworkName::as_str),
        Some("n")
    );
    for (extra, expected) in [
        (
            json!({ "target": "REFUSE" }),
            "filter[0].target: expected \"ALLOW\", \"DROP\" or \"REJECT\", got \"REFUSE\"",
        ),
        (
            json!({ "log": "yes" }),
            "filter[0].log: expected true or false, got string \"yes\"",
        ),
        (
            json!({ "srcNetwork": "" }),
            "filter[0].srcNetwork: \"\" is not a valid network name",
        ),
        (
            json!({ "dstNetwork": "dmz/1" }),
            "filter[0].dstNetwork: \"dmz/1\" is not a valid network name",
        ),
        (
            json!({ "srcNetwork": 7 }),
            "filter[0].srcNetwork: expected a string, got number 7",
        ),
    ] {
        let message = error(rule(extra.clone()));
        assert!(message.starts_with(expected), "{extra}: {message}");
    }
    assert!(
        error(json!({ "filterDefault": "REJECT" }))
            .starts_with("filterDefault: is \"ALLOW\" or \"DROP\""),
        "a default does not REJECT"
    );
}
