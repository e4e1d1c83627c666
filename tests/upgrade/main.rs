//! Live upgrade across datapath layouts, with real older cnibpf builds: every release
//! `releases.toml` lists, built from this repository's history. A node of the supported window
//! upgrades while its pods run, and its connections, translations, filters, source checks and
//! counters live on; a migration killed at any point is completed by the next run; a rollback
//! to the window drains this build's newer state. A node on a release before the window passes
//! through the window's newest release, live, and this build adds nothing to its state
//! meanwhile but lets its pods go.
//!
//! Two tests, each run in phases, one after the other: the supported window (`./dev test`) and
//! the releases before it (CI's upgrade layer). The simulated hosts run the cnibpf binary
//! installed at one path, replaced in place as an upgrade replaces it.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::{Mutex, MutexGuard},
    time::Duration,
};

use cnibpf_common::sources::SourceSet;
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

/// Where a migration keeps the old maps (a layout's), or the new ones (a map's), until it is
/// done.
const ASIDE: [&str; 4] = ["layout-6-maps", "layout-8-maps", "layout-9-maps", "resize"];

/// Whether a migration left old maps aside.
fn half_migrated(sim: &SimHost) -> bool {
    ASIDE.iter().any(|aside| sim.pin_path.join(aside).exists())
}

fn assert_migrated(sim: &SimHost) {
    assert_eq!(
        sim.layout_version(),
        cnibpf_common::datapath::layout::stamped()
    );
    assert!(!half_migrated(sim), "the old pins are gone");
}

/// Whether a migration of `backend`'s state was left half done, and whether it is complete.
fn migration_state(sim: &SimHost, backend: Backend) -> (bool, bool) {
    match backend {
        Backend::Ebpf => (
            half_migrated(sim),
            sim.layout_version() == cnibpf_common::datapath::layout::stamped(),
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
            "{context}: the last DEL leaves nothing of an attachment"
        );
        // The eBPF datapath stays for the node's next pod: the next round's older cnibpf
        // starts from a node without it.
        let unload = sim.cnibpf(&["unload", "--pin-path", &pin_path]);
        assert!(unload.status.success(), "{context}: unload: {unload:?}");
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

/// A rollback to a release of the window whose nftables layout is older than this build's,
/// after this build migrated the node: the release refuses ADD into the newer layout, the pods
/// carry on, their DELs work, and the last one leaves nothing of the newer state, so that the
/// release starts afresh at its own layout.
fn a_rollback_over_a_newer_layout_still_dels(installed: &Installed, older: &Path, new: &Path) {
    installed.put(older);
    let sim = SimHost::on(Backend::Nftables, "rbk", pod_keys("nftables"));
    let pod = LivePod::start(&sim);
    installed.put(new);
    let c2 = sim.container("c2", port_mappings(&[(8090, 80, "tcp")]));
    assert_eq!(migration_state(&sim, Backend::Nftables), (false, true));
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
    let ruleset = sim.nft_ruleset();
    assert!(
        !ruleset.contains("table inet cnibpf"),
        "the last DEL removed the newer table:\n{ruleset}"
    );
    // The release knows no state file, and leaves the source checks' chains of the pods its
    // drain released: this build, back again, drops what they name rather than makes it
    // again.
    installed.put(new);
    let c4 = sim.container("c4", port_mappings(&[(8090, 80, "tcp")]));
    assert_eq!(
        sim.attached_ids(),
        std::slice::from_ref(&c4.attachment.container_id),
        "only the new pod is served"
    );
    sim.del(&c4)
        .unwrap_or_else(|error| panic!("DEL after the rollback's drain: {error}"));
    assert!(sim.holds_no_state(), "nothing left");
}

/// A release before the window on `backend`, with a live pod and another: this build adds no
/// pod to its state (106, naming the release to pass through) but lets the other go (DEL),
/// while the pod carries on; the window's newest release (`through`) migrates the state, and
/// this build takes it over from there — the pod's connections, translations and filter
/// counters carry on, a new pod starts and is reached, CHECK passes, every DEL leaves nothing.
fn passes_through(installed: &Installed, old: &Path, through: &Path, new: &Path, backend: Backend) {
    let case = format!("{} on {}", old.display(), backend.name());
    installed.put(old);
    let sim = SimHost::on(backend, "thr", pod_keys(backend.name()));
    let pod = LivePod::start(&sim);
    let other = sim.container("c0", port_mappings(&[(8091, 80, "tcp")]));
    installed.put(new);
    let refused = sim
        .add_container("refused", port_mappings(&[(8090, 80, "tcp")]))
        .expect_err("this build adds no pod to a layout before the window");
    let message = refused.0.error_msg();
    assert_eq!(refused.0.error_code(), Some(106), "{case}: {refused}");
    assert!(
        message.contains("0.5.1 (7d1bccd)"),
        "{case}: names the release to pass through: {message}"
    );
    sim.del(&other)
        .unwrap_or_else(|error| panic!("{case}: this build's DEL of the release's pod: {error}"));
    pod.assert_translations(&sim, &format!("{case}: beside the refused ADD"));
    installed.put(through);
    let c2 = sim.container("c2", port_mappings(&[(8090, 80, "tcp")]));
    let hits = inspected_rule_packets(&sim, &pod.container);
    installed.put(new);
    let c3 = sim.container("c3", port_mappings(&[(8092, 80, "tcp")]));
    if backend == Backend::Ebpf {
        assert_migrated(&sim);
        assert_hooked_by_tcx(&sim, &pod.container);
    }
    assert!(
        inspected_rule_packets(&sim, &pod.container) >= hits,
        "{case}: the filter's counters were kept"
    );
    pod.assert_translations(&sim, &format!("{case}: after passing through"));
    sim.check(&pod.container)
        .unwrap_or_else(|error| panic!("{case}: CHECK of the release's pod: {error}"));
    let _servers = [(&c2, "c2"), (&c3, "c3")]
        .map(|(container, name)| TcpServer::start(&container.netns, container.socket(80), name));
    for (port, name) in [(8090, "c2"), (8092, "c3")] {
        assert_eq!(
            tcp_request(&sim.outside, sim.uplink_target(port)).as_deref(),
            Ok(name),
            "{case}"
        );
    }
    let c1 = pod.assert_carried_on(&format!("{case}: through the window"));
    for container in [&c1, &c2, &c3] {
        sim.del(container)
            .unwrap_or_else(|error| panic!("{case}: DEL: {error}"));
    }
    // The pod this build let go while it could not serve the state is reclaimed as a
    // vanished one, as the DaemonSet's periodic `gc --stale` does.
    let pin_path = sim.pin_path.display().to_string();
    let reclaimed = sim.cnibpf(&["gc", "--stale", "--pin-path", &pin_path]);
    assert!(
        reclaimed.status.success(),
        "{case}: gc --stale: {reclaimed:?}"
    );
    assert!(
        sim.holds_no_state(),
        "{case}: nothing left: {}",
        sim.inspect()["attachments"]
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
/// each release upgraded live on both backends; the newest one's migrations, of each backend
/// whose layout this build changed, killed and faulted; and a rollback to it over this build's
/// newer nftables layout.
#[test]
fn the_supported_releases_upgrade_live() {
    let window = history::supported_releases();
    let newest = window.last().expect("releases.toml lists releases");
    let newest_binary = history::cnibpf_of(&newest.commit);
    let (_serial, installed, new) = installed_first(&newest_binary);
    for release in &window {
        a_release_upgrades_live(&installed, &release.commit, &new);
    }
    if newest.ebpf_layout < cnibpf_common::datapath::layout::stamped() {
        killed_migrations_converge(&installed, &newest_binary, &new, Backend::Ebpf);
        faulted_migrations_converge(&installed, &newest_binary, &new, Backend::Ebpf);
    }
    if newest.nftables_layout != nftables_layout_of(&new) {
        killed_migrations_converge(&installed, &newest_binary, &new, Backend::Nftables);
        nftables::a_migrations_transaction_landing_after_its_run_was_killed_loses_no_record(
            &installed,
            &newest_binary,
            &new,
        );
        faulted_migrations_converge(&installed, &newest_binary, &new, Backend::Nftables);
        nftables::nftables_table_of_the_previous_layout_migrates(&installed, &newest_binary, &new);
        a_rollback_over_a_newer_layout_still_dels(&installed, &newest_binary, &new);
    }
}

/// The releases before the supported window (CI's upgrade layer, `./dev test-ci`), each
/// passing through the window's newest release (see [`passes_through`]): the first (eBPF
/// layout 6, its containers hooked by cls_bpf filters), the newest of an older eBPF layout,
/// and the last of nftables layout 2; the first's nftables table (layout 1), which no build
/// migrates, drained pod by pod.
#[test]
fn the_releases_before_the_supported_window_pass_through_it() {
    let window = history::supported_releases();
    let through = history::cnibpf_of(&window.last().expect("releases.toml lists releases").commit);
    let (_serial, installed, new) = installed_first(&through);
    let releases = releases();
    let last_older = releases
        .iter()
        .rev()
        .find(|release| release.ebpf_layout < window[0].ebpf_layout)
        .expect("a release of an eBPF layout older than the window's");
    for release in [LAYOUT_6, last_older.commit.as_str()] {
        passes_through(
            &installed,
            &history::cnibpf_of(release),
            &through,
            &new,
            Backend::Ebpf,
        );
    }
    let nftables_layout_2 = history::cnibpf_of(NFTABLES_LAYOUT_2);
    passes_through(
        &installed,
        &nftables_layout_2,
        &through,
        &new,
        Backend::Nftables,
    );
    nftables::nftables_table_of_an_older_layout_drains(
        &installed,
        &history::cnibpf_of(LAYOUT_6),
        &new,
    );
}
