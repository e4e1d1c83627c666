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
    process::{Command, Output, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use cnibpf_tests::{
    assertions::assert_uninstalled,
    chain::{Attachment, Chain, plugin_command, run_with_stdin},
    daemon::Daemon,
    eventually,
    topology::{
        Chained, DefaultPaths, SimHost, UPLINK, cnibpf_binary, nftables_state_file, port_mappings,
        remove_instance_files,
    },
};
use serde_json::{Value, json};

mod chaining;
mod lifecycle;

/// A node's CNI conf and bin dirs, removed on drop, and an entry naming a pinPath of the
/// test's own (uninstall removes the datapath of the instance an entry names).
struct NodeDirs {
    root: PathBuf,
    pin_path: PathBuf,
    /// Install's calls may create cnibpf's default directories (`/run/cnibpf`) too.
    _default_paths: DefaultPaths,
}

impl NodeDirs {
    fn new(name: &str) -> Self {
        let default_paths = DefaultPaths::watched();
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
        Self {
            root,
            pin_path,
            _default_paths: default_paths,
        }
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

    fn watch(&self, extra: &[&str]) -> Daemon {
        Command::new(cnibpf_binary())
            .args(self.args("install", extra))
            .arg("--watch")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map(Daemon::from)
            .expect("start cnibpf install --watch")
    }
}

impl Drop for NodeDirs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
        let _ = std::fs::remove_dir_all(&self.pin_path);
        remove_instance_files(&self.pin_path);
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
