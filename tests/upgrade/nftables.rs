//! nftables tables of older layouts: one no build migrates, drained pod by pod; the window's,
//! migrated in place with its pods' traffic flowing.

use std::{path::Path, process::Command, time::Duration};

use cnibpf_tests::{
    SimHost, chain,
    live::{LivePod, pod_keys},
    topology::port_mappings,
    traffic::{Conversation, TcpServer, tcp_request},
};
use serde_json::json;

use super::{Installed, WAIT, inspected_rule_packets};

/// What marks a table of this build's layout: a set named after the state it was made from.
pub const LAYOUT_4_MARKER: &str = "set layout_4_instance_";

/// An nftables table of a layout no build migrates (layout 1) is not migrated: the new cnibpf
/// adds nothing to it, but DEL removes its pods one by one while the others keep working, and
/// the last DEL leaves the node to the new layout.
pub fn nftables_table_of_an_older_layout_drains(installed: &Installed, old: &Path, new: &Path) {
    installed.put(old);
    let keys = json!({ "backend": "nftables", "ipMasq": true, "filter": [
        { "index": 1, "direction": "ingress", "proto": "tcp", "dport": 81, "target": "DROP" },
    ]});
    let sim = SimHost::new("upn", keys);
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let c2 = sim.container("c2", port_mappings(&[(8081, 80, "tcp")]));
    let _servers = [&c1, &c2].map(|container| {
        TcpServer::start(
            &container.netns,
            container.socket(80),
            &container.attachment.container_id,
        )
    });
    let ruleset = sim.nft_ruleset();
    assert!(
        ruleset.contains("table inet cnibpf {") && !ruleset.contains("cnibpf layout"),
        "the older cnibpf made an uncommented table:\n{ruleset}"
    );

    installed.put(new);
    let refused = sim
        .add_container("c3", port_mappings(&[(8082, 80, "tcp")]))
        .expect_err("ADD into a table of another layout is refused");
    assert_eq!(refused.0.error_code(), Some(106), "{refused}");
    let message = refused.0.error_msg();
    assert!(message.contains("DEL and GC remove"), "{message}");
    assert!(
        !message.contains("delete every"),
        "no advice to delete state: {message}"
    );
    sim.del(&c1)
        .unwrap_or_else(|error| panic!("DEL in a table of an older layout: {error}"));
    let ruleset = sim.nft_ruleset();
    assert!(
        !ruleset.contains(&c1.attachment.container_id),
        "c1 left nothing behind:\n{ruleset}"
    );
    assert!(
        tcp_request(&sim.outside, sim.uplink_target(8080)).is_err(),
        "c1's hostPort went with it"
    );
    assert_eq!(
        tcp_request(&sim.outside, sim.uplink_target(8081)).as_deref(),
        Ok(c2.attachment.container_id.as_str()),
        "c2 is served on"
    );
    sim.del(&c2)
        .unwrap_or_else(|error| panic!("DEL of the last pod of an older table: {error}"));
    assert!(sim.holds_no_state(), "the last DEL removed the older table");
    let c4 = sim.container("c4", port_mappings(&[(8080, 80, "tcp")]));
    assert!(
        sim.nft_ruleset().contains(LAYOUT_4_MARKER),
        "a table of the new layout"
    );
    let _c4_server = TcpServer::start(&c4.netns, c4.socket(80), "c4");
    assert_eq!(
        tcp_request(&sim.outside, sim.uplink_target(8080)).as_deref(),
        Ok("c4")
    );
}

/// A table of nftables layout 3 (the window's) is migrated by the new cnibpf's first ADD,
/// with the pod's traffic flowing: its records read into the state file, the table replaced by one made from
/// them in one transaction; connections and datagram flows keep their translation, the filter
/// and its counters stay, hairpin traffic to the older pod's hostPort is masqueraded by what
/// the migration built from its record.
pub fn nftables_table_of_the_previous_layout_migrates(
    installed: &Installed,
    old: &Path,
    new: &Path,
) {
    installed.put(old);
    let sim = SimHost::new("upm", pod_keys("nftables"));
    let pod = LivePod::start(&sim);
    let ruleset = sim.nft_ruleset();
    assert!(
        ruleset.contains("comment \"cnibpf layout 3\"") && ruleset.contains("chain a_"),
        "the older cnibpf made a table of layout 3:\n{ruleset}"
    );
    let hits = inspected_rule_packets(&sim, &pod.container);
    assert!(hits > 0, "the DROP rule counted its drops");

    installed.put(new);
    let c2 = sim.container("c2", port_mappings(&[(8090, 80, "tcp")]));
    let ruleset = sim.nft_ruleset();
    assert!(
        ruleset.contains(LAYOUT_4_MARKER) && !ruleset.contains("chain a_"),
        "migrated:\n{ruleset}"
    );
    assert_eq!(
        inspected_rule_packets(&sim, &pod.container),
        hits,
        "the counters were kept"
    );
    pod.assert_translations(&sim, "after the nftables migration");
    assert!(
        inspected_rule_packets(&sim, &pod.container) > hits,
        "the filter counts on"
    );
    sim.check(&pod.container)
        .unwrap_or_else(|error| panic!("CHECK of the older ADD's pod: {error}"));
    let mut hairpin = Conversation::open(&c2.netns, sim.uplink_target(8080))
        .unwrap_or_else(|error| panic!("hairpin connect to the older pod's hostPort: {error}"));
    hairpin
        .exchange(b"hairpin", WAIT)
        .unwrap_or_else(|error| panic!("hairpin exchange with the older pod: {error}"));
    let _c2_server = TcpServer::start(&c2.netns, c2.socket(80), "c2");
    assert_eq!(
        tcp_request(&sim.outside, sim.uplink_target(8090)).as_deref(),
        Ok("c2")
    );
    let c1 = pod.assert_carried_on("across the nftables migration");
    for container in [&c1, &c2] {
        sim.del(container)
            .unwrap_or_else(|error| panic!("DEL after the nftables migration: {error}"));
    }
    assert!(sim.holds_no_state(), "the last DEL removed the table");
}

/// A process of the machine: its id, its parent's, its command line (arguments split).
#[derive(Debug)]
struct Process {
    pid: u32,
    parent: u32,
    arguments: Vec<String>,
}

/// The processes descended from `ancestor` (children, theirs, ...).
fn descendants_of(ancestor: u32) -> Vec<Process> {
    let mut all = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap_or_else(|error| panic!("list /proc: {error}")) {
        let Some(pid) = entry
            .ok()
            .and_then(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        else {
            continue;
        };
        // A process gone since the listing has neither file: it is no descendant.
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(parent) = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let arguments = cmdline
            .split(|byte| *byte == 0)
            .filter(|argument| !argument.is_empty())
            .map(|argument| String::from_utf8_lossy(argument).into_owned())
            .collect();
        all.push(Process {
            pid,
            parent,
            arguments,
        });
    }
    let mut lineage = vec![ancestor];
    let mut descendants = Vec::new();
    while let Some(parent) = lineage.pop() {
        for process in all.extract_if(.., |process| process.parent == parent) {
            lineage.push(process.pid);
            descendants.push(process);
        }
    }
    descendants
}

/// Waits for a process descended from `ancestor` whose command line `matches`, and for `ready`
/// of it. (Whatever strace puts between itself and the command it runs, the process looked
/// for is found.)
fn await_descendant(
    ancestor: u32,
    what: &str,
    matches: impl Fn(&[String]) -> bool,
    ready: impl Fn(u32) -> bool,
) -> Process {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while std::time::Instant::now() < deadline {
        if let Some(process) = descendants_of(ancestor)
            .into_iter()
            .find(|process| matches(&process.arguments) && ready(process.pid))
        {
            return process;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    panic!(
        "no {what} under process {ancestor} within 20 s; its descendants: {:?}",
        descendants_of(ancestor)
    )
}

/// The system call process `pid` is in, by number (`/proc/<pid>/syscall`).
fn in_system_call(pid: u32) -> Option<i64> {
    std::fs::read_to_string(format!("/proc/{pid}/syscall"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `sendmsg(2)` on x86_64 and aarch64.
const SENDMSG: i64 = if cfg!(target_arch = "aarch64") {
    211
} else {
    46
};

/// A migration killed after it handed its transaction (the layout-3 table replaced by one made
/// from the records it wrote) to `nft`, which outlives it and commits only after the next run
/// looked at the table: that run finds the table of the old layout first and a migrated one
/// when it reads it. It keeps every record (before, it read none from the migrated table,
/// and made the node's table and records empty); the pod is served and CHECKs.
pub fn a_migrations_transaction_landing_after_its_run_was_killed_loses_no_record(
    installed: &Installed,
    old: &Path,
    new: &Path,
) {
    installed.put(old);
    let sim = SimHost::new("upl", pod_keys("nftables"));
    let pod = LivePod::start(&sim);
    let pin_path = sim.pin_path.display().to_string();
    let migration = |strace: &[&str]| {
        let mut process = Command::new("strace");
        process
            .args(["-f", "-qq", "-o", "/dev/null"])
            .args(strace)
            .arg("--")
            .arg(new)
            .args(["gc", "--stale", "--pin-path", &pin_path]);
        chain::enter_netns_on_exec(&mut process, &sim.host.path());
        process
            .spawn()
            .unwrap_or_else(|error| panic!("spawn strace: {error}"))
    };
    // The first run's transaction waits three seconds in nft's sendmsg; the run is killed
    // there. Seconds, not one: on a loaded machine this test has been scheduled late enough
    // to find the transaction landed before it looked.
    let mut first = migration(&[
        "-e",
        "trace=sendmsg",
        "-e",
        "inject=sendmsg:delay_enter=3000000",
    ]);
    let nft = await_descendant(
        first.id(),
        "nft transaction",
        |arguments| {
            arguments
                .iter()
                .map(String::as_str)
                .eq(["nft", "-j", "-f", "-"])
        },
        |nft| in_system_call(nft) == Some(SENDMSG),
    );
    // The run that started the transaction.
    let run = nft.parent;
    // SAFETY: a plain kill(2) of a process this test started (traced by strace).
    let killed = unsafe { libc::kill(i32::try_from(run).expect("a pid"), libc::SIGKILL) };
    assert_eq!(killed, 0, "kill the first migration");
    assert!(
        !sim.nft_ruleset().contains(LAYOUT_4_MARKER),
        "the first run's transaction has not landed yet"
    );
    // The next run looks at the table at once, and reads it after five seconds (its first
    // process start, `nft list`, waits): the first run's transaction lands in between.
    let mut next = migration(&[
        "-e",
        "trace=clone,clone3,vfork",
        "-e",
        "inject=clone,clone3,vfork:delay_enter=5000000",
    ]);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !sim.nft_ruleset().contains(LAYOUT_4_MARKER),
        "the next run saw the table of the old layout"
    );
    let status = next.wait().unwrap_or_else(|error| panic!("wait: {error}"));
    assert!(status.success(), "the next run completed: {status}");
    first.wait().unwrap_or_else(|error| panic!("wait: {error}"));
    let ruleset = sim.nft_ruleset();
    assert!(ruleset.contains(LAYOUT_4_MARKER), "migrated:\n{ruleset}");
    assert!(
        ruleset.contains(&pod.container.attachment.container_id),
        "the pod's elements are in the migrated table:\n{ruleset}"
    );
    installed.put(new);
    sim.check(&pod.container)
        .unwrap_or_else(|error| panic!("CHECK after the late transaction: {error}"));
    pod.assert_translations(&sim, "after the late transaction");
}
