//! Live upgrade across datapath layouts, with a real older cnibpf: commit 5da8470 (eBPF layout
//! 6, container interfaces hooked by cls_bpf filters; nftables table layout 1), commit
//! 8a7f4ca (nftables layout 2) and every later release `releases.toml` lists, built from this
//! repository's history. A node upgrades while its pods run, and its connections,
//! translations, filters, source checks and counters live on; DEL works across layouts in both
//! directions; a migration killed at any point is completed by the next run.
//!
//! Two tests, each run in phases, one after the other: the supported window (the last
//! releases, `./dev test`) and the releases before it (CI's upgrade layer). The simulated
//! hosts run the cnibpf binary installed at one path, replaced in place as an upgrade
//! replaces it.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::{Mutex, MutexGuard},
    time::Duration,
};

use cnibpf_common::{
    datapath::{LayoutInfo, layout::MAGIC},
    sources::SourceSet,
};
use cnibpf_tests::{
    Container, SimHost, chain, faults, history,
    live::{LivePod, pod_keys},
    topology::{Backend, cnibpf_binary, nftables_state_file, port_mappings},
    traffic::{TcpServer, tcp_request},
};

mod flows;
mod nftables;

/// The last commit of layout 6.
const LAYOUT_6: &str = "5da8470";
/// The last commit of nftables layout 2.
const NFTABLES_LAYOUT_2: &str = "8a7f4ca";
const WAIT: Duration = Duration::from_secs(3);

/// The plugin binary the simulated hosts run, replaced in place as an upgrade replaces it.
struct Installed {
    path: PathBuf,
}

impl Installed {
    fn at(path: PathBuf, binary: &Path) -> Self {
        let directory = path.parent().expect("a file path");
        std::fs::create_dir_all(directory)
            .unwrap_or_else(|error| panic!("create {}: {error}", directory.display()));
        let installed = Self { path };
        installed.put(binary);
        installed
    }

    /// Replaces the installed binary with `binary` (renamed over it: a running one keeps its
    /// file).
    fn put(&self, binary: &Path) {
        let staged = self.path.with_extension("new");
        std::fs::copy(binary, &staged).unwrap_or_else(|error| {
            panic!("copy {} to {}: {error}", binary.display(), staged.display())
        });
        std::fs::rename(&staged, &self.path)
            .unwrap_or_else(|error| panic!("install {}: {error}", self.path.display()));
    }
}

/// Programs on the container's host interface: tcx links only, no cls_bpf filter left.
fn assert_hooked_by_tcx(sim: &SimHost, container: &Container) {
    let interface = sim.host_interface(container);
    assert_eq!(
        sim.tcx_programs(&interface),
        ["from_container", "to_container"],
        "{interface}"
    );
    for hook in ["ingress", "egress"] {
        let filters = sim
            .host
            .exec(&["tc", "filter", "show", "dev", &interface, hook]);
        assert!(filters.trim().is_empty(), "{interface} {hook}: {filters}");
    }
}

/// Where a migration keeps the old maps until it is done.
const ASIDE: [&str; 3] = ["layout-6-maps", "layout-8-maps", "layout-9-maps"];

/// Whether a migration left old maps aside.
fn half_migrated(sim: &SimHost) -> bool {
    ASIDE.iter().any(|aside| sim.pin_path.join(aside).exists())
}

fn assert_migrated(sim: &SimHost) {
    assert_eq!(
        sim.layout_version(),
        cnibpf_common::datapath::layout::VERSION
    );
    assert!(!half_migrated(sim), "the old pins are gone");
}

fn layout_bytes(version: u32) -> Vec<u8> {
    let info = LayoutInfo {
        magic: MAGIC,
        version,
        _pad: 0,
        object_id: 0,
    };
    [
        info.magic.to_ne_bytes().as_slice(),
        &info.version.to_ne_bytes(),
        &info._pad.to_ne_bytes(),
        &info.object_id.to_ne_bytes(),
    ]
    .concat()
}

fn endpoint_links(sim: &SimHost) -> usize {
    std::fs::read_dir(sim.pin_path.join("links"))
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|entry| entry.file_name().to_string_lossy().starts_with("endpoint-"))
                .count()
        })
        .unwrap_or(0)
}

/// The new cnibpf's next ADD migrates the state with the pod's traffic flowing; the old
/// pod passes CHECK and DEL of the new one; then a downgrade: ADD refused, DEL still works,
/// and the last DEL leaves the node to the older build.
fn upgrade_then_downgrade(installed: &Installed, old: &Path, new: &Path) {
    installed.put(old);
    let sim = SimHost::new("upg", pod_keys("ebpf"));
    let pod = LivePod::start(&sim);
    assert_eq!(sim.layout_version(), 6, "the older cnibpf made layout 6");
    let hits = sim.filter_rule_packets(0);
    assert!(hits > 0, "the DROP rule counted its drops");
    let flows = flows::masqueraded(&sim);

    installed.put(new);
    let c2 = sim.container("c2", port_mappings(&[(8090, 80, "tcp")]));
    assert_migrated(&sim);
    assert_hooked_by_tcx(&sim, &pod.container);
    assert_hooked_by_tcx(&sim, &c2);
    assert_eq!(sim.filter_rule_packets(0), hits, "the counters were kept");
    let flows_after = flows::masqueraded(&sim);
    assert_eq!(
        flows_after, flows,
        "the masqueraded flows were kept as they were"
    );
    pod.assert_translations(&sim, "after the upgrade");
    assert!(sim.filter_rule_packets(0) > hits, "the filter counts on");
    sim.check(&pod.container)
        .unwrap_or_else(|error| panic!("CHECK of the older ADD's pod: {error}"));
    let _c2_server = TcpServer::start(&c2.netns, c2.socket(80), "c2");
    assert_eq!(
        tcp_request(&sim.outside, sim.uplink_target(8090)).as_deref(),
        Ok("c2")
    );
    let c1 = pod.assert_carried_on("across the upgrade");

    // A downgrade: this build meets the layout of a newer one.
    sim.write_layout(&layout_bytes(cnibpf_common::datapath::layout::VERSION + 1));
    let refused = sim
        .add_container("c3", port_mappings(&[]))
        .expect_err("ADD into a newer layout is refused");
    assert_eq!(refused.0.error_code(), Some(106), "{refused}");
    let message = refused.0.error_msg();
    assert!(
        message.contains("newer") && message.contains("DEL"),
        "{message}"
    );
    assert!(
        !message.contains("delete every"),
        "no advice to delete state: {message}"
    );
    assert_eq!(endpoint_links(&sim), 4);
    sim.del(&c1)
        .unwrap_or_else(|error| panic!("DEL across a downgrade: {error}"));
    assert_eq!(endpoint_links(&sim), 2, "c1's hooks went with its DEL");
    assert_eq!(
        tcp_request(&sim.outside, sim.uplink_target(8090)).as_deref(),
        Ok("c2")
    );
    sim.del(&c2)
        .unwrap_or_else(|error| panic!("DEL of the last pod across a downgrade: {error}"));
    assert!(
        !sim.pin_path.exists(),
        "the last DEL removed the newer state"
    );
    let c4 = sim.container("c4", port_mappings(&[(8090, 80, "tcp")]));
    assert_migrated(&sim);
    let _c4_server = TcpServer::start(&c4.netns, c4.socket(80), "c4");
    assert_eq!(
        tcp_request(&sim.outside, sim.uplink_target(8090)).as_deref(),
        Ok("c4")
    );
}

/// Whether a migration of `backend`'s state was left half done, and whether it is complete.
fn migration_state(sim: &SimHost, backend: Backend) -> (bool, bool) {
    match backend {
        Backend::Ebpf => (
            half_migrated(sim),
            sim.layout_version() == cnibpf_common::datapath::layout::VERSION,
        ),
        Backend::Nftables => {
            let migrated = sim.nft_ruleset().contains(nftables::LAYOUT_4_MARKER);
            let recorded = nftables_state_file(&sim.pin_path).exists();
            (recorded && !migrated, migrated)
        }
    }
}

/// The migration, run by `cnibpf gc --stale` (what a DaemonSet runs), killed with SIGKILL
/// at ever later points until a run completes; the pod's traffic flows all along.
fn killed_migrations_converge(installed: &Installed, old: &Path, new: &Path, backend: Backend) {
    installed.put(old);
    let sim = SimHost::new(
        &format!("upk{}", &backend.name()[..1]),
        pod_keys(backend.name()),
    );
    let pod = LivePod::start(&sim);
    let pin_path = sim.pin_path.display().to_string();
    faults::killed_until_complete(
        &format!("{backend:?} migration"),
        || {
            let mut process = Command::new(new);
            process.args(["gc", "--stale", "--pin-path", &pin_path]);
            chain::enter_netns_on_exec(&mut process, &sim.host.path());
            process
        },
        || migration_state(&sim, backend).0,
    );
    assert_eq!(migration_state(&sim, backend), (false, true), "migrated");
    if backend == Backend::Ebpf {
        assert_migrated(&sim);
        assert_hooked_by_tcx(&sim, &pod.container);
    }
    pod.assert_translations(&sim, "after the killed migrations");
    installed.put(new);
    sim.check(&pod.container)
        .unwrap_or_else(|error| panic!("CHECK after the killed migrations: {error}"));
    pod.assert_carried_on("across the killed migrations");
}

/// The migration, run by `cnibpf gc --stale`, with a fault injected (see `faults`) at a sample
/// of the calls it makes (every call with `CNIBPF_FAULTS=all`), each time from a fresh state
/// of the older cnibpf: the faulted run answers with success or one error, the next run
/// without the fault completes the migration, and the older cnibpf's pod passes CHECK and
/// answers on its hostPort.
fn faulted_migrations_converge(installed: &Installed, old: &Path, new: &Path, backend: Backend) {
    let sim = SimHost::new(
        &format!("upf{}", &backend.name()[..1]),
        pod_keys(backend.name()),
    );
    let pin_path = sim.pin_path.display().to_string();
    let gc_stale = |prefix: Option<&[String]>| {
        let mut process = match prefix {
            Some(prefix) => faults::wrapped(prefix, new),
            None => Command::new(new),
        };
        process.args(["gc", "--stale", "--pin-path", &pin_path]);
        chain::enter_netns_on_exec(&mut process, &sim.host.path());
        process.output().expect("run cnibpf gc")
    };
    // A pod of the older cnibpf, and the node's state with it; then the migration's run.
    let migrate = |index: usize, prefix: Option<&[String]>| {
        installed.put(old);
        let pod = sim.container(&format!("m{index}"), port_mappings(&[(8080, 80, "tcp")]));
        let server = TcpServer::start(&pod.netns, pod.socket(80), "old pod");
        assert_eq!(
            migration_state(&sim, backend),
            (false, false),
            "a fresh old state"
        );
        (pod, server, gc_stale(prefix))
    };
    let converged = |pod: &Container, context: &str| {
        let again = gc_stale(None);
        assert!(
            again.status.success(),
            "{context}: the run after it: {again:?}"
        );
        assert_eq!(
            migration_state(&sim, backend),
            (false, true),
            "{context}: migrated"
        );
        installed.put(new);
        sim.check(pod)
            .unwrap_or_else(|error| panic!("{context}: CHECK of the old pod: {error}"));
        assert_eq!(
            tcp_request(&sim.outside, sim.uplink_target(8080)).as_deref(),
            Ok("old pod"),
            "{context}: the old pod's hostPort"
        );
        sim.del(pod)
            .unwrap_or_else(|error| panic!("{context}: DEL of the old pod: {error}"));
        assert!(
            sim.holds_no_state(),
            "{context}: the last DEL leaves nothing"
        );
    };
    let counter = faults::CallCounter::new();
    let (pod, _server, output) = migrate(0, Some(&counter.prefix()));
    assert!(output.status.success(), "the counted migration: {output:?}");
    converged(&pod, "the counted migration");
    let plan = faults::plan(&counter.counts(), 3);
    let mut failed = 0;
    for (index, fault) in plan.iter().enumerate() {
        let context = format!("{backend:?} migration with {fault}");
        let (pod, _server, output) = migrate(index + 1, Some(&fault.prefix()));
        failed += usize::from(!faults::assert_admin_answer(&output, "gc", &context));
        converged(&pod, &context);
    }
    eprintln!(
        "{backend:?}: {} faulted migrations ({failed} failed), each completed by the next run",
        plan.len()
    );
}

/// The packets rule 1 of `container`'s filter counted, as inspect shows them.
fn inspected_rule_packets(sim: &SimHost, container: &Container) -> u64 {
    let inspect = sim.inspect();
    inspect["attachments"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|attachment| attachment["containerID"] == container.attachment.container_id)
        .and_then(|attachment| {
            attachment["filter"]["rules"]
                .as_array()?
                .iter()
                .find(|rule| rule["index"] == 1)?["packets"]
                .as_u64()
        })
        .unwrap_or_else(|| panic!("no counter of rule 1 in {inspect:#}"))
}

/// Whether the release's own state checks the pod's source addresses (source checks came
/// within layout 7).
fn checks_sources(sim: &SimHost, backend: Backend) -> bool {
    match backend {
        Backend::Ebpf => {
            sim.pin_path.join("sources").exists()
                && sim
                    .pinned_hash_map::<u32, SourceSet>("sources")
                    .iter()
                    .next()
                    .is_some()
        }
        Backend::Nftables => sim.nft_ruleset().contains("chain s_"),
    }
}

/// A rollback to a release of an older layout after this build migrated the node: the release
/// refuses ADD into the newer layout, the pods carry on, their DELs work, and the last one
/// leaves nothing of the newer state, so that the release starts afresh at its own layout.
fn a_rollback_over_a_newer_layout_still_dels(installed: &Installed, older: &Path, new: &Path) {
    installed.put(older);
    let sim = SimHost::new("rbk", pod_keys("ebpf"));
    let pod = LivePod::start(&sim);
    installed.put(new);
    let c2 = sim.container("c2", port_mappings(&[(8090, 80, "tcp")]));
    assert_migrated(&sim);
    installed.put(older);
    let refused = sim
        .add_container("c3", port_mappings(&[]))
        .expect_err("the older release refuses ADD into this build's layout");
    assert_eq!(refused.0.error_code(), Some(106), "{refused}");
    let _c2_server = TcpServer::start(&c2.netns, c2.socket(80), "c2");
    let c1 = pod.assert_carried_on("after the rollback");
    sim.del(&c1)
        .unwrap_or_else(|error| panic!("the older release's DEL of c1: {error}"));
    assert_eq!(
        tcp_request(&sim.outside, sim.uplink_target(8090)).as_deref(),
        Ok("c2"),
        "c2 is served on after c1's DEL"
    );
    sim.del(&c2)
        .unwrap_or_else(|error| panic!("the older release's DEL of c2: {error}"));
    assert!(
        !sim.pin_path.exists(),
        "the last DEL removed the newer state"
    );
}

/// Every release `releases.toml` lists, oldest first.
fn releases() -> Vec<history::Release> {
    let releases = history::releases();
    let first = releases.first().map(|release| release.commit.as_str());
    assert!(
        first == Some(LAYOUT_6),
        "releases.toml starts with {LAYOUT_6}, not {first:?}"
    );
    releases
}

/// A release replaced by this build on a node with a live pod, on each backend: the pod's
/// connections, flows and translations carry on, a new pod starts and is reached through its
/// hostPort, CHECK passes on the old pod, and both pods' DELs leave nothing.
fn a_release_upgrades_live(installed: &Installed, release: &str, new: &Path) {
    let old = history::cnibpf_of(release);
    for backend in [Backend::Ebpf, Backend::Nftables] {
        let case = format!("{release} on {}", backend.name());
        eprintln!("upgrading {case} live");
        installed.put(&old);
        let sim = SimHost::on(backend, "rel", pod_keys(backend.name()));
        let pod = LivePod::start(&sim);
        let hits = inspected_rule_packets(&sim, &pod.container);
        assert!(hits > 0, "{case}: the DROP rule counted its drops");
        let flows = (backend == Backend::Ebpf).then(|| flows::masqueraded(&sim));
        let checked = checks_sources(&sim, backend);
        installed.put(new);
        let c2 = sim.container("c2", port_mappings(&[(8090, 80, "tcp")]));
        if backend == Backend::Ebpf {
            assert_migrated(&sim);
        }
        assert_eq!(
            inspected_rule_packets(&sim, &pod.container),
            hits,
            "{case}: the filter's counters were kept"
        );
        assert_eq!(
            (backend == Backend::Ebpf).then(|| flows::masqueraded(&sim)),
            flows,
            "{case}: the masqueraded flows were kept as they were"
        );
        if checked {
            pod.assert_source_checked(&sim, &case);
        }
        pod.assert_translations(&sim, &format!("{case}: after the upgrade"));
        sim.check(&pod.container)
            .unwrap_or_else(|error| panic!("{case}: CHECK of the release's pod: {error}"));
        let _c2_server = TcpServer::start(&c2.netns, c2.socket(80), "c2");
        assert_eq!(
            tcp_request(&sim.outside, sim.uplink_target(8090)).as_deref(),
            Ok("c2"),
            "{case}"
        );
        let c1 = pod.assert_carried_on(&format!("{case}: across the upgrade"));
        for container in [&c1, &c2] {
            sim.del(container)
                .unwrap_or_else(|error| panic!("{case}: DEL: {error}"));
        }
        assert!(sim.holds_no_state(), "{case}: nothing left");
    }
}

/// One upgrade test at a time: each replaces the one installed binary the simulated hosts run.
static INSTALLED: Mutex<()> = Mutex::new(());

/// This build, and the installed binary (`first` in place) that `CNIBPF_BIN` names to the
/// simulated hosts; held alone until the guard drops.
fn installed_first(first: &Path) -> (MutexGuard<'static, ()>, Installed, PathBuf) {
    let serial = INSTALLED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let new = cnibpf_binary();
    let workspace_target = new
        .parent()
        .and_then(Path::parent)
        .expect("the binary lives in target/debug");
    let installed = Installed::at(workspace_target.join("upgrade/cnibpf"), first);
    // SAFETY: set under `INSTALLED`, to the same path by every test of this binary, before
    // the test starts a thread of its own.
    unsafe { std::env::set_var("CNIBPF_BIN", &installed.path) };
    (serial, installed, new)
}

/// The nftables layout this build writes, as `cnibpf --version` names it.
fn nftables_layout_of(binary: &Path) -> String {
    let output = Command::new(binary)
        .arg("--version")
        .output()
        .unwrap_or_else(|error| panic!("run {} --version: {error}", binary.display()));
    let version = String::from_utf8_lossy(&output.stdout);
    version
        .split_once("nftables ")
        .and_then(|(_, rest)| rest.split_once(')'))
        .map(|(layout, _)| layout.to_owned())
        .unwrap_or_else(|| panic!("no nftables layout in {version:?}"))
}

/// The supported window (`history::SUPPORTED_RELEASES`, what `./dev test` upgrades from):
/// each release upgraded live on both backends, and the newest one's migrations, of each
/// backend whose layout this build changed, killed and faulted.
#[test]
fn the_supported_releases_upgrade_live() {
    let window = history::supported_releases();
    let newest = window.last().expect("releases.toml lists releases");
    let newest_binary = history::cnibpf_of(&newest.commit);
    let (_serial, installed, new) = installed_first(&newest_binary);
    for release in &window {
        a_release_upgrades_live(&installed, &release.commit, &new);
    }
    if newest.ebpf_layout < cnibpf_common::datapath::layout::VERSION {
        killed_migrations_converge(&installed, &newest_binary, &new, Backend::Ebpf);
        faulted_migrations_converge(&installed, &newest_binary, &new, Backend::Ebpf);
    }
    if newest.nftables_layout != nftables_layout_of(&new) {
        killed_migrations_converge(&installed, &newest_binary, &new, Backend::Nftables);
        faulted_migrations_converge(&installed, &newest_binary, &new, Backend::Nftables);
    }
}

/// Every release before the supported window (CI's upgrade layer, `./dev test-ci`): layout 6
/// upgraded and downgraded, its migrations killed and faulted, its nftables table drained;
/// nftables layout 2 migrated, killed and faulted; every later release upgraded live; the
/// newest release of an older eBPF layout killed, faulted and rolled back over this build.
#[test]
fn the_releases_before_the_supported_window_upgrade_live() {
    let old = history::cnibpf_of(LAYOUT_6);
    let (_serial, installed, new) = installed_first(&old);
    upgrade_then_downgrade(&installed, &old, &new);
    killed_migrations_converge(&installed, &old, &new, Backend::Ebpf);
    faulted_migrations_converge(&installed, &old, &new, Backend::Ebpf);
    nftables::nftables_table_of_an_older_layout_drains(&installed, &old, &new);
    let previous_nftables = history::cnibpf_of(NFTABLES_LAYOUT_2);
    nftables::nftables_table_of_the_previous_layout_migrates(&installed, &previous_nftables, &new);
    killed_migrations_converge(&installed, &previous_nftables, &new, Backend::Nftables);
    faulted_migrations_converge(&installed, &previous_nftables, &new, Backend::Nftables);
    // Every later release before the window, the same way (5da8470's nftables table is
    // drained above: no build migrates its layout).
    let releases = releases();
    let window_starts = releases.len() - history::SUPPORTED_RELEASES;
    for release in &releases[1..window_starts] {
        a_release_upgrades_live(&installed, &release.commit, &new);
    }
    // The migration from the newest release of an older eBPF layout (the last release may
    // write this build's own, which nothing migrates), killed and faulted the same way.
    let last_older = releases
        .iter()
        .rev()
        .find(|release| release.ebpf_layout < cnibpf_common::datapath::layout::VERSION)
        .expect("a release of an older eBPF layout than this build's");
    let last_older = history::cnibpf_of(&last_older.commit);
    killed_migrations_converge(&installed, &last_older, &new, Backend::Ebpf);
    faulted_migrations_converge(&installed, &last_older, &new, Backend::Ebpf);
    a_rollback_over_a_newer_layout_still_dels(&installed, &last_older, &new);
}
