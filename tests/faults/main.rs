//! Faults injected into every verb of the real binary, as a busy node produces them (see
//! `cnibpf_tests::faults`): the N-th `bpf()`, `socket()`, netlink send or receive, `openat()`
//! or `write()` failing with EINTR, ENOMEM, ENOBUFS, EPERM or EAGAIN, and file-descriptor
//! limits. Whatever fails, a verb answers with success or one CNI error, never reclaims,
//! releases or changes a live attachment, and leaves nothing that a DEL without the fault does
//! not remove; after the faults every live attachment passes CHECK and carries traffic.
//!
//! `./dev test` runs a sample of N per system call; `CNIBPF_FAULTS=all` runs every N (see the
//! summary each test prints with `--nocapture`).

use std::{collections::BTreeMap, path::Path};

use cnibpf_tests::{
    Container, PluginOutput, SimHost,
    faults::{CallCounter, Counts, Fault, assert_admin_answer, assert_cni_answer, plan, wrapped},
    for_both_backends,
    topology::{
        Backend, Family, HOST_UPLINK_ADDR, OUTSIDE_ADDR, cnibpf_binary, nftables_state_file,
        port_mappings,
    },
    traffic::{TcpServer, tcp_request},
};
use serde_json::{Value, json};

mod install;

/// Values of N per system call in the sample `./dev test` runs.
const SAMPLE: u32 = 4;

fn keys() -> Value {
    json!({ "ipMasq": true, "filter": [
        { "index": 1, "direction": "ingress", "proto": "tcp", "dport": 81, "target": "DROP" },
    ]})
}

/// How many faulted runs of each verb there were, and how many of them failed (cleanly).
#[derive(Default)]
struct Tally {
    verbs: BTreeMap<&'static str, (usize, usize)>,
}

impl Tally {
    fn count(&mut self, verb: &'static str, succeeded: bool) {
        let (runs, failed) = self.verbs.entry(verb).or_default();
        *runs += 1;
        *failed += usize::from(!succeeded);
    }

    fn print(&self, what: &str) {
        let parts: Vec<String> = self
            .verbs
            .iter()
            .map(|(verb, (runs, failed))| format!("{verb} {runs} runs ({failed} failed)"))
            .collect();
        eprintln!("faults, {what}: {}", parts.join(", "));
    }
}

/// Attachments that must live through every fault: their state as `inspect` shows it
/// (counters aside) and their hostPorts answering.
struct Live<'a> {
    sim: &'a SimHost,
    containers: Vec<Container>,
    /// hostPort of each container, in order.
    ports: Vec<u16>,
    _servers: Vec<TcpServer>,
    outside: TcpServer,
    state: Value,
}

impl<'a> Live<'a> {
    fn start(sim: &'a SimHost) -> Self {
        let ports = vec![8080, 8081];
        let containers: Vec<Container> = ports
            .iter()
            .enumerate()
            .map(|(index, port)| {
                sim.container(&format!("l{index}"), port_mappings(&[(*port, 80, "tcp")]))
            })
            .collect();
        let servers = containers
            .iter()
            .map(|container| {
                TcpServer::start(
                    &container.netns,
                    container.socket(80),
                    &container.attachment.container_id,
                )
            })
            .collect();
        let outside = TcpServer::start(
            &sim.outside,
            std::net::SocketAddr::new(OUTSIDE_ADDR.into(), 7000),
            "outside",
        );
        let ids: Vec<&str> = containers
            .iter()
            .map(|container| container.attachment.container_id.as_str())
            .collect();
        let state = attachment_state(sim, &ids);
        assert_eq!(
            state.as_array().map(Vec::len),
            Some(containers.len()),
            "{state}"
        );
        let live = Self {
            sim,
            containers,
            ports,
            _servers: servers,
            outside,
            state,
        };
        live.assert_untouched("before any fault");
        live
    }

    fn ids(&self) -> Vec<&str> {
        self.containers
            .iter()
            .map(|container| container.attachment.container_id.as_str())
            .collect()
    }

    /// Nothing of the live attachments changed, and their hostPorts answer.
    fn assert_untouched(&self, context: &str) {
        let state = attachment_state(self.sim, &self.ids());
        let listed = |state: &Value| -> Vec<String> {
            state
                .as_array()
                .into_iter()
                .flatten()
                .map(|attachment| attachment["containerID"].to_string())
                .collect()
        };
        assert_eq!(
            listed(&state),
            listed(&self.state),
            "{context}: a live attachment was removed"
        );
        assert_eq!(
            state, self.state,
            "{context}: a live attachment was changed or removed"
        );
        for (container, port) in self.containers.iter().zip(&self.ports) {
            assert_eq!(
                tcp_request(&self.sim.outside, self.sim.uplink_target(*port)).as_deref(),
                Ok(container.attachment.container_id.as_str()),
                "{context}: hostPort {port} of a live attachment stopped answering"
            );
        }
    }

    /// After the faults: every live attachment passes CHECK, answers on its hostPort and is
    /// masqueraded on its way out.
    fn assert_well(&self, context: &str) {
        self.assert_untouched(context);
        for container in &self.containers {
            self.sim
                .check(container)
                .unwrap_or_else(|error| panic!("{context}: CHECK of a live attachment: {error}"));
        }
        let before = self.outside.peers().len();
        let target = std::net::SocketAddr::new(OUTSIDE_ADDR.into(), 7000);
        assert_eq!(
            tcp_request(&self.containers[0].netns, target).as_deref(),
            Ok("outside"),
            "{context}: a live attachment reaches outside"
        );
        let peers = self.outside.peers();
        assert_eq!(
            peers.get(before).map(std::net::SocketAddr::ip),
            Some(self.sim.uplink_target(0).ip()),
            "{context}: masqueraded to the uplink's address"
        );
    }
}

/// The state `inspect` shows of the attachments `ids`, counters and tracked flows aside.
fn attachment_state(sim: &SimHost, ids: &[&str]) -> Value {
    let mut attachments: Vec<Value> = sim.inspect()["attachments"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|attachment| {
            attachment["containerID"]
                .as_str()
                .is_some_and(|id| ids.contains(&id))
        })
        .cloned()
        .map(without_counters)
        .collect();
    attachments.sort_by_key(|attachment| attachment["containerID"].to_string());
    Value::Array(attachments)
}

fn without_counters(value: Value) -> Value {
    const COUNTERS: [&str; 6] = [
        "flows",
        "packets",
        "bytes",
        "defaultHits",
        "droppedPackets",
        "droppedBytes",
    ];
    match value {
        Value::Object(object) => Value::Object(
            object
                .into_iter()
                .filter(|(key, _)| !COUNTERS.contains(&key.as_str()))
                .map(|(key, value)| (key, without_counters(value)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.into_iter().map(without_counters).collect()),
        other => other,
    }
}

/// Nothing of the attachment of `container` (whose owner id is `owner`) is left: no record,
/// no map entry, nft rule or element naming it, no pinned link of its interface.
fn assert_gone(sim: &SimHost, container: &Container, owner: u64, context: &str) {
    let id = &container.attachment.container_id;
    let held = sim.ebpf_maps_holding(owner);
    assert!(held.is_empty(), "{context}: maps still hold {id}: {held:?}");
    let owner = format!("{owner:016x}");
    let inspect = sim.inspect();
    assert!(
        !inspect.to_string().contains(id.as_str()),
        "{context}: {id} is still recorded: {inspect}"
    );
    let ruleset = sim.nft_ruleset();
    assert!(
        !ruleset.contains(id.as_str()) && !ruleset.contains(&owner),
        "{context}: the nftables table still holds {id}:\n{ruleset}"
    );
    let links = sim.pin_path.join("links");
    let pinned: Vec<String> = std::fs::read_dir(&links)
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name.contains(&owner))
        .collect();
    assert!(
        pinned.is_empty(),
        "{context}: links of {id} are still pinned: {pinned:?}"
    );
}

fn expect_ok(output: &PluginOutput, context: &str) {
    assert_eq!(output.exit_code, 0, "{context}: {output:?}");
}

/// The calls of the cnibpf runs `runs` makes.
fn counted(sim: &SimHost, runs: impl FnOnce()) -> Counts {
    let counter = CallCounter::new();
    sim.chain.set_cnibpf_prefix(Some(counter.prefix()));
    runs();
    sim.chain.set_cnibpf_prefix(None);
    counter.counts()
}

/// One plugin run of `run` with `fault` injected.
fn faulted(sim: &SimHost, fault: &Fault, run: impl FnOnce() -> PluginOutput) -> PluginOutput {
    sim.chain.set_cnibpf_prefix(Some(fault.prefix()));
    let output = run();
    sim.chain.set_cnibpf_prefix(None);
    output
}

/// `cnibpf gc --stale` of the simulated host's instance, under `prefix`.
fn gc_stale(sim: &SimHost, prefix: Option<&[String]>) -> std::process::Output {
    let pin_path = sim.pin_path.display().to_string();
    sim.cnibpf_command_under(prefix, &["gc", "--stale", "--pin-path", &pin_path])
        .output()
        .expect("run cnibpf gc")
}

fn attached(sim: &SimHost, id: &str) -> bool {
    sim.inspect()["attachments"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|attachment| attachment["containerID"] == id)
}

/// ADD of a new attachment: success, or an error after which a DEL without the fault removes
/// everything it left.
fn faulted_add(sim: &SimHost, live: &Live<'_>, tally: &mut Tally) {
    // A wildcard hostPort and one of the uplink's address (counted in `port_claims`).
    let mut mappings = port_mappings(&[(9090, 80, "tcp")]);
    mappings["portMappings"]
        .as_array_mut()
        .expect("a list")
        .push(json!({
            "hostPort": 9095, "containerPort": 80, "protocol": "tcp",
            "hostIP": HOST_UPLINK_ADDR.to_string(),
        }));
    let claims_before = sim.port_claims();
    let new = sim.container("fa", mappings);
    let owner = sim.owner_of(&new);
    let run = |command| sim.chain.run_one(&new.attachment, "cnibpf", command);
    expect_ok(&run("DEL"), "clean DEL");
    let counts = counted(sim, || expect_ok(&run("ADD"), "clean ADD"));
    expect_ok(&run("DEL"), "clean DEL");
    for fault in plan(&counts, SAMPLE) {
        let context = format!("ADD with {fault}");
        let added = assert_cni_answer(&faulted(sim, &fault, || run("ADD")), &context);
        live.assert_untouched(&context);
        if added {
            expect_ok(&run("CHECK"), &format!("{context}: CHECK"));
        }
        expect_ok(&run("DEL"), &format!("{context}: DEL without the fault"));
        assert_gone(sim, &new, owner, &context);
        assert_eq!(
            sim.port_claims(),
            claims_before,
            "{context}: the count of address-specific hostPorts is as before"
        );
        tally.count("ADD", added);
    }
}

/// DEL of an attachment: success, or an error after which a DEL without the fault removes
/// everything.
fn faulted_del(sim: &SimHost, live: &Live<'_>, tally: &mut Tally) {
    let target = sim.container("fd", port_mappings(&[(9091, 80, "tcp")]));
    let owner = sim.owner_of(&target);
    let run = |command| sim.chain.run_one(&target.attachment, "cnibpf", command);
    let counts = counted(sim, || expect_ok(&run("DEL"), "clean DEL"));
    expect_ok(&run("ADD"), "clean ADD");
    for fault in plan(&counts, SAMPLE) {
        let context = format!("DEL with {fault}");
        let deleted = assert_cni_answer(&faulted(sim, &fault, || run("DEL")), &context);
        live.assert_untouched(&context);
        if !deleted {
            expect_ok(
                &run("DEL"),
                &format!("{context}: DEL retried without the fault"),
            );
        }
        assert_gone(sim, &target, owner, &context);
        expect_ok(&run("ADD"), &format!("{context}: ADD again"));
        tally.count("DEL", deleted);
    }
    expect_ok(&run("DEL"), "DEL");
}

/// CHECK of a live attachment: its answer, and nothing changed.
fn faulted_check(sim: &SimHost, live: &Live<'_>, tally: &mut Tally) {
    let target = &live.containers[0].attachment;
    let run = || sim.chain.run_one(target, "cnibpf", "CHECK");
    let counts = counted(sim, || expect_ok(&run(), "clean CHECK"));
    for fault in plan(&counts, SAMPLE) {
        let context = format!("CHECK with {fault}");
        let passed = assert_cni_answer(&faulted(sim, &fault, run), &context);
        live.assert_untouched(&context);
        tally.count("CHECK", passed);
    }
}

/// CNI GC with every live attachment listed but one: the live ones stay whatever fails; the
/// unlisted one goes once GC runs without the fault.
fn faulted_gc(sim: &SimHost, live: &Live<'_>, tally: &mut Tally) {
    let unlisted = sim.container("fg", port_mappings(&[(9092, 80, "tcp")]));
    let owner = sim.owner_of(&unlisted);
    let valid: Vec<(&str, &str)> = live.ids().into_iter().map(|id| (id, "eth0")).collect();
    let gc = || sim.chain.gc_one("cnibpf", &valid);
    let add = || sim.chain.run_one(&unlisted.attachment, "cnibpf", "ADD");
    let counts = counted(sim, || expect_ok(&gc(), "clean GC"));
    assert_gone(sim, &unlisted, owner, "clean GC");
    expect_ok(&add(), "ADD again");
    for fault in plan(&counts, SAMPLE) {
        let context = format!("GC with {fault}");
        let collected = assert_cni_answer(&faulted(sim, &fault, gc), &context);
        live.assert_untouched(&context);
        expect_ok(&gc(), &format!("{context}: GC without the fault"));
        assert_gone(sim, &unlisted, owner, &context);
        expect_ok(&add(), &format!("{context}: ADD again"));
        tally.count("GC", collected);
    }
    expect_ok(
        &sim.chain.run_one(&unlisted.attachment, "cnibpf", "DEL"),
        "DEL",
    );
}

/// `cnibpf gc --stale` with one vanished attachment: the live ones stay whatever fails; the
/// vanished one goes once it runs without the fault.
fn faulted_gc_stale(sim: &SimHost, live: &Live<'_>, tally: &mut Tally) {
    let vanished = |index: usize| {
        let container = sim.container(
            &format!("fs{index}"),
            port_mappings(&[(9300 + u16::try_from(index).expect("few"), 80, "tcp")]),
        );
        sim.vanish(&container);
        container
    };
    let first = vanished(0);
    let counter = CallCounter::new();
    let counted_run = gc_stale(sim, Some(&counter.prefix()));
    assert!(
        counted_run.status.success(),
        "clean gc --stale: {counted_run:?}"
    );
    let counts = counter.counts();
    assert!(!attached(sim, &first.attachment.container_id));
    for (index, fault) in plan(&counts, SAMPLE).into_iter().enumerate() {
        let context = format!("gc --stale with {fault}");
        let gone = vanished(index + 1);
        let output = gc_stale(sim, Some(&fault.prefix()));
        let reclaimed = assert_admin_answer(&output, "gc", &context);
        live.assert_untouched(&context);
        let again = gc_stale(sim, None);
        assert!(
            again.status.success(),
            "{context}: gc --stale without the fault: {again:?}"
        );
        assert!(
            !attached(sim, &gone.attachment.container_id),
            "{context}: the vanished attachment is reclaimed without the fault"
        );
        tally.count("gc --stale", reclaimed);
    }
}

/// ADD of a hostPort a vanished attachment holds: the reclaim inside it never takes a live
/// attachment's, and a failed ADD leaves nothing a DEL does not remove.
fn faulted_reclaim(sim: &SimHost, live: &Live<'_>, tally: &mut Tally) {
    let new = sim.container("fr", port_mappings(&[(7070, 80, "tcp")]));
    let owner = sim.owner_of(&new);
    let run = |command| sim.chain.run_one(&new.attachment, "cnibpf", command);
    expect_ok(&run("DEL"), "clean DEL");
    let holder = |index: usize| {
        let container = sim.container(&format!("fh{index}"), port_mappings(&[(7070, 80, "tcp")]));
        sim.vanish(&container);
        container
    };
    let first = holder(0);
    let counts = counted(sim, || {
        expect_ok(&run("ADD"), "clean ADD over a vanished holder")
    });
    assert!(!attached(sim, &first.attachment.container_id), "reclaimed");
    expect_ok(&run("DEL"), "clean DEL");
    for (index, fault) in plan(&counts, SAMPLE).into_iter().enumerate() {
        let context = format!("ADD reclaiming a vanished holder with {fault}");
        let stale = holder(index + 1);
        let added = assert_cni_answer(&faulted(sim, &fault, || run("ADD")), &context);
        live.assert_untouched(&context);
        if added {
            assert!(
                !attached(sim, &stale.attachment.container_id),
                "{context}: the ADD succeeded, so it reclaimed the holder"
            );
        }
        expect_ok(&run("DEL"), &format!("{context}: DEL without the fault"));
        assert_gone(sim, &new, owner, &context);
        assert!(
            gc_stale(sim, None).status.success(),
            "{context}: gc --stale"
        );
        tally.count("ADD reclaiming", added);
    }
}

/// Live pods, then `cnibpf gc --stale` with every file-descriptor limit from 3 to 64: every
/// pod is still served and listed.
fn gc_stale_under_fd_limits(sim: &SimHost, live: &Live<'_>, tally: &mut Tally) {
    for limit in 3..=64 {
        let fault = Fault::FdLimit(limit);
        let context = format!("gc --stale with {fault}");
        let output = gc_stale(sim, Some(&fault.prefix()));
        let succeeded = assert_admin_answer(&output, "gc", &context);
        live.assert_untouched(&context);
        tally.count("gc --stale (fd limit)", succeeded);
    }
}

fn faults_in_every_verb(backend: Backend) {
    let sim = SimHost::on(backend, "ft", keys());
    let live = Live::start(&sim);
    let mut tally = Tally::default();
    faulted_add(&sim, &live, &mut tally);
    faulted_del(&sim, &live, &mut tally);
    faulted_check(&sim, &live, &mut tally);
    faulted_gc(&sim, &live, &mut tally);
    faulted_gc_stale(&sim, &live, &mut tally);
    faulted_reclaim(&sim, &live, &mut tally);
    gc_stale_under_fd_limits(&sim, &live, &mut tally);
    live.assert_well("after every fault");
    tally.print(backend.name());
}

for_both_backends!(faults_in_every_verb);

/// The temporary files of the nftables backend's state file in the instance's directory.
fn state_temporaries(sim: &SimHost) -> Vec<String> {
    let state_file = nftables_state_file(&sim.pin_path);
    let name = state_file
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default();
    let directory = state_file.parent().expect("in a directory");
    std::fs::read_dir(directory)
        .unwrap_or_else(|error| panic!("list {}: {error}", directory.display()))
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|file| file.starts_with(&format!(".{name}.")) && file.ends_with(".tmp"))
        .collect()
}

/// An ADD killed (a runtime's timeout) after it wrote the state file's temporary and before
/// it renamed it over the file: the next call reaps it, the attachment before it keeps
/// working, and the last DEL leaves none.
#[test]
fn a_state_write_killed_midway_leaves_nothing_behind() {
    let sim = SimHost::on(Backend::Nftables, "kill", keys());
    let kept = sim.container("kept", port_mappings(&[(8080, 80, "tcp")]));
    // The state file's rename is the ADD's only one (the temporary is there: the asserts).
    for round in 0..2 {
        sim.chain.set_cnibpf_prefix(Some(
            [
                "strace",
                "-f",
                "-qq",
                "-o",
                "/dev/null",
                "-e",
                "inject=rename:signal=KILL",
                "--",
            ]
            .map(str::to_owned)
            .to_vec(),
        ));
        let killed = sim.add_container(&format!("k{round}"), port_mappings(&[(8090, 80, "tcp")]));
        sim.chain.set_cnibpf_prefix(None);
        assert!(killed.is_err(), "the ADD was killed: {killed:?}");
        assert_eq!(
            state_temporaries(&sim).len(),
            1,
            "round {round}: the killed writer's temporary is there, the one before it reaped"
        );
    }
    sim.check(&kept)
        .unwrap_or_else(|error| panic!("CHECK of the pod before the kills: {error}"));
    let _server = TcpServer::start(&kept.netns, Family::V4.any(80), "kept");
    assert_eq!(
        tcp_request(&sim.outside, sim.uplink(Family::V4, 8080)).as_deref(),
        Ok("kept"),
        "the pod before the kills is served"
    );
    sim.del(&kept)
        .unwrap_or_else(|error| panic!("DEL of the last pod: {error}"));
    assert!(
        state_temporaries(&sim).is_empty(),
        "the DEL reaped the temporary"
    );
}
