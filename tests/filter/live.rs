//! `cnibpf filter apply`: a running attachment's rules inserted, appended and deleted live, on
//! both backends — the next connection judged by the new rules, a held one as its connection
//! state says, the counters of the rules that stay kept, CHECK verifying the changed rules,
//! the change outliving a firewall flush (nftables) and a resize (eBPF), DEL leaving nothing.

use std::{io::Write as _, process::Stdio};

use super::*;

/// The instance's `cnibpf filter <verb>` for the network of `host`, with `extra` arguments and
/// `input` on stdin.
struct FilterCommand<'a> {
    host: &'a SimHost,
    network: String,
    pin_path: String,
}

impl<'a> FilterCommand<'a> {
    fn of(host: &'a SimHost) -> Self {
        Self {
            host,
            network: host.chain.conflist()["name"]
                .as_str()
                .expect("the conflist's name")
                .to_owned(),
            pin_path: host.pin_path.display().to_string(),
        }
    }

    fn run(&self, verb: &str, extra: &[&str], input: Option<&Value>) -> std::process::Output {
        let mut args = vec![
            "filter",
            verb,
            "--pin-path",
            &self.pin_path,
            "--network",
            &self.network,
        ];
        args.extend(extra);
        let mut child = self
            .host
            .cnibpf_command(&args)
            .stdin(if input.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|error| panic!("run cnibpf filter {verb}: {error}"));
        if let Some(input) = input {
            child
                .stdin
                .take()
                .expect("piped stdin")
                .write_all(input.to_string().as_bytes())
                .unwrap_or_else(|error| panic!("write the rules: {error}"));
        }
        child
            .wait_with_output()
            .unwrap_or_else(|error| panic!("wait for cnibpf filter {verb}: {error}"))
    }

    /// Applies `changes` to `container`'s attachment: its line of output.
    fn apply(&self, container: &Container, changes: Value) -> String {
        let output = self.run(
            "apply",
            &["--container", &container.attachment.container_id],
            Some(&changes),
        );
        assert!(
            output.status.success(),
            "filter apply {changes}: {output:?}"
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// The indexes of `container`'s rules, as `filter show` prints them.
    fn indexes(&self, container: &Container) -> Vec<u64> {
        let output = self.run(
            "show",
            &["--container", &container.attachment.container_id],
            None,
        );
        assert!(output.status.success(), "filter show: {output:?}");
        let rules: Value = serde_json::from_slice(&output.stdout).expect("filter show's JSON");
        rules
            .as_array()
            .expect("a rule list")
            .iter()
            .map(|rule| rule["index"].as_u64().expect("an index"))
            .collect()
    }
}

fn changes_a_running_attachments_rules_live(backend: Backend) {
    let keys = json!({ "filter": [
        { "index": 20, "direction": "ingress", "proto": "tcp", "dport": 8081, "target": "DROP" },
    ]});
    let host = SimHost::on(backend, "fl-live", keys);
    host.route_outside_to_containers();
    let first = host.container("c1", Value::Null);
    let second = host.container("c2", Value::Null);
    let _echo = StreamEchoServer::start(&first.netns, Family::V4.any(8080));
    let _blocked = TcpServer::start(&first.netns, Family::V4.any(8081), "8081");
    let filter = FilterCommand::of(&host);
    let target = first.at(Family::V4, 8080);
    assert!(tcp_dropped(&host.outside, first.at(Family::V4, 8081)));
    let counted_on_20 = hits(&inspected_filter(&host, &first), Some(20));
    assert!(counted_on_20 > 0, "rule 20 counted the dropped SYN");
    let mut held = Conversation::open(&host.outside, target)
        .unwrap_or_else(|error| panic!("a connection before the change: {error}"));
    held.exchange(b"before", CLIENT_TIMEOUT)
        .unwrap_or_else(|error| panic!("before the change: {error}"));

    // Insert: new connections from the outside are dropped; the held one is not new.
    let said = filter.apply(
        &first,
        json!([{ "action": "insert", "index": 10, "src": format!("{OUTSIDE_ADDR}/32"),
                 "proto": "tcp", "dport": 8080, "connstate": "new", "target": "DROP" }]),
    );
    assert!(
        said.contains(first.attachment.container_id.as_str())
            && said.contains("inserted rule 10; rules now 10, 20"),
        "{said}"
    );
    assert!(
        tcp_dropped(&host.outside, target),
        "a new connection meets rule 10"
    );
    held.exchange(b"during", CLIENT_TIMEOUT)
        .unwrap_or_else(|error| panic!("the held connection is not new: {error}"));
    let changed = inspected_filter(&host, &first);
    assert!(hits(&changed, Some(10)) > 0, "rule 10 counts: {changed:#}");
    assert!(
        hits(&changed, Some(20)) >= counted_on_20,
        "rule 20's counter is kept: {changed:#}"
    );
    host.check(&first)
        .unwrap_or_else(|error| panic!("CHECK verifies the changed rules: {error}"));
    assert_eq!(
        filter.indexes(&second),
        [20],
        "the other pod is not reached"
    );

    // A list whose first change is valid and whose second is not changes nothing.
    let refused = filter.run(
        "apply",
        &["--container", &first.attachment.container_id],
        Some(&json!([
            { "action": "append", "target": "ALLOW" },
            { "action": "delete", "index": 99 },
        ])),
    );
    assert!(!refused.status.success(), "{refused:?}");
    let said = String::from_utf8_lossy(&refused.stdout);
    assert!(
        said.contains("unchanged: filter[1].index: no rule has index 99"),
        "{said}"
    );
    assert_eq!(filter.indexes(&first), [10, 20], "nothing changed");

    // Append without an index takes the next multiple of ten; delete removes rule 10, and new
    // connections pass again.
    let said = filter.apply(
        &first,
        json!([
            { "action": "append", "proto": "udp", "target": "DROP" },
            { "action": "delete", "index": 10 },
        ]),
    );
    assert!(
        said.contains("appended rule 30, deleted rule 10; rules now 20, 30"),
        "{said}"
    );
    Conversation::open(&host.outside, target)
        .and_then(|mut again| again.exchange(b"after", CLIENT_TIMEOUT))
        .unwrap_or_else(|error| panic!("without rule 10 new connections pass: {error}"));
    host.check(&first)
        .unwrap_or_else(|error| panic!("CHECK after the second change: {error}"));

    // The whole network: each attachment says what it did.
    let every = filter.run(
        "apply",
        &[],
        Some(&json!([{ "action": "insert", "index": 5, "proto": "icmp", "target": "DROP" }])),
    );
    assert!(every.status.success(), "{every:?}");
    let said = String::from_utf8_lossy(&every.stdout);
    assert_eq!(said.lines().count(), 2, "{said}");
    assert_eq!(filter.indexes(&first), [5, 20, 30]);
    assert_eq!(filter.indexes(&second), [5, 20]);

    // The change outlives what the configuration's rules outlive.
    match backend {
        Backend::Nftables => {
            host.host.exec(&["nft", "flush", "ruleset"]);
            host.check(&first)
                .unwrap_or_else(|error| panic!("CHECK after a firewall flush: {error}"));
        }
        Backend::Ebpf => {
            let resized = host.cnibpf(&[
                "load",
                "--pin-path",
                &host.pin_path.display().to_string(),
                "--max-flows",
                "131072",
            ]);
            assert!(resized.status.success(), "resize: {resized:?}");
        }
    }
    assert_eq!(
        filter.indexes(&first),
        [5, 20, 30],
        "after {backend:?}'s upheaval"
    );
    assert!(tcp_dropped(&host.outside, first.at(Family::V4, 8081)));
    host.check(&second)
        .unwrap_or_else(|error| panic!("CHECK of the other pod: {error}"));

    for container in [&first, &second] {
        host.del(container)
            .unwrap_or_else(|error| panic!("DEL: {error}"));
    }
    assert!(host.holds_no_state(), "DEL leaves nothing of either");
    let gone = filter.run(
        "apply",
        &[],
        Some(&json!([{ "action": "delete", "index": 5 }])),
    );
    assert!(!gone.status.success(), "no attachment left: {gone:?}");
}

/// An attachment whose configuration gives it no filter gets its first rules live (and CHECK
/// takes them for its own); a re-ADD puts its configuration's rules back over a live change,
/// none or some.
fn an_unfiltered_attachment_gets_rules_live_and_a_re_add_restores_the_configuration(
    backend: Backend,
) {
    let host = SimHost::on(backend, "fl-live-none", json!({}));
    host.route_outside_to_containers();
    let plain = host.container("c1", Value::Null);
    let _server = TcpServer::start(&plain.netns, Family::V4.any(8080), "plain");
    let target = plain.at(Family::V4, 8080);
    let filter = FilterCommand::of(&host);
    let served = || tcp_request(&host.outside, target);
    assert_eq!(served().as_deref(), Ok("plain"), "unfiltered");
    let said = filter.apply(
        &plain,
        json!([{ "action": "insert", "index": 10, "src": format!("{OUTSIDE_ADDR}/32"),
                 "proto": "tcp", "dport": 8080, "target": "DROP" }]),
    );
    assert!(said.contains("inserted rule 10; rules now 10"), "{said}");
    assert!(tcp_dropped(&host.outside, target), "its first rule drops");
    host.check(&plain)
        .unwrap_or_else(|error| panic!("CHECK takes the live rules for its own: {error}"));
    host.readd_with(&plain, json!({}))
        .unwrap_or_else(|error| panic!("re-ADD without a filter: {error}"));
    assert_eq!(
        filter.indexes(&plain),
        Vec::<u64>::new(),
        "unfiltered again"
    );
    assert_eq!(served().as_deref(), Ok("plain"), "after the re-ADD");
    host.check(&plain)
        .unwrap_or_else(|error| panic!("CHECK after the re-ADD: {error}"));

    let rules = json!({ "filter": [{ "index": 10, "proto": "udp", "target": "DROP" }] });
    host.readd_with(&plain, rules.clone())
        .unwrap_or_else(|error| panic!("re-ADD with a filter: {error}"));
    filter.apply(&plain, json!([{ "action": "append", "target": "DROP" }]));
    assert_eq!(filter.indexes(&plain), [10, 20]);
    host.readd_with(&plain, rules)
        .unwrap_or_else(|error| panic!("re-ADD: {error}"));
    assert_eq!(
        filter.indexes(&plain),
        [10],
        "a re-ADD starts again from the configuration"
    );
    host.del(&plain)
        .unwrap_or_else(|error| panic!("DEL: {error}"));
    assert!(host.holds_no_state(), "DEL leaves nothing");
}

/// A REJECT rule and a rule that logs, applied and deleted live: what they need besides the
/// rules (nftables: the reject and log chains) comes and goes with them, CHECK holds each time.
fn a_reject_and_a_logging_rule_come_and_go_live(backend: Backend) {
    let host = SimHost::on(backend, "fl-live-rej", json!({}));
    host.route_outside_to_containers();
    let container = host.container("c1", Value::Null);
    let _server = TcpServer::start(&container.netns, Family::V4.any(8080), "served");
    let target = container.at(Family::V4, 8080);
    let filter = FilterCommand::of(&host);
    let checked = |what: &str| {
        host.check(&container)
            .unwrap_or_else(|error| panic!("CHECK {what}: {error}"));
    };
    filter.apply(
        &container,
        json!([{ "action": "insert", "index": 10, "src": format!("{OUTSIDE_ADDR}/32"),
                 "proto": "tcp", "dport": 8080, "target": "REJECT" }]),
    );
    match tcp_request(&host.outside, target) {
        Err(error) if error.contains("refused") => {}
        other => panic!("the live REJECT refuses: {other:?}"),
    }
    checked("with the REJECT rule");
    filter.apply(
        &container,
        json!([{ "action": "delete", "index": 10 },
               { "action": "insert", "index": 20, "proto": "tcp", "target": "ALLOW", "log": true }]),
    );
    assert_eq!(tcp_request(&host.outside, target).as_deref(), Ok("served"));
    checked("with the logging rule");
    filter.apply(&container, json!([{ "action": "delete", "index": 20 }]));
    assert_eq!(filter.indexes(&container), Vec::<u64>::new());
    checked("without either");
    host.del(&container)
        .unwrap_or_else(|error| panic!("DEL: {error}"));
    assert!(host.holds_no_state(), "DEL leaves nothing");
}

for_both_backends!(
    changes_a_running_attachments_rules_live,
    an_unfiltered_attachment_gets_rules_live_and_a_re_add_restores_the_configuration,
    a_reject_and_a_logging_rule_come_and_go_live,
);
