//! `cnibpf install` and `cnibpf uninstall` against a node's CNI directories (temporary ones):
//! the primary networks of Calico, flannel, Cilium in chaining mode, the bridge plugin and
//! Multus (thin and thick) in front of a cluster network, as they ship them; cnibpf's own
//! conflist read by a runtime in the primary's place, the primary's files never written;
//! re-installs, an upgrade while the old binary runs, an earlier release's in-place chain
//! moved out, `--watch` while the primary rewrites or replaces its file (a runtime never
//! reading a network without cnibpf), readers that never see half a file, and uninstall
//! leaving the directory as it was.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use cnibpf_tests::{
    assertions::assert_uninstalled,
    chain::{Attachment, Chain, plugin_command, run_with_stdin},
    eventually,
    topology::{SimHost, cni_path, cnibpf_binary, port_mappings},
};
use serde_json::{Value, json};

/// A node's CNI conf and bin dirs, removed on drop, and an entry naming a pinPath of the
/// test's own (uninstall removes the datapath of the instance an entry names).
struct NodeDirs {
    root: PathBuf,
    pin_path: PathBuf,
}

impl NodeDirs {
    fn new(name: &str) -> Self {
        let root =
            std::env::temp_dir().join(format!("cnibpf-install-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for dir in ["net.d", "bin"] {
            std::fs::create_dir_all(root.join(dir))
                .unwrap_or_else(|error| panic!("create {}: {error}", root.display()));
        }
        let pin_path = PathBuf::from(format!(
            "/sys/fs/bpf/cnibpf-test-install-{name}-{}",
            std::process::id()
        ));
        std::fs::write(
            root.join("entry.json"),
            json!({ "pinPath": pin_path }).to_string(),
        )
        .expect("write the entry");
        Self { root, pin_path }
    }

    /// A node whose primary network is `sim`'s interface plugin alone, and an entry file naming
    /// `sim`'s pinPath and call log (its path, second).
    fn under(sim: &SimHost, name: &str) -> (Self, String) {
        let node = Self::new(name);
        let primary = json!({ "cniVersion": "1.0.0", "name": sim.network(),
            "plugins": [sim.chain.conflist()["plugins"][0]] });
        node.write("10-net.conflist", &primary);
        let entry = node.root.join("sim-entry.json");
        std::fs::write(
            &entry,
            json!({ "pinPath": sim.pin_path, "logFile": sim.call_log() }).to_string(),
        )
        .expect("entry");
        (node, entry.display().to_string())
    }

    /// `cnibpf <extra>` with this node's dirs in `sim`'s host namespace, as the DaemonSets run
    /// (host network); it must succeed: what it said.
    fn run_in(&self, sim: &SimHost, extra: &[&str]) -> String {
        let args = self.args(extra[0], &extra[1..]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let output = sim.cnibpf(&args);
        assert!(output.status.success(), "cnibpf {extra:?}: {output:?}");
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// An entry file with `keys` and this node's pinPath.
    fn entry(&self, keys: &Value) -> String {
        let mut entry = keys.clone();
        entry["pinPath"] = json!(self.pin_path);
        let path = self.root.join("entry-keys.json");
        std::fs::write(&path, entry.to_string()).expect("write the entry");
        path.display().to_string()
    }

    fn conf_dir(&self) -> PathBuf {
        self.root.join("net.d")
    }

    fn bin_dir(&self) -> PathBuf {
        self.root.join("bin")
    }

    fn write(&self, name: &str, value: &Value) {
        let path = self.conf_dir().join(name);
        std::fs::write(&path, serde_json::to_string_pretty(value).expect("JSON"))
            .unwrap_or_else(|error| panic!("write {}: {error}", path.display()));
    }

    fn read(&self, name: &str) -> Value {
        let path = self.conf_dir().join(name);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|error| panic!("read {}: {error}", path.display()));
        serde_json::from_str(&text)
            .unwrap_or_else(|error| panic!("{} does not parse ({error}):\n{text}", path.display()))
    }

    /// The network in file `name`, when it is there and whole.
    fn read_if_there(&self, name: &str) -> Option<Value> {
        let text = std::fs::read_to_string(self.conf_dir().join(name)).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// The file names of the conf dir, sorted.
    fn files(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.conf_dir())
            .expect("read the conf dir")
            .filter_map(Result::ok)
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// The arguments of `command` with `extra`: the dirs, and for `install` this node's
    /// entry unless `extra` names one.
    fn args(&self, command: &str, extra: &[&str]) -> Vec<String> {
        let mut args = vec![
            command.to_owned(),
            "--conf-dir".to_owned(),
            self.conf_dir().display().to_string(),
            "--bin-dir".to_owned(),
            self.bin_dir().display().to_string(),
        ];
        if command == "install" && !extra.contains(&"--entry") {
            args.push("--entry".to_owned());
            args.push(self.root.join("entry.json").display().to_string());
        }
        args.extend(extra.iter().map(|arg| (*arg).to_owned()));
        args
    }

    /// `cnibpf install` (or `uninstall`) with `extra` arguments, run by `binary`.
    fn run_with(&self, binary: &Path, command: &str, extra: &[&str]) -> Output {
        Command::new(binary)
            .args(self.args(command, extra))
            .output()
            .unwrap_or_else(|error| panic!("run cnibpf {command}: {error}"))
    }

    fn run(&self, command: &str, extra: &[&str]) -> Output {
        self.run_with(&cnibpf_binary(), command, extra)
    }

    fn succeed(&self, command: &str, extra: &[&str]) -> String {
        let output = self.run(command, extra);
        assert!(
            output.status.success(),
            "cnibpf {command} {extra:?}: {output:?}"
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    fn watch(&self, extra: &[&str]) -> Child {
        Command::new(cnibpf_binary())
            .args(self.args("install", extra))
            .arg("--watch")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start cnibpf install --watch")
    }
}

impl Drop for NodeDirs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
        let _ = std::fs::remove_dir_all(&self.pin_path);
    }
}

fn types(conflist: &Value) -> Vec<String> {
    conflist["plugins"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|plugin| plugin["type"].as_str().map(str::to_owned))
        .collect()
}

fn terminate(mut child: Child) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("a pid")),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let status = child.wait().expect("wait for the watcher");
    assert!(
        status.success(),
        "the watcher exits cleanly on SIGTERM: {status}"
    );
}

/// A primary network as its CNI ships it, and what cnibpf's install must make of it.
struct Primary {
    shape: &'static str,
    /// The file and network cnibpf chains into.
    file: &'static str,
    network: Value,
    /// A Multus file sorting before it, as Multus writes its own.
    multus: Option<(&'static str, Value)>,
    /// Plugin types of cnibpf's own file.
    chained: &'static [&'static str],
    /// cnibpf's own file.
    own_file: &'static str,
}

fn calico() -> Value {
    json!({ "name": "k8s-pod-network", "cniVersion": "0.3.1", "plugins": [
        { "type": "calico", "log_level": "info", "datastore_type": "kubernetes",
          "mtu": 1440, "ipam": { "type": "calico-ipam" },
          "policy": { "type": "k8s" }, "kubernetes": { "kubeconfig": "/etc/cni/net.d/calico-kubeconfig" } },
        { "type": "bandwidth", "capabilities": { "bandwidth": true } },
        { "type": "portmap", "snat": true, "capabilities": { "portMappings": true } },
    ]})
}

fn flannel() -> Value {
    json!({ "name": "cbr0", "cniVersion": "0.3.1", "plugins": [
        { "type": "flannel", "delegate": { "hairpinMode": true, "isDefaultGateway": true } },
        { "type": "portmap", "capabilities": { "portMappings": true } },
    ]})
}

fn cilium_chaining() -> Value {
    json!({ "name": "generic-veth", "cniVersion": "0.3.1", "plugins": [
        { "type": "ptp", "ipMasq": true, "ipam": { "type": "host-local", "subnet": "10.1.0.0/16" } },
        { "type": "cilium-cni" },
    ]})
}

fn bridge() -> Value {
    json!({ "cniVersion": "1.0.0", "name": "mynet", "type": "bridge",
        "bridge": "cni0", "isGateway": true, "ipMasq": true,
        "ipam": { "type": "host-local", "subnet": "10.22.0.0/16",
                  "routes": [{ "dst": "0.0.0.0/0" }] } })
}

/// Thin Multus's `00-multus.conf`, its cluster network inline, as its entrypoint writes it.
fn multus_thin(cluster: &Value) -> Value {
    json!({ "cniVersion": "0.3.1", "name": "multus-cni-network", "type": "multus",
        "capabilities": { "portMappings": true, "bandwidth": true },
        "kubeconfig": "/etc/cni/net.d/multus.d/multus.kubeconfig",
        "delegates": [cluster] })
}

/// Thick Multus's `00-multus.conflist`: the shim, the daemon reading the cluster network.
fn multus_thick() -> Value {
    json!({ "cniVersion": "0.3.1", "name": "multus-cni-network",
        "plugins": [{ "type": "multus-shim", "logLevel": "verbose", "logToStderr": true }] })
}

fn primaries() -> Vec<Primary> {
    vec![
        Primary {
            shape: "Calico",
            file: "10-calico.conflist",
            network: calico(),
            multus: None,
            chained: &["calico", "bandwidth", "cnibpf"],
            own_file: "10-calico.cnibpf.conflist",
        },
        Primary {
            shape: "flannel",
            file: "10-flannel.conflist",
            network: flannel(),
            multus: None,
            chained: &["flannel", "cnibpf"],
            own_file: "10-flannel.cnibpf.conflist",
        },
        Primary {
            shape: "Cilium chaining",
            file: "05-cilium.conflist",
            network: cilium_chaining(),
            multus: None,
            chained: &["ptp", "cilium-cni", "cnibpf"],
            own_file: "05-cilium.cnibpf.conflist",
        },
        Primary {
            shape: "bridge .conf",
            file: "10-mynet.conf",
            network: bridge(),
            multus: None,
            chained: &["bridge", "cnibpf"],
            own_file: "10-mynet.cnibpf.conflist",
        },
        Primary {
            shape: "Multus thin over Calico",
            file: "10-calico.conflist",
            network: calico(),
            multus: Some(("00-multus.conf", multus_thin(&calico()))),
            chained: &["calico", "bandwidth", "cnibpf"],
            own_file: "10-calico.cnibpf.conflist",
        },
        Primary {
            shape: "Multus thick over flannel",
            file: "10-flannel.conflist",
            network: flannel(),
            multus: Some(("00-multus.conflist", multus_thick())),
            chained: &["flannel", "cnibpf"],
            own_file: "10-flannel.cnibpf.conflist",
        },
    ]
}

/// The network a runtime uses, as libcni finds it: the first of the sorted `.conf`,
/// `.conflist` and `.json` files, which must be whole (a file renamed away between the listing
/// and the read is passed over); `None` when there is none.
fn first_network(conf_dir: &Path) -> Option<(PathBuf, Value)> {
    let mut names: Vec<PathBuf> = std::fs::read_dir(conf_dir)
        .expect("read the conf dir")
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| {
            path.extension().is_some_and(|extension| {
                extension == "conf" || extension == "conflist" || extension == "json"
            })
        })
        .collect();
    names.sort();
    names.into_iter().find_map(|path| {
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return None,
            Err(error) => panic!("read {}: {error}", path.display()),
        };
        let value = serde_json::from_str::<Value>(&text).unwrap_or_else(|error| {
            panic!("{} read half written ({error}):\n{text}", path.display())
        });
        Some((path, value))
    })
}

/// The first network after Multus's own, which Multus's configuration picks as the cluster
/// network.
fn multus_cluster_network(conf_dir: &Path, multus_file: &str) -> Value {
    let mut names: Vec<String> = std::fs::read_dir(conf_dir)
        .expect("read the conf dir")
        .filter_map(Result::ok)
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".conf") || name.ends_with(".conflist"))
        .filter(|name| name != multus_file)
        .collect();
    names.sort();
    let first = names.first().expect("a cluster network");
    let text = std::fs::read_to_string(conf_dir.join(first)).expect("read it");
    serde_json::from_str(&text).expect("it parses")
}

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
            spawned => break spawned.expect("run the old binary"),
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
    terminate(running);
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
    terminate(watcher);
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

/// The iptables state of the simulated host's nat table (`iptables-save`, or the legacy
/// one).
fn nat_rules(sim: &SimHost, save: &str) -> String {
    sim.host.exec(&[save, "-t", "nat"])
}

/// A pod the reference portmap set up before `install --replace-portmap` (its hostPort in
/// portmap's iptables chains) is deleted through cnibpf's entry: cnibpf holds nothing of it
/// and hands the DEL to portmap, which removes its chains — with iptables over nf_tables
/// (Debian's default) and with legacy iptables. A pod cnibpf set up afterwards is deleted by
/// cnibpf, and its repeated DELs (which containerd sends) succeed.
#[test]
fn a_pod_portmap_made_before_the_install_is_deleted_by_portmap_through_cnibpfs_entry() {
    for (iptables, save) in [
        ("iptables-nft", "iptables-nft-save"),
        ("iptables-legacy", "iptables-legacy-save"),
    ] {
        let sim = SimHost::with_reference_portmap(&format!("pmd-{}", &iptables[9..]));
        // portmap runs the `iptables` it finds first on PATH.
        let tools = sim.work_dir.join("iptables");
        std::fs::create_dir_all(&tools).expect("tools dir");
        for (name, target) in [
            ("iptables", iptables),
            ("ip6tables", &iptables.replace("ip", "ip6")),
        ] {
            std::os::unix::fs::symlink(format!("/usr/sbin/{target}"), tools.join(name))
                .expect("link iptables");
        }
        let path = format!(
            "{}:{}",
            tools.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        sim.chain.set_environment(&[("PATH", &path)]);
        let made_by_portmap = sim
            .add_container("old", port_mappings(&[(18090, 80, "tcp")]))
            .unwrap_or_else(|error| panic!("{iptables}: ADD through portmap: {error}"));
        let container_id = made_by_portmap.attachment.container_id.clone();
        let before = nat_rules(&sim, save);
        assert!(
            before.contains(&container_id) && before.contains("CNI-DN-"),
            "{iptables}: portmap's chains of the pod:\n{before}"
        );

        let node = NodeDirs::new(&format!("pmd-{}", &iptables[9..]));
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
        let through_cnibpf = Chain::new(own, &cni_path(), &sim.host.path());
        through_cnibpf.remember(&made_by_portmap.attachment, &made_by_portmap.result);
        let del = |attachment: &Attachment| {
            let cnibpf = &through_cnibpf.conflist()["plugins"][1];
            let config = through_cnibpf.plugin_config(
                cnibpf,
                "1.0.0",
                Some(&made_by_portmap.result),
                &attachment.capability_args,
            );
            let mut process = plugin_command(
                &cni_path(),
                &sim.host.path(),
                "cnibpf",
                "DEL",
                Some(attachment),
            );
            process.env("PATH", &path);
            run_with_stdin(process, "cnibpf", "DEL", &config.to_string())
        };
        let deleted = del(&made_by_portmap.attachment);
        assert_eq!(
            deleted.exit_code, 0,
            "{iptables}: DEL through cnibpf: {deleted:?}"
        );
        let after = nat_rules(&sim, save);
        assert!(
            !after.contains(&container_id),
            "{iptables}: nothing of portmap's for the pod remains:\n{after}"
        );
        let logged = std::fs::read_to_string(sim.call_log()).expect("the call log");
        assert!(
            logged.lines().any(|line| line.contains(&container_id)
                && line.contains("\"DEL\"")
                && line.contains("portmap")),
            "{iptables}: the DEL's log line names portmap:\n{logged}"
        );
        let again = del(&made_by_portmap.attachment);
        assert_eq!(again.exit_code, 0, "{iptables}: a repeated DEL: {again:?}");
        sim.del(&made_by_portmap)
            .unwrap_or_else(|error| panic!("{iptables}: the bridge's DEL: {error}"));
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
    assert!(sim.holds_no_state(), "no datapath left");
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
    assert!(sim.holds_no_state() && !lock.exists());
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
/// a comment, as 5da8470 wrote it) is told so by `install`, in one line, with what to do;
/// the install itself goes on.
#[test]
fn install_says_when_the_nftables_datapath_cannot_be_migrated() {
    let netns = cnibpf_tests::Netns::create("cbt-install-layout1");
    let node = NodeDirs::new("layout1");
    node.write("10-flannel.conflist", &flannel());
    let install = |expect_note: bool| {
        let mut command = netns.command(&[&cnibpf_binary().display().to_string()]);
        command.args(node.args("install", &["--replace-portmap"]));
        let output = command.output().expect("run cnibpf install");
        assert!(output.status.success(), "{output:?}");
        let said = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            said.contains("which no cnibpf migrates") && said.contains("drain the node"),
            expect_note,
            "{said}"
        );
    };
    install(false);
    netns.exec(&["nft", "add", "table", "inet", "cnibpf"]);
    install(true);
}
