//! Operating a filter: drop counters and `cnibpf monitor`, DEL, GC and CHECK, `cnibpf filter
//! show`.

use super::*;

#[test]
fn drops_are_counted_per_rule_and_streamed_by_monitor() {
    let host = SimHost::new(
        "fl-monitor",
        json!({ "filter": [
            { "index": 10, "proto": "tcp", "dport": 8080, "direction": "ingress", "target": "DROP" },
        ]}),
    );
    host.route_outside_to_containers();
    // Named by the runtime, as containerd names a pod: the events name it too.
    let container = host
        .add_container_with_args(
            "c1",
            Value::Null,
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-0",
        )
        .unwrap_or_else(|error| panic!("ADD failed: {error}"));
    let mut json_monitor = start_monitor(&host, true);
    let json_lines = monitor_lines(&mut json_monitor);
    // A ring buffer has one read position: a second reader would take events from the first.
    assert!(
        eventually(Duration::from_secs(5), || host.monitor_following()),
        "the monitor took its lock"
    );
    let mut second = start_monitor(&host, false);
    if !eventually(Duration::from_secs(5), || {
        second.try_wait().is_ok_and(|status| status.is_some())
    }) {
        let _ = second.kill();
        panic!("a second monitor ran beside the first");
    }
    let second = second.wait_with_output().expect("second monitor");
    let refusal = String::from_utf8_lossy(&second.stderr);
    assert!(
        !second.status.success() && refusal.contains("another cnibpf monitor follows"),
        "a second monitor is refused: {second:?}"
    );
    // The monitor opens the ring buffer before the traffic starts.
    std::thread::sleep(Duration::from_millis(300));
    for family in Family::BOTH {
        let _open = TcpServer::start(&container.netns, family.any(8081), "open");
        let _guarded = TcpServer::start(&container.netns, family.any(8080), "guarded");
        assert_eq!(
            tcp_request(&host.outside, container.at(family, 8081)).as_deref(),
            Ok("open")
        );
        assert!(tcp_dropped(&host.outside, container.at(family, 8080)));
        let source = family.outside().to_string();
        let destination = container.at(family, 0).ip().to_string();
        let Some(event) = first_line_matching(&json_lines, |line| line.contains(&source)) else {
            let _ = json_monitor.kill();
            let output = json_monitor.wait_with_output().expect("monitor output");
            panic!("no {family:?} drop event from the JSON monitor: {output:?}");
        };
        let event: Value = serde_json::from_str(&event)
            .unwrap_or_else(|error| panic!("monitor printed no JSON ({error}): {event}"));
        assert_eq!(event["network"], host.network(), "{event}");
        assert_eq!(
            event["containerID"], container.attachment.container_id,
            "{event}"
        );
        assert_eq!(event["ifname"], "eth0", "{event}");
        assert_eq!(event["pod"], "shop/web-0", "{event}");
        assert_eq!(event["direction"], "ingress", "{event}");
        assert_eq!(event["rule"], 10, "{event}");
        assert_eq!(event["reason"], "filter_rule", "{event}");
        assert_eq!(event["protocol"], "tcp", "{event}");
        assert_eq!(event["src"], source, "{event}");
        assert_eq!(event["dst"], destination, "{event}");
        assert_eq!(event["dport"], 8080, "{event}");
        assert!(
            event["time"]
                .as_str()
                .is_some_and(|time| time.ends_with('Z')),
            "{event}"
        );
    }
    interrupt(json_monitor);
    let mut text_monitor = start_monitor(&host, false);
    let text_lines = monitor_lines(&mut text_monitor);
    assert!(
        eventually(Duration::from_secs(5), || host.monitor_following()),
        "the text monitor took its lock"
    );
    std::thread::sleep(Duration::from_millis(300));
    for family in Family::BOTH {
        let _guarded = TcpServer::start(&container.netns, family.any(8080), "guarded");
        assert!(tcp_dropped(&host.outside, container.at(family, 8080)));
        let source = family.outside().to_string();
        let line = first_line_matching(&text_lines, |line| line.contains(&source))
            .unwrap_or_else(|| panic!("no {family:?} drop event from the text monitor"));
        assert!(
            line.contains("eth0 pod shop/web-0 ingress DROP by rule 10: tcp")
                && line.contains(":8080"),
            "{line}"
        );
    }
    interrupt(text_monitor);
    let filter = inspected_filter(&host, &container);
    assert!(
        hits(&filter, Some(10)) >= 4,
        "both families' SYNs, twice: {filter:#}"
    );
    assert!(
        hits(&filter, None) >= 4,
        "the open connections' packets: {filter:#}"
    );
    let dumped = host.bpftool_dump("filter_hits");
    let per_cpu_rule_10: u64 = dumped
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|entry| {
            entry["formatted"]["values"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|cpu| cpu["value"]["rules"][0]["packets"].as_u64())
        .sum();
    assert_eq!(
        per_cpu_rule_10,
        hits(&filter, Some(10)),
        "bpftool shows the same per-CPU counters: {dumped:#}"
    );
}

fn del_gc_and_check_cover_the_filter_and_its_connections(backend: Backend) {
    let keys = json!({ "filterDefault": "DROP", "filter": [
        { "index": 1, "direction": "egress", "target": "ALLOW" },
    ]});
    let host = SimHost::on(backend, "fl-life", keys.clone());
    host.route_outside_to_containers();
    let first = host.container("c1", Value::Null);
    let second = host.container("c2", Value::Null);
    let _server = TcpServer::start(&host.outside, Family::V4.any(8080), "out");
    for container in [&first, &second] {
        assert_eq!(
            tcp_request(&container.netns, SocketAddr::from((OUTSIDE_ADDR, 8080))).as_deref(),
            Ok("out")
        );
    }
    host.check(&first)
        .unwrap_or_else(|error| panic!("CHECK: {error}"));
    let ifindex = |container: &Container| -> u32 {
        let name = host.host_interface(container);
        host.host
            .run(move || nix::net::if_::if_nametoindex(name.as_str()).expect("host interface"))
    };
    // The filter's state of an attachment: (rule set present, what else of it is left: its
    // tracked connections on eBPF; on nftables, where the kernel's conntrack tracks them, the
    // rules and dispatch elements that lead to its chains).
    let state_of = |(ifindex, owner): (u32, u64), owner_chain: &str| -> (bool, usize) {
        match backend {
            Backend::Ebpf if !host.pin_path.exists() => (false, 0),
            Backend::Ebpf => (
                host.pinned_hash_map::<u32, FilterSet>("filters")
                    .get(&ifindex, 0)
                    .is_ok(),
                host.connections()
                    .iter()
                    .filter(|(_, connection)| connection.has(owner, PART_FILTER))
                    .count(),
            ),
            Backend::Nftables => {
                let ruleset = host.nft_ruleset();
                (
                    ruleset.contains(&format!("chain {owner_chain}_in"))
                        && ruleset.contains(&format!("chain {owner_chain}_out")),
                    ruleset.matches(owner_chain).count(),
                )
            }
        }
    };
    let chain_of = |container: &Container| {
        let owner = inspected_owner(&host, container);
        format!("f_{owner}")
    };
    let (first_ifindex, first_chain) = (ifindex(&first), chain_of(&first));
    let (second_ifindex, second_chain) = (ifindex(&second), chain_of(&second));
    let first_interface = (first_ifindex, host.owner_of(&first));
    let second_interface = (second_ifindex, host.owner_of(&second));
    match backend {
        Backend::Ebpf => {
            let mut filters = host.pinned_hash_map::<u32, FilterSet>("filters");
            filters.remove(&first_ifindex).expect("remove the filter");
        }
        Backend::Nftables => {
            host.host.exec(&[
                "nft",
                "flush",
                "chain",
                "inet",
                "cnibpf",
                &format!("{first_chain}_in"),
            ]);
        }
    }
    let error = host
        .check(&first)
        .expect_err("CHECK must notice the missing filter");
    assert_eq!(error.0.error_code(), Some(105), "{error}");
    host.readd_with(&first, keys)
        .unwrap_or_else(|error| panic!("re-ADD repairs: {error}"));
    host.check(&first)
        .unwrap_or_else(|error| panic!("CHECK after repair: {error}"));
    let (present, held) = state_of(first_interface, &first_chain);
    assert!(present, "the filter is in place");
    assert!(
        held >= 1,
        "connections are tracked (eBPF), dispatch leads to the chains (nftables)"
    );
    host.del(&first)
        .unwrap_or_else(|error| panic!("DEL: {error}"));
    assert_eq!(
        state_of(first_interface, &first_chain),
        (false, 0),
        "DEL removes the filter and the attachment's connections"
    );
    assert!(
        state_of(second_interface, &second_chain).0,
        "the other attachment keeps its filter"
    );
    host.chain
        .gc(&[])
        .unwrap_or_else(|error| panic!("GC: {error}"));
    assert_eq!(
        state_of(second_interface, &second_chain),
        (false, 0),
        "GC removes the filter of an attachment not listed"
    );
    assert!(
        host.inspect()["attachments"]
            .as_array()
            .is_none_or(Vec::is_empty)
    );
}

for_both_backends!(
    del_gc_and_check_cover_the_filter_and_its_connections,
    filter_show_prints_the_rules_in_effect_as_a_configuration_writes_them,
);

/// `cnibpf filter show`: one container's rules as a rule list in the configuration's shape,
/// each with the proposal's `action`, in index order, defaults left out; without a container
/// every attachment of the network with its default; a container the network does not have is
/// an error naming it.
fn filter_show_prints_the_rules_in_effect_as_a_configuration_writes_them(backend: Backend) {
    let keys = json!({ "filterDefault": "DROP", "filter": [
        { "index": 20, "dst": "10.22.0.0/16", "proto": "tcp", "dport": 80,
          "connstate": "new", "target": "ALLOW" },
        { "index": 10, "src": "172.64.0.0/13", "target": "drop", "direction": "ingress",
          "action": "append" },
    ]});
    let host = SimHost::on(backend, "fl-show", keys);
    let first = host.container("c1", Value::Null);
    let second = host.container("c2", Value::Null);
    let network = host.chain.conflist()["name"]
        .as_str()
        .expect("the conflist's name")
        .to_owned();
    let pin_path = host.pin_path.display().to_string();
    let show = |extra: &[&str]| {
        let mut args = vec![
            "filter",
            "show",
            "--pin-path",
            &pin_path,
            "--network",
            &network,
        ];
        args.extend(extra);
        host.cnibpf(&args)
    };
    let rules = json!([
        { "index": 10, "action": "insert", "target": "DROP", "src": "172.64.0.0/13",
          "direction": "ingress" },
        { "index": 20, "action": "insert", "target": "ALLOW", "dst": "10.22.0.0/16",
          "proto": "tcp", "dport": 80, "connstate": "new" },
    ]);
    let parsed = |output: std::process::Output| -> Value {
        assert!(output.status.success(), "filter show: {output:?}");
        serde_json::from_slice(&output.stdout)
            .unwrap_or_else(|error| panic!("filter show's JSON: {error}: {output:?}"))
    };
    let container_id = first.attachment.container_id.as_str();
    assert_eq!(parsed(show(&["--container", container_id])), rules);
    assert_eq!(
        parsed(show(&["--container", container_id, "--ifname", "eth0"])),
        rules
    );
    let every = parsed(show(&[]));
    let shown: Vec<(&str, &str, &Value)> = every
        .as_array()
        .expect("a list of attachments")
        .iter()
        .map(|attachment| {
            assert_eq!(attachment["rules"], rules, "{every:#}");
            (
                attachment["containerId"].as_str().expect("containerId"),
                attachment["filterDefault"].as_str().expect("filterDefault"),
                &attachment["ifname"],
            )
        })
        .collect();
    let mut expected = [
        (container_id, "DROP", &json!("eth0")),
        (
            second.attachment.container_id.as_str(),
            "DROP",
            &json!("eth0"),
        ),
    ];
    expected.sort_by_key(|(id, ..)| *id);
    assert_eq!(shown, expected);
    let missing = show(&["--container", "no-such-container"]);
    assert!(!missing.status.success(), "{missing:?}");
    let said = String::from_utf8_lossy(&missing.stderr);
    assert!(
        said.contains(&format!(
            "no attachment of network {network:?} matches container no-such-container"
        )),
        "{said}"
    );
}
