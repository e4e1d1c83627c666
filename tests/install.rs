//! `cnibpf install` and `cnibpf uninstall` against a node's CNI directories (temporary ones):
//! the primary networks of Calico, flannel, Cilium in chaining mode and the bridge plugin, as
//! they ship them; re-installs, an upgrade while the old binary runs, `--watch` after the
//! primary rewrites or replaces its file, readers that never see half a file, and uninstall
//! restoring what was there.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use cnibpf_tests::{eventually, topology::cnibpf_binary};
use serde_json::{Value, json};

/// A node's CNI conf and bin dirs, removed on drop.
struct NodeDirs {
    root: PathBuf,
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
        Self { root }
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

    fn args(&self, command: &str) -> Vec<String> {
        vec![
            command.to_owned(),
            "--conf-dir".to_owned(),
            self.conf_dir().display().to_string(),
            "--bin-dir".to_owned(),
            self.bin_dir().display().to_string(),
        ]
    }

    /// `cnibpf install` (or `uninstall`) with `extra` arguments, run by `binary`.
    fn run_with(&self, binary: &Path, command: &str, extra: &[&str]) -> Output {
        Command::new(binary)
            .args(self.args(command))
            .args(extra)
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
            .args(self.args("install"))
            .arg("--watch")
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start cnibpf install --watch")
    }
}

impl Drop for NodeDirs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
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
    file: &'static str,
    network: Value,
    /// Plugin types after the install.
    chained: &'static [&'static str],
    /// The file holding the chain after the install.
    chained_file: &'static str,
}

fn primaries() -> Vec<Primary> {
    vec![
        Primary {
            shape: "Calico",
            file: "10-calico.conflist",
            network: json!({ "name": "k8s-pod-network", "cniVersion": "0.3.1", "plugins": [
                { "type": "calico", "log_level": "info", "datastore_type": "kubernetes",
                  "mtu": 1440, "ipam": { "type": "calico-ipam" },
                  "policy": { "type": "k8s" }, "kubernetes": { "kubeconfig": "/etc/cni/net.d/calico-kubeconfig" } },
                { "type": "bandwidth", "capabilities": { "bandwidth": true } },
                { "type": "portmap", "snat": true, "capabilities": { "portMappings": true } },
            ]}),
            chained: &["calico", "bandwidth", "cnibpf"],
            chained_file: "10-calico.conflist",
        },
        Primary {
            shape: "flannel",
            file: "10-flannel.conflist",
            network: json!({ "name": "cbr0", "cniVersion": "0.3.1", "plugins": [
                { "type": "flannel", "delegate": { "hairpinMode": true, "isDefaultGateway": true } },
                { "type": "portmap", "capabilities": { "portMappings": true } },
            ]}),
            chained: &["flannel", "cnibpf"],
            chained_file: "10-flannel.conflist",
        },
        Primary {
            shape: "Cilium chaining",
            file: "05-cilium.conflist",
            network: json!({ "name": "generic-veth", "cniVersion": "0.3.1", "plugins": [
                { "type": "ptp", "ipMasq": true, "ipam": { "type": "host-local", "subnet": "10.1.0.0/16" } },
                { "type": "cilium-cni" },
            ]}),
            chained: &["ptp", "cilium-cni", "cnibpf"],
            chained_file: "05-cilium.conflist",
        },
        Primary {
            shape: "bridge .conf",
            file: "10-mynet.conf",
            network: json!({ "cniVersion": "1.0.0", "name": "mynet", "type": "bridge",
                "bridge": "cni0", "isGateway": true, "ipMasq": true,
                "ipam": { "type": "host-local", "subnet": "10.22.0.0/16",
                          "routes": [{ "dst": "0.0.0.0/0" }] } }),
            chained: &["bridge", "cnibpf"],
            chained_file: "10-mynet.conflist",
        },
    ]
}

#[test]
fn every_primary_shape_is_chained_once_and_restored_by_uninstall() {
    let entry_dir = NodeDirs::new("entry");
    let entry = entry_dir.root.join("entry.json");
    std::fs::write(&entry, r#"{ "ipMasq": false, "backend": "auto" }"#).expect("entry");
    let entry = entry.display().to_string();
    for primary in primaries() {
        let node = NodeDirs::new("shapes");
        node.write(primary.file, &primary.network);
        // A network the runtime does not use: it sorts after the primary.
        let other =
            json!({ "name": "other", "cniVersion": "1.0.0", "plugins": [{ "type": "loopback" }] });
        node.write("99-other.conflist", &other);
        let has_portmap = types(&primary.network).iter().any(|kind| kind == "portmap");
        if has_portmap {
            let refused = node.run("install", &["--entry", &entry]);
            let message = String::from_utf8_lossy(&refused.stderr);
            assert!(
                !refused.status.success() && message.contains("--replace-portmap"),
                "{}: a chain with portmap is refused: {refused:?}",
                primary.shape
            );
            assert_eq!(
                node.read(primary.file),
                primary.network,
                "{}: untouched",
                primary.shape
            );
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
        let chained = node.read(primary.chained_file);
        assert_eq!(
            types(&chained),
            primary.chained,
            "{}: {chained:#}",
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
        if primary.file != primary.chained_file {
            assert!(
                !node.conf_dir().join(primary.file).exists(),
                "the .conf became the .conflist"
            );
        }
        assert_eq!(
            node.read("99-other.conflist"),
            other,
            "the other network is untouched"
        );
        eprintln!(
            "{} ({}) before:\n{:#}\nafter install ({}):\n{chained:#}",
            primary.shape, primary.file, primary.network, primary.chained_file
        );

        // Again: nothing changes, not even the file's time.
        let written = std::fs::metadata(node.conf_dir().join(primary.chained_file))
            .and_then(|metadata| metadata.modified())
            .expect("mtime");
        let again = node.succeed("install", flags);
        assert!(
            again.trim().is_empty(),
            "a re-install writes nothing: {again}"
        );
        let unchanged = std::fs::metadata(node.conf_dir().join(primary.chained_file))
            .and_then(|metadata| metadata.modified())
            .expect("mtime");
        assert_eq!(written, unchanged, "{}", primary.shape);

        node.succeed("uninstall", &[]);
        assert_eq!(
            node.read(primary.file),
            primary.network,
            "{}: restored",
            primary.shape
        );
        assert_eq!(
            node.files(),
            {
                let mut files = vec![primary.file.to_owned(), "99-other.conflist".to_owned()];
                files.sort();
                files
            },
            "{}: nothing left behind",
            primary.shape
        );
        assert!(
            !node.bin_dir().join("cnibpf").exists(),
            "{}: binary removed",
            primary.shape
        );
    }
}

#[test]
fn an_upgrade_replaces_the_binary_while_the_old_one_runs() {
    let node = NodeDirs::new("upgrade");
    node.write("10-flannel.conflist", &primaries()[1].network);
    // The "old release": the same program with a byte more, running from the bin dir.
    let old = node.bin_dir().join("cnibpf");
    let mut content = std::fs::read(cnibpf_binary()).expect("cnibpf");
    content.push(0);
    std::fs::write(&old, &content).expect("the old binary");
    std::fs::set_permissions(&old, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let running = Command::new(&old)
        .args(node.args("install"))
        .args(["--watch", "--replace-portmap"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("run the old binary");
    assert!(
        eventually(Duration::from_secs(5), || types(
            &node.read("10-flannel.conflist")
        ) == ["flannel", "cnibpf"]),
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

#[test]
fn watch_chains_again_after_the_primary_rewrites_or_replaces_its_file() {
    let node = NodeDirs::new("watch");
    let calico = primaries()[0].network.clone();
    node.write("10-calico.conflist", &calico);
    let watcher = node.watch(&["--replace-portmap"]);
    let chained_once = |node: &NodeDirs, file: &str| {
        let conflist = node.read(file);
        types(&conflist) == ["calico", "bandwidth", "cnibpf"]
    };
    assert!(
        eventually(Duration::from_secs(5), || chained_once(
            &node,
            "10-calico.conflist"
        )),
        "chained at start"
    );
    // The primary writes its file again in place, as calico's install-cni does.
    std::fs::write(
        node.conf_dir().join("10-calico.conflist"),
        serde_json::to_string_pretty(&calico).expect("JSON"),
    )
    .expect("rewrite in place");
    assert!(
        eventually(Duration::from_secs(5), || chained_once(
            &node,
            "10-calico.conflist"
        )),
        "chained again after an in-place rewrite: {:#}",
        node.read("10-calico.conflist")
    );
    // ... and by renaming a new file over it.
    let staged = node.conf_dir().join("calico.tmp");
    std::fs::write(
        &staged,
        serde_json::to_string_pretty(&calico).expect("JSON"),
    )
    .expect("stage");
    std::fs::rename(&staged, node.conf_dir().join("10-calico.conflist")).expect("rename");
    assert!(
        eventually(Duration::from_secs(5), || chained_once(
            &node,
            "10-calico.conflist"
        )),
        "chained again after a rename"
    );
    // A new primary that sorts first takes over: the runtime will use it.
    node.write("05-cilium.conflist", &primaries()[2].network);
    assert!(
        eventually(Duration::from_secs(5), || types(
            &node.read("05-cilium.conflist")
        ) == [
            "ptp",
            "cilium-cni",
            "cnibpf"
        ]),
        "the new first network is chained"
    );
    terminate(watcher);
}

#[test]
fn readers_never_see_half_a_file_and_always_find_a_network() {
    let node = NodeDirs::new("readers");
    node.write("10-mynet.conf", &primaries()[3].network);
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
    assert_eq!(node.read("10-mynet.conf"), primaries()[3].network);
}
