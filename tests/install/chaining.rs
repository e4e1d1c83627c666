//! Chaining into the primary network in a file of cnibpf's own: every primary's shape, an
//! earlier in-place chain moved, `--watch` while the primary rewrites its file, readers never
//! seeing half a file.

use super::*;

#[test]
fn every_primary_shape_is_chained_in_a_file_of_cnibpfs_own_and_uninstall_removes_it() {
    for primary in primaries() {
        let node = NodeDirs::new("shapes");
        let entry = node.entry(&json!({ "ipMasq": false, "backend": "auto" }));
        node.write(primary.file, &primary.network);
        if let Some((file, multus)) = &primary.multus {
            node.write(file, multus);
        }
        // A network the runtime does not use: it sorts after the primary.
        let other =
            json!({ "name": "other", "cniVersion": "1.0.0", "plugins": [{ "type": "loopback" }] });
        node.write("99-other.conflist", &other);
        let before = node.files();
        let has_portmap = types(&primary.network).iter().any(|kind| kind == "portmap");
        if has_portmap {
            let refused = node.run("install", &["--entry", &entry]);
            let message = String::from_utf8_lossy(&refused.stderr);
            assert!(
                !refused.status.success() && message.contains("--replace-portmap"),
                "{}: a chain with portmap is refused: {refused:?}",
                primary.shape
            );
            assert_eq!(node.files(), before, "{}: nothing written", primary.shape);
            assert!(
                !node.bin_dir().join("cnibpf").exists(),
                "{}: nothing installed",
                primary.shape
            );
        }
        let flags: &[&str] = if has_portmap {
            &["--entry", &entry, "--replace-portmap"]
        } else {
            &["--entry", &entry]
        };
        node.succeed("install", flags);
        let installed = std::fs::read(node.bin_dir().join("cnibpf")).expect("the binary");
        assert_eq!(
            installed,
            std::fs::read(cnibpf_binary()).expect("cnibpf"),
            "{}",
            primary.shape
        );
        let chained = node.read(primary.own_file);
        assert_eq!(
            types(&chained),
            primary.chained,
            "{}: {chained:#}",
            primary.shape
        );
        assert_eq!(
            chained["name"], primary.network["name"],
            "{}: the same network, by name",
            primary.shape
        );
        let ours = chained["plugins"]
            .as_array()
            .and_then(|plugins| plugins.iter().find(|plugin| plugin["type"] == "cnibpf"))
            .expect("cnibpf's entry");
        assert_eq!(
            (ours["ipMasq"].clone(), ours["backend"].clone()),
            (json!(false), json!("auto"))
        );
        assert_eq!(
            ours["capabilities"]["portMappings"], true,
            "{}: runtimes send hostPorts to cnibpf",
            primary.shape
        );
        assert_eq!(
            ours["cnibpfInstall"]["source"], primary.file,
            "{}",
            primary.shape
        );
        assert_eq!(
            node.read(primary.file),
            primary.network,
            "{}: the primary's file is never written",
            primary.shape
        );
        assert_eq!(
            node.files(),
            {
                let mut files = before.clone();
                files.push(primary.own_file.to_owned());
                files.sort();
                files
            },
            "{}: one file more",
            primary.shape
        );
        let (used, network) = first_network(&node.conf_dir()).expect("a network");
        match &primary.multus {
            None => assert_eq!(
                (
                    used.file_name()
                        .map(|name| name.to_string_lossy().into_owned()),
                    &network
                ),
                (Some(primary.own_file.to_owned()), &chained),
                "{}: the runtime reads cnibpf's file in the primary's place",
                primary.shape
            ),
            Some((file, multus)) => {
                assert_eq!(
                    (&network, used.ends_with(file)),
                    (multus, true),
                    "{}: the runtime still reads Multus's file, untouched",
                    primary.shape
                );
                assert_eq!(
                    multus_cluster_network(&node.conf_dir(), file),
                    chained,
                    "{}: Multus's cluster network is cnibpf's file",
                    primary.shape
                );
            }
        }
        eprintln!(
            "{} ({}) chained in {}:\n{chained:#}",
            primary.shape, primary.file, primary.own_file
        );

        // Again: nothing changes, not even the file's time.
        let written = std::fs::metadata(node.conf_dir().join(primary.own_file))
            .and_then(|metadata| metadata.modified())
            .expect("mtime");
        let again = node.succeed("install", flags);
        assert!(
            again.trim().is_empty(),
            "a re-install writes nothing: {again}"
        );
        let unchanged = std::fs::metadata(node.conf_dir().join(primary.own_file))
            .and_then(|metadata| metadata.modified())
            .expect("mtime");
        assert_eq!(written, unchanged, "{}", primary.shape);

        node.succeed("uninstall", &[]);
        assert_eq!(
            node.files(),
            before,
            "{}: nothing left behind",
            primary.shape
        );
        assert_eq!(
            node.read(primary.file),
            primary.network,
            "{}",
            primary.shape
        );
        assert!(
            !node.bin_dir().join("cnibpf").exists(),
            "{}: binary removed",
            primary.shape
        );
    }
}

/// A node an earlier release installed on (cnibpf chained into the primary's own file, a
/// `.conf` turned into a `.conflist` — Multus's among them): the install moves the chain into
/// cnibpf's own file and puts every file back as it was.
#[test]
fn an_earlier_in_place_chain_moves_into_cnibpfs_own_file() {
    let node = NodeDirs::new("in-place");
    let mut in_place = calico();
    let portmap = in_place["plugins"][2].clone();
    in_place["plugins"][2] = json!({ "type": "cnibpf", "snat": true,
        "capabilities": { "portMappings": true },
        "cnibpfInstall": { "replacedPortmap": portmap, "portmapIndex": 2 } });
    node.write("10-calico.conflist", &in_place);
    // What an earlier release made of thin Multus's file.
    let multus = multus_thin(&calico());
    let mut multus_chain = json!({ "cniVersion": multus["cniVersion"], "name": multus["name"],
        "plugins": [multus.clone(), { "type": "cnibpf",
            "cnibpfInstall": { "convertedFrom": "00-multus.conf" } }] });
    if let Some(plugin) = multus_chain["plugins"][0].as_object_mut() {
        plugin.remove("cniVersion");
        plugin.remove("name");
    }
    node.write("00-multus.conflist", &multus_chain);
    node.succeed("install", &["--replace-portmap"]);
    assert_eq!(
        node.files(),
        [
            "00-multus.conf",
            "10-calico.cnibpf.conflist",
            "10-calico.conflist"
        ]
    );
    assert_eq!(
        node.read("00-multus.conf"),
        multus,
        "Multus's file as Multus wrote it"
    );
    assert_eq!(
        node.read("10-calico.conflist"),
        calico(),
        "Calico's as Calico wrote it"
    );
    assert_eq!(
        types(&node.read("10-calico.cnibpf.conflist")),
        ["calico", "bandwidth", "cnibpf"]
    );
    node.succeed("uninstall", &[]);
    assert_eq!(node.files(), ["00-multus.conf", "10-calico.conflist"]);
}

/// `--watch` while the primary rewrites its file in place, renames a new one over it and
/// changes it: a runtime reading the directory all the while (as libcni does) never finds a
/// network without cnibpf once it was chained, and cnibpf's file follows the primary's
/// content. Then another network comes to sort first and gets its own file, the old one gone.
#[test]
fn watch_keeps_the_runtime_on_a_chained_network_while_the_primary_rewrites_its_file() {
    let node = NodeDirs::new("watch");
    node.write("10-calico.conflist", &calico());
    let watcher = node.watch(&["--replace-portmap"]);
    let chained_with = |node: &NodeDirs, file: &str, kinds: &[&str]| {
        node.read_if_there(file)
            .is_some_and(|conflist| types(&conflist) == kinds)
    };
    assert!(
        eventually(Duration::from_secs(5), || chained_with(
            &node,
            "10-calico.cnibpf.conflist",
            &["calico", "bandwidth", "cnibpf"]
        )),
        "chained at start"
    );
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let stop = Arc::clone(&stop);
        let conf_dir = node.conf_dir();
        std::thread::spawn(move || {
            let mut reads = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let (path, network) = first_network(&conf_dir).expect("a network");
                assert!(
                    types(&network).iter().any(|kind| kind == "cnibpf"),
                    "after {reads} reads the runtime would use {} without cnibpf: {network:#}",
                    path.display()
                );
                reads += 1;
            }
            reads
        })
    };
    let mut changed = calico();
    for round in 0..20u64 {
        changed["plugins"][0]["mtu"] = json!(1400 + round);
        let text = serde_json::to_string_pretty(&changed).expect("JSON");
        if round % 2 == 0 {
            // In place, as calico's install-cni does: truncated, then written.
            std::fs::write(node.conf_dir().join("10-calico.conflist"), &text)
                .expect("rewrite in place");
        } else {
            let staged = node.conf_dir().join("calico.tmp");
            std::fs::write(&staged, &text).expect("stage");
            std::fs::rename(&staged, node.conf_dir().join("10-calico.conflist")).expect("rename");
        }
        assert!(
            eventually(Duration::from_secs(5), || node
                .read_if_there("10-calico.cnibpf.conflist")
                .is_some_and(
                    |chained| chained["plugins"][0]["mtu"] == json!(1400 + round)
                )),
            "round {round}: cnibpf's file follows the primary's: {:#?}",
            node.read_if_there("10-calico.cnibpf.conflist")
        );
    }
    stop.store(true, Ordering::Relaxed);
    let reads = reader.join().expect("the runtime always found cnibpf");
    assert!(reads > 100, "only {reads} reads");
    // A new primary that sorts first takes over: the runtime uses it (unchained until the
    // watch has rendered its file: a new network's first moments are its writer's).
    node.write("05-cilium.conflist", &cilium_chaining());
    assert!(
        eventually(Duration::from_secs(5), || chained_with(
            &node,
            "05-cilium.cnibpf.conflist",
            &["ptp", "cilium-cni", "cnibpf"]
        ) && node
            .read_if_there("10-calico.cnibpf.conflist")
            .is_none()),
        "the new first network is chained, the old file gone: {:?}",
        node.files()
    );
    assert_eq!(
        node.files(),
        [
            "05-cilium.cnibpf.conflist",
            "05-cilium.conflist",
            "10-calico.conflist"
        ]
    );
    watcher.terminate();
}

#[test]
fn readers_never_see_half_a_file_and_always_find_a_network() {
    let node = NodeDirs::new("readers");
    node.write("10-mynet.conf", &bridge());
    let stop = Arc::new(AtomicBool::new(false));
    let conf_dir = node.conf_dir();
    let reader = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut reads = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // As libcni: the sorted .conf/.conflist/.json files, the first one parsed.
                let mut names: Vec<PathBuf> = std::fs::read_dir(&conf_dir)
                    .expect("read the conf dir")
                    .filter_map(Result::ok)
                    .map(|entry| entry.path())
                    .filter(|path| {
                        path.extension()
                            .is_some_and(|extension| extension == "conf" || extension == "conflist")
                    })
                    .collect();
                names.sort();
                let Some(first) = names.first() else {
                    panic!("no network in the conf dir after {reads} reads");
                };
                // The file may be renamed away between the listing and the read.
                if let Ok(text) = std::fs::read_to_string(first) {
                    serde_json::from_str::<Value>(&text).unwrap_or_else(|error| {
                        panic!("{} read half written ({error}):\n{text}", first.display())
                    });
                    reads += 1;
                }
            }
            reads
        })
    };
    for _ in 0..20 {
        node.succeed("install", &[]);
        node.succeed("uninstall", &[]);
    }
    stop.store(true, Ordering::Relaxed);
    let reads = reader.join().expect("the reader saw only whole files");
    assert!(reads > 100, "only {reads} reads");
    assert_eq!(node.read("10-mynet.conf"), bridge());
}
