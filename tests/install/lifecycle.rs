//! Upgrades and back-out: the binary replaced while it runs, portmap's pods deleted through
//! cnibpf's entry, `uninstall --purge`, uninstalls finished by cached configurations, an
//! nftables datapath that cannot be migrated.

use super::*;

#[test]
fn an_upgrade_replaces_the_binary_while_the_old_one_runs() {
    let node = NodeDirs::new("upgrade");
    node.write("10-flannel.conflist", &flannel());
    // The "old release": the same program with a byte more, running from the bin dir.
    let old = node.bin_dir().join("cnibpf");
    let mut content = std::fs::read(cnibpf_binary()).expect("cnibpf");
    content.push(0);
    std::fs::write(&old, &content).expect("the old binary");
    std::fs::set_permissions(&old, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    // A process another test forks while the file was open for writing holds it open until
    // it execs: the kernel answers "text file busy" until then.
    let mut attempts = 0;
    let running = loop {
        let spawned = Command::new(&old)
            .args(node.args("install", &["--watch", "--replace-portmap"]))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        match spawned {
            Err(error)
                if error.kind() == std::io::ErrorKind::ExecutableFileBusy && attempts < 100 =>
            {
                attempts += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            spawned => break Daemon::from(spawned.expect("run the old binary")),
        }
    };
    assert!(
        eventually(Duration::from_secs(5), || node
            .read_if_there("10-flannel.cnibpf.conflist")
            .is_some_and(|chained| types(&chained) == ["flannel", "cnibpf"])),
        "the old release chained itself in"
    );
    let output = node.succeed("install", &["--replace-portmap"]);
    assert!(output.contains("installed"), "{output}");
    assert_eq!(
        std::fs::read(&old).expect("the new binary"),
        std::fs::read(cnibpf_binary()).expect("cnibpf"),
        "the new release is in place"
    );
    running.terminate();
}

/// A reference portmap and where it keeps a pod's rules.
struct PortmapUnderTest {
    /// Short, for the test's names.
    name: &'static str,
    /// portmap's keys besides `type`, `snat` and `capabilities`.
    keys: Value,
    /// A directory searched before `/usr/lib/cni`, holding a newer portmap.
    plugins: Option<PathBuf>,
    /// The `iptables` and `ip6tables` portmap runs (it takes the first on PATH).
    iptables: Option<(&'static str, &'static str)>,
    /// The command listing its rules in the simulated host.
    rules: &'static [&'static str],
}

/// Debian's portmap 1.1.1 over iptables-nft (Debian's default) and legacy iptables, and
/// Debian unstable's portmap (≥ 1.5, unpacked by `scripts/bootstrap.sh`) with its own
/// nftables backend.
fn reference_portmaps() -> Vec<PortmapUnderTest> {
    let unstable = cnibpf_tests::tools_dir().join("cni-plugins-unstable/usr/lib/cni");
    assert!(
        unstable.join("portmap").exists(),
        "{}: Debian unstable's portmap is missing (scripts/bootstrap.sh unpacks it)",
        unstable.display()
    );
    vec![
        PortmapUnderTest {
            name: "nft",
            keys: json!({}),
            plugins: None,
            iptables: Some(("iptables-nft", "ip6tables-nft")),
            rules: &["iptables-nft-save", "-t", "nat"],
        },
        PortmapUnderTest {
            name: "legacy",
            keys: json!({}),
            plugins: None,
            iptables: Some(("iptables-legacy", "ip6tables-legacy")),
            rules: &["iptables-legacy-save", "-t", "nat"],
        },
        PortmapUnderTest {
            name: "nftables",
            keys: json!({ "backend": "nftables" }),
            plugins: Some(unstable),
            iptables: None,
            rules: &["nft", "list", "ruleset"],
        },
    ]
}

/// A pod the reference portmap set up before `install --replace-portmap` (its hostPort in
/// portmap's chains) is deleted through cnibpf's entry: cnibpf holds nothing of it and hands
/// the DEL to portmap, which removes its rules — with iptables over nf_tables (Debian's
/// default), with legacy iptables, and with portmap's own nftables backend. A pod cnibpf set
/// up afterwards is deleted by cnibpf, and its repeated DELs (which containerd sends) succeed.
#[test]
fn a_pod_portmap_made_before_the_install_is_deleted_by_portmap_through_cnibpfs_entry() {
    for portmap in reference_portmaps() {
        let name = portmap.name;
        let mut sim = SimHost::with_chain(
            &format!("pmd-{name}"),
            vec![Chained::ReferencePortmap(portmap.keys)],
        );
        if let Some(plugins) = &portmap.plugins {
            // Only portmap from there: the bridge and host-local stay Debian's.
            let dir = sim.work_dir.join("plugins");
            std::fs::create_dir_all(&dir).expect("plugins dir");
            std::os::unix::fs::symlink(plugins.join("portmap"), dir.join("portmap"))
                .expect("link portmap");
            sim.chain.search_first(&dir);
        }
        let mut path = std::env::var("PATH").unwrap_or_default();
        if let Some((iptables, ip6tables)) = portmap.iptables {
            let tools = sim.work_dir.join("iptables");
            std::fs::create_dir_all(&tools).expect("tools dir");
            for (link, target) in [("iptables", iptables), ("ip6tables", ip6tables)] {
                std::os::unix::fs::symlink(format!("/usr/sbin/{target}"), tools.join(link))
                    .expect("link iptables");
            }
            path = format!("{}:{path}", tools.display());
        }
        sim.chain.set_environment(&[("PATH", &path)]);
        let search = sim.chain.cni_path().to_owned();
        let made_by_portmap = sim
            .add_container("old", port_mappings(&[(18090, 80, "tcp")]))
            .unwrap_or_else(|error| panic!("{name}: ADD through portmap: {error}"));
        let container_id = made_by_portmap.attachment.container_id.clone();
        let before = sim.host.exec(portmap.rules);
        assert!(
            before.contains(&container_id) && before.contains("18090"),
            "{name}: portmap's rules of the pod:\n{before}"
        );

        let node = NodeDirs::new(&format!("pmd-{name}"));
        node.write("10-net.conflist", sim.chain.conflist());
        let entry = node.root.join("entry.json");
        std::fs::write(
            &entry,
            json!({ "pinPath": sim.pin_path, "logFile": sim.call_log() }).to_string(),
        )
        .expect("entry");
        node.succeed(
            "install",
            &["--entry", &entry.display().to_string(), "--replace-portmap"],
        );
        let own = node.read("10-net.cnibpf.conflist");
        assert_eq!(types(&own), ["bridge", "cnibpf"], "{own:#}");
        let through_cnibpf = Chain::new(own, &search, &sim.host.path());
        through_cnibpf.remember(&made_by_portmap.attachment, &made_by_portmap.result);
        let del = |attachment: &Attachment| {
            let cnibpf = &through_cnibpf.conflist()["plugins"][1];
            let config = through_cnibpf.plugin_config(
                cnibpf,
                "1.0.0",
                Some(&made_by_portmap.result),
                &attachment.capability_args,
            );
            let mut process =
                plugin_command(&search, &sim.host.path(), "cnibpf", "DEL", Some(attachment));
            process.env("PATH", &path);
            run_with_stdin(process, "cnibpf", "DEL", &config.to_string())
        };
        let deleted = del(&made_by_portmap.attachment);
        assert_eq!(
            deleted.exit_code, 0,
            "{name}: DEL through cnibpf: {deleted:?}"
        );
        let after = sim.host.exec(portmap.rules);
        assert!(
            !after.contains(&container_id) && !after.contains("18090"),
            "{name}: nothing of portmap's for the pod remains:\n{after}"
        );
        let logged = std::fs::read_to_string(sim.call_log()).expect("the call log");
        assert!(
            logged.lines().any(|line| line.contains(&container_id)
                && line.contains("\"DEL\"")
                && line.contains("portmap")),
            "{name}: the DEL's log line names portmap:\n{logged}"
        );
        let again = del(&made_by_portmap.attachment);
        assert_eq!(again.exit_code, 0, "{name}: a repeated DEL: {again:?}");
        sim.del(&made_by_portmap)
            .unwrap_or_else(|error| panic!("{name}: the bridge's DEL: {error}"));
    }
}

/// `uninstall --purge` with pods running: every attachment's state, the datapath, the lock
/// and statistics files, cnibpf's conflist and binary go at once, each listed; the pods'
/// hostPorts stop answering. Without `--purge`, with no pod left, the same goes (the
/// datapath `install --load` loaded ahead included).
#[test]
fn uninstall_purge_removes_everything_at_once_and_lists_it() {
    let sim = SimHost::new("unp", json!({ "ipMasq": true }));
    let served = sim.container("a", port_mappings(&[(18095, 80, "tcp")]));
    let (node, entry) = NodeDirs::under(&sim, "purge");
    let run = |extra: &[&str]| node.run_in(&sim, extra);
    run(&["install", "--entry", &entry]);
    assert!(sim.pin_path.exists(), "the container's datapath");
    let stats = cnibpf_tests::topology::call_stats_file(&sim.pin_path);
    let lock = stats.with_extension("lock");
    let purged = run(&["uninstall", "--purge"]);
    for removed in [
        served.attachment.container_id.clone(),
        format!("eBPF datapath {}", sim.pin_path.display()),
        lock.display().to_string(),
        "10-net.cnibpf.conflist".to_owned(),
        "bin/cnibpf".to_owned(),
    ] {
        assert!(purged.contains(&removed), "lists {removed}: {purged}");
    }
    assert!(
        sim.holds_no_state() && !sim.pin_path.exists(),
        "no datapath left"
    );
    assert!(!lock.exists() && !stats.exists(), "no instance file left");
    assert_eq!(node.files(), ["10-net.conflist"]);
    assert!(!node.bin_dir().join("cnibpf").exists());
    assert!(
        sim.installed_host_ports().is_empty(),
        "the purged pod's hostPort is gone"
    );

    // Loaded ahead, no pod: a plain uninstall takes it all.
    run(&["install", "--entry", &entry, "--load"]);
    assert!(sim.pin_path.exists(), "loaded ahead of the first pod");
    let removed = run(&["uninstall"]);
    assert!(
        removed.contains(&format!("eBPF datapath {}", sim.pin_path.display())),
        "{removed}"
    );
    assert!(sim.holds_no_state() && !sim.pin_path.exists() && !lock.exists());
    assert_eq!(node.files(), ["10-net.conflist"]);
}

/// `uninstall` with a pod running leaves the instance's release file, which the pod's DEL
/// finds even when its runtime passes the configuration cached at ADD (cnibpf's ordinary
/// entry, as CRI-O and podman do): that DEL takes everything. An `install` in between calls
/// the release off: the DEL then leaves cnibpf in place.
#[test]
fn a_cached_configurations_del_finishes_an_uninstall_and_an_install_calls_it_off() {
    let sim = SimHost::new("unc", json!({ "ipMasq": true }));
    let (node, entry) = NodeDirs::under(&sim, "cached");
    let run = |extra: &[&str]| node.run_in(&sim, extra);
    let release = cnibpf_tests::topology::call_stats_file(&sim.pin_path).with_extension("release");
    let own_file = node.conf_dir().join("10-net.cnibpf.conflist");
    let binary = node.bin_dir().join("cnibpf");

    run(&["install", "--entry", &entry]);
    let kept = sim.container("kept", port_mappings(&[(18096, 80, "tcp")]));
    run(&["uninstall"]);
    assert!(release.exists(), "uninstall left the release file");
    let called_off = run(&["install", "--entry", &entry]);
    assert!(called_off.contains("called off"), "{called_off}");
    assert!(!release.exists(), "install removed the release file");
    sim.del(&kept)
        .unwrap_or_else(|error| panic!("DEL with the cached entry: {error}"));
    assert!(
        own_file.exists() && binary.exists(),
        "a DEL after the new install leaves cnibpf's conflist and binary"
    );

    let gone = sim.container("gone", port_mappings(&[(18097, 80, "tcp")]));
    run(&["uninstall"]);
    assert!(release.exists() && own_file.exists() && binary.exists());
    sim.del(&gone)
        .unwrap_or_else(|error| panic!("DEL with the cached entry: {error}"));
    assert_uninstalled(&sim, &own_file, &binary);
}

/// A node whose nftables datapath is of a layout no cnibpf migrates (layout 1: a table without
/// a comment, as 5da8470 wrote it) is not given this build, which would refuse its new pods:
/// `install` says why and what to do, and replaces neither the binary nor the conflist; once
/// the table is gone, it installs.
#[test]
fn install_refuses_a_node_whose_nftables_datapath_cannot_be_migrated() {
    let netns = cnibpf_tests::Netns::create("cbt-install-layout1");
    let node = NodeDirs::new("layout1");
    node.write("10-flannel.conflist", &flannel());
    let install = || {
        let mut command = netns.command(&[&cnibpf_binary().display().to_string()]);
        command.args(node.args("install", &["--replace-portmap"]));
        command.output().expect("run cnibpf install")
    };
    netns.exec(&["nft", "add", "table", "inet", "cnibpf"]);
    let refused = install();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{refused:?}");
    assert!(
        said.contains("which this build does not migrate") && said.contains("drain the node"),
        "{said}"
    );
    assert_eq!(
        node.files(),
        ["10-flannel.conflist"],
        "nothing of cnibpf's written"
    );
    assert!(
        !node.bin_dir().join("cnibpf").exists(),
        "the binary is not replaced"
    );
    netns.exec(&["nft", "delete", "table", "inet", "cnibpf"]);
    let installed = install();
    assert!(installed.status.success(), "{installed:?}");
    assert!(
        node.bin_dir().join("cnibpf").exists(),
        "installed once the table is gone"
    );
}

/// A node whose eBPF datapath is of a layout before the supported window (here layout 9, as
/// a 0.4 release stamped it) is not given this build either: `install` names the release to
/// pass through and writes nothing; once its pods are gone (their DELs drain the state, which
/// the last one removes), it installs.
#[test]
fn install_refuses_a_node_whose_ebpf_datapath_is_before_the_window() {
    let sim = SimHost::new("inst-l9", json!({}));
    let pod = sim.container("c1", Value::Null);
    let mut stamp = sim.layout_bytes();
    stamp[8..12].copy_from_slice(&9u32.to_le_bytes());
    sim.write_layout(&stamp);
    let (node, entry) = NodeDirs::under(&sim, "layout9");
    let args = node.args("install", &["--entry", &entry]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let install = || sim.cnibpf(&args);
    let refused = install();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{refused:?}");
    assert!(
        said.contains("has layout v9, which this build does not migrate")
            && said.contains("upgrade it through 0.5.1 (7d1bccd) first"),
        "{said}"
    );
    assert_eq!(
        node.files(),
        ["10-net.conflist"],
        "nothing of cnibpf's written"
    );
    assert!(
        !node.bin_dir().join("cnibpf").exists(),
        "the binary is not replaced"
    );
    sim.del(&pod)
        .unwrap_or_else(|error| panic!("the DEL of the release's pod: {error}"));
    assert!(!sim.pin_path.exists(), "the last DEL removed the state");
    let installed = install();
    assert!(installed.status.success(), "{installed:?}");
    assert!(
        node.bin_dir().join("cnibpf").exists(),
        "installed once the state is gone"
    );
}

/// The last pod's DEL leaves the datapath for the next pod (its ADD loads nothing); `cnibpf
/// unload` takes it off the node, with the instance's files, and refuses while a pod uses it.
#[test]
fn the_datapath_outlives_the_last_pod_until_unload() {
    let sim = SimHost::new("unload", json!({ "ipMasq": true }));
    let pin_path = sim.pin_path.display().to_string();
    let unload = || sim.cnibpf(&["unload", "--pin-path", &pin_path]);
    let pod = sim.container("a", port_mappings(&[(18096, 80, "tcp")]));
    let refused = unload();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && said.contains("still serves 1 attachment"),
        "{refused:?}"
    );
    assert!(!sim.holds_no_state(), "the refused unload changed nothing");

    sim.del(&pod)
        .unwrap_or_else(|error| panic!("DEL of the last pod: {error}"));
    assert!(
        sim.holds_no_state() && sim.pin_path.join("layout").exists(),
        "the last DEL left the datapath, and nothing of the pod in it"
    );
    assert!(
        !sim.tcx_programs(UPLINK).is_empty(),
        "the uplink's hooks stay for the next pod"
    );

    // What a writer of the instance's state file killed mid-write (a runtime's timeout) left.
    let state_file = nftables_state_file(&sim.pin_path);
    let temporary = state_file.with_file_name(format!(
        ".{}.4242.tmp",
        state_file.file_name().expect("a file").to_string_lossy()
    ));
    std::fs::write(&temporary, b"{}").expect("a killed writer's temporary");
    let unloaded = unload();
    assert!(unloaded.status.success(), "{unloaded:?}");
    assert!(
        !temporary.exists(),
        "unload removes every file of the instance"
    );
    let said = String::from_utf8_lossy(&unloaded.stdout);
    assert!(
        said.contains(&format!("removed eBPF datapath {pin_path}")),
        "{said}"
    );
    assert!(!sim.pin_path.exists(), "no datapath left");
    assert!(
        sim.tcx_programs(UPLINK).is_empty(),
        "no cnibpf program on the uplink"
    );
    let again = unload();
    assert!(again.status.success(), "{again:?}");
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("nothing loaded"),
        "{again:?}"
    );
}
