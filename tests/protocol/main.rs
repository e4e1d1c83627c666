//! The CNI protocol: verbs, versions, result conversion, environment and every error code.

use std::fs::File;

use cnibpf_tests::{
    PluginOutput, SimHost,
    assertions::{assert_cni_error, assert_silent_success},
    chain::{self, Attachment, deny_bpf_syscall, run_with_stdin},
    topology::{Backend, Family, UPLINK, cni_path, port_mappings},
    traffic::{TcpServer, tcp_request},
};
use serde_json::{Value, json};

mod backends;
mod calls;
mod errors;
mod versions;

/// cnibpf's own entry of the host's conflist, as a complete network configuration.
fn cnibpf_config(sim: &SimHost, version: &str, prev_result: Option<&Value>) -> Value {
    let plugin = sim.chain.conflist()["plugins"][1].clone();
    sim.chain
        .plugin_config(&plugin, version, prev_result, &Value::Null)
}

fn invoke(
    sim: &SimHost,
    command: &str,
    attachment: Option<&Attachment>,
    config: &Value,
) -> PluginOutput {
    sim.invoke_cnibpf(command, attachment, &config.to_string())
}

/// `CNIBPF_PHASES=1` (what `cargo xtask bench portmap` sets) makes the plugin say on stderr
/// where its time went; stdout stays the CNI answer, and without the variable nothing is said.
#[test]
fn phases_are_reported_on_stderr_only_when_asked() {
    let sim = SimHost::new("proto-phases", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let config = cnibpf_config(&sim, "1.0.0", Some(&c1.result));
    let run = |command: &str, phases: bool| {
        let mut process = chain::plugin_command(
            &cni_path(),
            &sim.host.path(),
            "cnibpf",
            command,
            Some(&c1.attachment),
        );
        if phases {
            process.env("CNIBPF_PHASES", "1");
        }
        run_with_stdin(process, "cnibpf", command, &config.to_string())
    };
    let quiet = run("ADD", false);
    assert_eq!(quiet.exit_code, 0, "{quiet:?}");
    assert!(!quiet.stderr.contains("phases"), "{quiet:?}");
    let added = run("ADD", true);
    assert_eq!(added.exit_code, 0, "{added:?}");
    serde_json::from_str::<Value>(&added.stdout)
        .unwrap_or_else(|error| panic!("stdout is the result alone ({error}): {added:?}"));
    let line = added
        .stderr
        .lines()
        .find(|line| line.starts_with("cnibpf: ADD phases (ms): "))
        .unwrap_or_else(|| panic!("no phase report: {added:?}"));
    for phase in [
        "decode",
        "plan",
        "lock",
        "backend",
        "endpoint",
        "port mappings",
        "total",
    ] {
        assert!(line.contains(&format!("{phase} ")), "{phase} in {line}");
    }
    let deleted = run("DEL", true);
    assert_eq!(deleted.exit_code, 0, "{deleted:?}");
    assert!(
        deleted.stderr.contains("cnibpf: DEL phases (ms): decode "),
        "{deleted:?}"
    );
}

/// The datapath loaded ahead of the first pod, by `cnibpf load` or by `cnibpf install --load`
/// (the DaemonSet's way, reading the entry's pinPath): the first ADD then loads nothing — the
/// programs it runs are the ones loaded before it — and the pod is served. A second load finds
/// everything in place and replaces nothing.
#[test]
fn a_datapath_loaded_ahead_serves_the_first_pod_without_loading_again() {
    for install in [false, true] {
        let id = if install {
            "proto-preinst"
        } else {
            "proto-preload"
        };
        let sim = SimHost::new(id, json!({ "backend": "ebpf" }));
        let pin_path = sim.pin_path.display().to_string();
        let program = sim.pin_path.join("programs").join("from_container");
        let node =
            NodeDir(std::env::temp_dir().join(format!("cnibpf-{id}-{}", std::process::id())));
        let node = &node.0;
        let load = || {
            let output = if install {
                let conf_dir = node.join("net.d");
                let bin_dir = node.join("bin");
                for dir in [&conf_dir, &bin_dir] {
                    std::fs::create_dir_all(dir).expect("node dirs");
                }
                std::fs::write(
                    conf_dir.join("10-bridge.conflist"),
                    json!({ "cniVersion": "1.0.0", "name": "pods",
                            "plugins": [{ "type": "bridge", "bridge": "cni9" }] })
                    .to_string(),
                )
                .expect("write the primary");
                let entry = node.join("entry.json");
                std::fs::write(
                    &entry,
                    json!({ "backend": "ebpf", "pinPath": pin_path }).to_string(),
                )
                .expect("write the entry");
                sim.install(&conf_dir, &bin_dir, &entry, "--load")
            } else {
                sim.cnibpf(&["load", "--pin-path", &pin_path, "--backend", "ebpf"])
            };
            assert!(output.status.success(), "{id}: {output:?}");
            assert!(
                String::from_utf8_lossy(&output.stdout).contains("eBPF datapath loaded and pinned"),
                "{id}: {output:?}"
            );
        };
        assert!(!program.exists(), "{id}: nothing loaded before");
        load();
        let loaded = sim.pinned_program_id("from_container");
        let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
        assert_eq!(
            sim.pinned_program_id("from_container"),
            loaded,
            "{id}: the first ADD runs the programs loaded ahead"
        );
        let _server = TcpServer::start(&c1.netns, Family::V4.any(80), "served");
        assert_eq!(
            tcp_request(&sim.outside, sim.uplink(Family::V4, 8080)).as_deref(),
            Ok("served"),
            "{id}: the first pod's hostPort"
        );
        load();
        assert_eq!(
            sim.pinned_program_id("from_container"),
            loaded,
            "{id}: loaded once"
        );
    }
}

/// A node's CNI directories for `install`, removed on drop.
struct NodeDir(std::path::PathBuf);

impl Drop for NodeDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn del_ignores_the_rest_of_its_config() {
    let sim = SimHost::new("proto-delconf", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let mut config = cnibpf_config(&sim, "1.0.0", Some(&c1.result));
    config["ipMasq"] = json!("not a boolean");
    config["filter"] = json!("not rules");
    assert_silent_success(&invoke(&sim, "DEL", Some(&c1.attachment), &config));
    assert!(
        sim.installed_host_ports().is_empty(),
        "DEL removed the mapping"
    );
}

/// The eBPF datapath hands translated traffic past the host's own firewall chains: inspect
/// names those that hold rules. The nftables backend keeps that traffic in the stack, so there
/// is nothing to say about it.
#[test]
fn inspect_names_the_host_firewall_chains_the_ebpf_datapath_passes_by() {
    for backend in [Backend::Ebpf, Backend::Nftables] {
        let host = SimHost::on(backend, "fwnote", json!({}));
        let _container = host.container("c1", port_mappings(&[(8080, 80, "tcp")]));
        let bypassed = |host: &SimHost| host.inspect()["bypassedHostChains"].clone();
        assert_eq!(
            bypassed(&host),
            json!([]),
            "{backend:?}: no rules of the host yet"
        );
        host.host.exec(&[
            "iptables",
            "-I",
            "FORWARD",
            "-s",
            "203.0.113.9",
            "-j",
            "DROP",
        ]);
        let pin_path = host.pin_path.display().to_string();
        let text = host.cnibpf(&["inspect", "--pin-path", &pin_path]);
        let text = String::from_utf8_lossy(&text.stdout);
        match backend {
            Backend::Ebpf => {
                assert_eq!(
                    bypassed(&host),
                    json!([{ "family": "ip", "table": "filter", "chain": "FORWARD",
                             "hook": "forward", "rules": 1 }])
                );
                assert!(
                    text.contains(
                        "the host's firewall chains ip filter FORWARD (1 rule) do not see"
                    ),
                    "{text}"
                );
            }
            Backend::Nftables => {
                assert_eq!(bypassed(&host), json!([]), "nftables keeps the stack");
                assert!(!text.contains("firewall chains"), "{text}");
            }
        }
    }
}
