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

#[test]
fn version_lists_the_supported_versions() {
    let sim = SimHost::new("proto-version", json!({}));
    for (stdin, expected) in [
        ("", "1.1.0"),
        (r#"{"cniVersion":"0.4.0"}"#, "0.4.0"),
        ("not json", "1.1.0"),
    ] {
        let output = sim.invoke_cnibpf("VERSION", None, stdin);
        assert_eq!(output.exit_code, 0, "{output:?}");
        let answer: Value = serde_json::from_str(&output.stdout).expect("VERSION prints JSON");
        assert_eq!(answer["cniVersion"], expected);
        assert_eq!(
            answer["supportedVersions"],
            json!(["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"])
        );
    }
}

/// `cnibpf --version` says what an operator upgrades from: the release, the commit it was
/// built from (git's HEAD of this checkout), and the layouts of the state it writes.
#[test]
fn the_version_names_the_release_the_commit_and_the_layouts() {
    let output = std::process::Command::new(cnibpf_tests::topology::cnibpf_binary())
        .arg("--version")
        .env_remove("CNI_COMMAND")
        .output()
        .expect("run cnibpf --version");
    assert!(output.status.success(), "{output:?}");
    let version = String::from_utf8_lossy(&output.stdout);
    let head = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run git");
    assert!(head.status.success(), "git rev-parse: {head:?}");
    let head = String::from_utf8_lossy(&head.stdout).trim().to_owned();
    let expected = format!(
        "cnibpf {} (commit {head}; eBPF state layout {}, nftables cnibpf layout ",
        env!("CARGO_PKG_VERSION"),
        cnibpf_common::layout::VERSION
    );
    assert!(
        version.starts_with(&expected),
        "{version:?} starts with {expected:?}"
    );
}

#[test]
fn add_returns_prev_result_in_the_requested_version() {
    for version in ["0.3.1", "0.4.0", "1.0.0"] {
        let id = format!("proto-v{}", version.replace('.', ""));
        let sim = SimHost::with_version(&id, version, json!({}));
        let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
        assert_eq!(c1.result["cniVersion"], version);
        let ips = c1.result["ips"].as_array().expect("ips");
        for ip in ips {
            if version == "1.0.0" {
                assert!(
                    ip.get("version").is_none(),
                    "1.0.0 results carry no ips[].version: {ip}"
                );
            } else {
                let family = if ip["address"].as_str().unwrap_or_default().contains(':') {
                    "6"
                } else {
                    "4"
                };
                assert_eq!(
                    ip["version"], family,
                    "{version} results carry ips[].version: {ip}"
                );
            }
        }
        if version != "0.3.1" {
            sim.check(&c1)
                .unwrap_or_else(|error| panic!("CHECK at {version}: {error}"));
        }
    }

    // 1.1.0 (which the reference bridge does not speak) and a downgrade to 0.4.0, cnibpf alone.
    let sim = SimHost::new("proto-v110", json!({}));
    let c1 = sim.container("c1", json!({}));
    for (version, has_ip_version) in [("1.1.0", false), ("0.4.0", true)] {
        let config = cnibpf_config(&sim, version, Some(&c1.result));
        let output = invoke(&sim, "ADD", Some(&c1.attachment), &config);
        assert_eq!(output.exit_code, 0, "{output:?}");
        let result: Value =
            serde_json::from_str(&output.stdout).expect("ADD prints exactly one JSON result");
        assert_eq!(result["cniVersion"], version);
        assert_eq!(
            result["interfaces"], c1.result["interfaces"],
            "interfaces pass through unchanged"
        );
        assert_eq!(
            result["ips"][0].get("version").is_some(),
            has_ip_version,
            "{result}"
        );
    }
}

#[test]
fn add_without_prev_result_is_error_7() {
    let sim = SimHost::new("proto-noprev", json!({}));
    let c1 = sim.container("c1", json!({}));
    let output = invoke(
        &sim,
        "ADD",
        Some(&c1.attachment),
        &cnibpf_config(&sim, "1.0.0", None),
    );
    assert_cni_error(&output, 7, "chained plugin");
}

#[test]
fn missing_or_invalid_environment_is_error_4_naming_the_variable() {
    let sim = SimHost::new("proto-env", json!({}));
    let c1 = sim.container("c1", json!({}));
    let config = cnibpf_config(&sim, "1.0.0", Some(&c1.result)).to_string();
    let state_before = sim.inspect();
    let run = |command: &str, change: &dyn Fn(&mut std::process::Command)| {
        let mut process = chain::plugin_command(
            &cni_path(),
            &sim.host.path(),
            "cnibpf",
            command,
            Some(&c1.attachment),
        );
        change(&mut process);
        run_with_stdin(process, "cnibpf", command, &config)
    };
    for (command, variable) in [
        ("ADD", "CNI_CONTAINERID"),
        ("ADD", "CNI_IFNAME"),
        ("ADD", "CNI_NETNS"),
        ("ADD", "CNI_PATH"),
        ("CHECK", "CNI_NETNS"),
        ("DEL", "CNI_CONTAINERID"),
        ("DEL", "CNI_IFNAME"),
    ] {
        let output = run(command, &|process| {
            process.env_remove(variable);
        });
        assert_cni_error(&output, 4, &format!("{variable} is not set"));
    }
    let cases: [(&str, &str, &str); 7] = [
        ("CNI_ARGS", "FOO=bar", "CNI_ARGS: unknown args [\"FOO\"]"),
        (
            "CNI_ARGS",
            "K8S_POD_NAME",
            "CNI_ARGS: invalid pair \"K8S_POD_NAME\"",
        ),
        (
            "CNI_ARGS",
            "IgnoreUnknown=maybe;FOO=bar",
            "IgnoreUnknown=\"maybe\"",
        ),
        (
            "CNI_CONTAINERID",
            "-starts-with-dash",
            "CNI_CONTAINERID \"-starts-with-dash\" is invalid",
        ),
        ("CNI_IFNAME", "eth0/1", "CNI_IFNAME \"eth0/1\""),
        (
            "CNI_IFNAME",
            "a-name-longer-than-15",
            "longer than 15 bytes",
        ),
        ("CNI_NETNS", "/run/netns/does-not-exist", "does not exist"),
    ];
    for (variable, value, fragment) in cases {
        let output = run("ADD", &|process| {
            process.env(variable, value);
        });
        assert_cni_error(&output, 4, fragment);
    }
    let output = run("ADDD", &|_| {});
    assert_cni_error(&output, 4, "unknown CNI_COMMAND \"ADDD\"");
    assert_eq!(
        sim.inspect(),
        state_before,
        "no bad invocation may change state"
    );
    let output = run("DEL", &|process| {
        process.env("CNI_ARGS", "FOO=bar");
    });
    assert_eq!(
        output.exit_code, 0,
        "DEL does not judge the arguments an ADD would have refused: {output:?}"
    );
}

#[test]
fn verbs_check_their_minimum_version() {
    let sim = SimHost::new("proto-minver", json!({}));
    let c1 = sim.container("c1", json!({}));
    let output = invoke(
        &sim,
        "CHECK",
        Some(&c1.attachment),
        &cnibpf_config(&sim, "0.3.1", Some(&c1.result)),
    );
    assert_cni_error(&output, 1, "CHECK needs cniVersion 0.4.0");
    let output = invoke(&sim, "GC", None, &cnibpf_config(&sim, "1.0.0", None));
    assert_cni_error(&output, 1, "GC needs cniVersion 1.1.0");
    let output = invoke(&sim, "STATUS", None, &cnibpf_config(&sim, "1.0.0", None));
    assert_cni_error(&output, 1, "STATUS needs cniVersion 1.1.0");
    let output = invoke(&sim, "GC", None, &cnibpf_config(&sim, "1.1.0", None));
    assert_cni_error(&output, 7, "cni.dev/valid-attachments: is required for GC");
    let mut unsupported = cnibpf_config(&sim, "1.0.0", Some(&c1.result));
    unsupported["cniVersion"] = json!("0.2.0");
    assert_cni_error(
        &invoke(&sim, "ADD", Some(&c1.attachment), &unsupported),
        1,
        "unsupported cniVersion \"0.2.0\"",
    );
    assert_cni_error(
        &invoke(&sim, "DEL", Some(&c1.attachment), &unsupported),
        1,
        "unsupported cniVersion",
    );
}

#[test]
fn status_answers_ready_and_gc_succeeds_silently() {
    let sim = SimHost::new("proto-status", json!({}));
    assert_silent_success(&invoke(
        &sim,
        "STATUS",
        None,
        &cnibpf_config(&sim, "1.1.0", None),
    ));
    sim.chain
        .status()
        .unwrap_or_else(|error| panic!("chain STATUS: {error}"));
    let mut gc = cnibpf_config(&sim, "1.1.0", None);
    gc["cni.dev/valid-attachments"] = json!([]);
    assert_silent_success(&invoke(&sim, "GC", None, &gc));
}

#[test]
fn without_bpf_auto_serves_with_nftables_and_a_forced_ebpf_backend_is_104() {
    for errno in [libc::EPERM, libc::ENOSYS] {
        let mut sim = SimHost::new(
            &format!("proto-nobpf{errno}"),
            json!({ "capabilities": { "portMappings": true } }),
        );
        sim.chain.deny_bpf_to_cnibpf(errno);
        let status = |path: &str| {
            let mut status =
                chain::plugin_command(&cni_path(), &sim.host.path(), "cnibpf", "STATUS", None);
            status.env("PATH", path);
            deny_bpf_syscall(&mut status, errno);
            run_with_stdin(
                status,
                "cnibpf",
                "STATUS",
                &cnibpf_config(&sim, "1.1.0", None).to_string(),
            )
        };
        assert_silent_success(&status(&std::env::var("PATH").unwrap_or_default()));
        // Without `nft` either, nothing can work.
        assert_cni_error(
            &status("/nonexistent"),
            50,
            "no backend can work on this host",
        );

        let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
        let _server = TcpServer::start(&c1.netns, Family::V4.any(80), "served by nftables");
        assert_eq!(
            tcp_request(&sim.outside, sim.uplink(Family::V4, 8080)).as_deref(),
            Ok("served by nftables"),
            "auto without BPF: the hostPort works through nftables"
        );
        let inspect = sim.inspect();
        assert_eq!(
            inspect["attachments"][0]["backend"], "nftables",
            "{inspect:#}"
        );
        assert!(!sim.pin_path.exists(), "no eBPF state was made");

        let mut config = cnibpf_config(&sim, "1.0.0", Some(&c1.result));
        config["backend"] = json!("ebpf");
        let mut add = chain::plugin_command(
            &cni_path(),
            &sim.host.path(),
            "cnibpf",
            "ADD",
            Some(&c1.attachment),
        );
        deny_bpf_syscall(&mut add, errno);
        let output = run_with_stdin(add, "cnibpf", "ADD", &config.to_string());
        assert_cni_error(&output, 104, "backend ebpf cannot work on this host");

        sim.del(&c1).unwrap_or_else(|error| panic!("DEL: {error}"));
        assert!(
            !sim.host.exec(&["nft", "list", "tables"]).contains("cnibpf"),
            "DEL of the last attachment removes the table"
        );
    }
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
                sim.cnibpf(&[
                    "install",
                    "--conf-dir",
                    &conf_dir.display().to_string(),
                    "--bin-dir",
                    &bin_dir.display().to_string(),
                    "--entry",
                    &entry.display().to_string(),
                    "--load",
                ])
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
fn an_owner_too_long_for_an_nftables_comment_is_refused() {
    let sim = SimHost::new("proto-long", json!({ "backend": "nftables" }));
    let c1 = sim.container("c1", json!({}));
    let mut long = c1.attachment.clone();
    long.container_id = "x".repeat(120);
    let config = cnibpf_config(&sim, "1.0.0", Some(&c1.result));
    let output = invoke(&sim, "ADD", Some(&long), &config);
    assert_cni_error(&output, 102, "too long for the nftables backend");
    assert!(
        !sim.nft_ruleset().contains(&long.container_id),
        "nothing of the refused attachment is in the table"
    );
}

#[test]
fn a_re_add_on_the_other_backend_moves_the_attachment_and_check_follows_it() {
    let sim = SimHost::new(
        "proto-move",
        json!({ "capabilities": { "portMappings": true } }),
    );
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let c2 = sim.container("c2", port_mappings(&[(8081, 80, "tcp")]));
    sim.readd_with(&c2, json!({ "backend": "nftables" }))
        .unwrap_or_else(|error| panic!("re-ADD on nftables: {error}"));
    let inspect = sim.inspect();
    let backends: Vec<(String, String)> = inspect["attachments"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|attachment| {
            (
                attachment["containerID"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                attachment["backend"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            )
        })
        .collect();
    assert_eq!(
        backends,
        [
            (c1.attachment.container_id.clone(), "ebpf".to_owned()),
            (c2.attachment.container_id.clone(), "nftables".to_owned()),
        ],
        "c2 moved to nftables, listed once: {inspect:#}"
    );
    for (container, port) in [(&c1, 8080), (&c2, 8081)] {
        let _server = TcpServer::start(&container.netns, Family::V4.any(80), "served");
        assert_eq!(
            tcp_request(&sim.outside, sim.uplink(Family::V4, port)).as_deref(),
            Ok("served"),
            "hostPort {port}"
        );
        sim.check(container)
            .unwrap_or_else(|error| panic!("CHECK finds the serving backend: {error}"));
    }
}

#[test]
fn del_cleans_up_what_the_other_backend_made() {
    let sim = SimHost::new(
        "proto-cross",
        json!({ "backend": "nftables", "capabilities": { "portMappings": true } }),
    );
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let mut config = cnibpf_config(&sim, "1.0.0", None);
    config["backend"] = json!("ebpf");
    let del = invoke(&sim, "DEL", Some(&c1.attachment), &config);
    assert_silent_success(&del);
    assert!(
        !sim.host.exec(&["nft", "list", "tables"]).contains("cnibpf"),
        "a DEL configured for eBPF removes the nftables attachment"
    );
    let ebpf = SimHost::new(
        "proto-cross2",
        json!({ "capabilities": { "portMappings": true } }),
    );
    let c2 = ebpf.container("c2", port_mappings(&[(8080, 80, "tcp")]));
    let mut config = cnibpf_config(&ebpf, "1.0.0", None);
    config["backend"] = json!("nftables");
    assert_silent_success(&invoke(&ebpf, "DEL", Some(&c2.attachment), &config));
    assert!(
        !ebpf.pin_path.exists(),
        "a DEL configured for nftables removes the eBPF state"
    );
}

#[test]
fn lock_held_too_long_is_error_11() {
    let sim = SimHost::new("proto-lock", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let lock_path = sim.lock_file();
    let lock = File::open(&lock_path)
        .unwrap_or_else(|error| panic!("open {}: {error}", lock_path.display()));
    let lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
        .unwrap_or_else(|(_, error)| panic!("take the lock: {error}"));

    let mut add = chain::plugin_command(
        &cni_path(),
        &sim.host.path(),
        "cnibpf",
        "ADD",
        Some(&c1.attachment),
    );
    add.env("CNIBPF_LOCK_TIMEOUT_MS", "300");
    let config = cnibpf_config(&sim, "1.0.0", Some(&c1.result));
    let output = run_with_stdin(add, "cnibpf", "ADD", &config.to_string());
    assert_cni_error(&output, 11, "timed out after 300ms waiting for lock");

    drop(lock);
    let output = invoke(&sim, "ADD", Some(&c1.attachment), &config);
    assert_eq!(
        output.exit_code, 0,
        "with the lock free the same ADD works: {output:?}"
    );
}

#[test]
fn an_uplink_that_does_not_exist_is_error_103() {
    let sim = SimHost::new("proto-uplink", json!({ "uplinks": ["nosuch0"] }));
    let error = sim
        .add_container("c1", port_mappings(&[(8080, 80, "tcp")]))
        .expect_err("an unknown uplink must fail the ADD");
    assert_cni_error(&error.0, 103, "no interface named \"nosuch0\"");
    assert!(!sim.pin_path.exists());
    assert!(sim.tcx_programs(UPLINK).is_empty());
}

/// Creates a `layout` map under the host's pinPath holding `magic` and `version`, as another
/// build (or another program) could have left it.
fn pin_layout(sim: &SimHost, magic: [u8; 8], version: u32) {
    std::fs::create_dir_all(&sim.pin_path).expect("pin dir");
    let layout = sim.pin_path.join("layout");
    let layout = layout.to_str().expect("utf-8 path");
    cnibpf_tests::netns::run_checked(std::process::Command::new("bpftool").args([
        "map", "create", layout, "type", "array", "key", "4", "value", "24", "entries", "1",
        "name", "layout",
    ]));
    // magic, layout version, padding, object id.
    let mut value = magic.to_vec();
    value.extend(version.to_le_bytes());
    value.extend([0; 12]);
    sim.write_layout(&value);
}

#[test]
fn pinned_state_of_a_newer_layout_is_error_106_for_add_only() {
    let sim = SimHost::new("proto-layout", json!({}));
    pin_layout(&sim, *b"cnibpf\0\0", 99);
    let error = sim
        .add_container("c1", port_mappings(&[(8080, 80, "tcp")]))
        .expect_err("a newer layout must be refused");
    assert_cni_error(
        &error.0,
        106,
        "has layout v99, written by a newer cnibpf (this one writes v",
    );
    assert!(
        !error.0.error_msg().contains("delete"),
        "no advice to delete state pods use: {error}"
    );
    assert!(
        sim.tcx_programs(UPLINK).is_empty(),
        "nothing may be attached over state of another layout"
    );
    // DEL of something it never held answers success, as a runtime retrying it needs.
    let never = Attachment {
        container_id: "never-added".to_owned(),
        ifname: "eth0".to_owned(),
        netns: sim.host.path(),
        capability_args: Value::Null,
        cni_args: String::new(),
    };
    let config = cnibpf_config(&sim, "1.0.0", None);
    assert_silent_success(&invoke(&sim, "DEL", Some(&never), &config));
}

#[test]
fn a_pin_path_holding_something_else_is_error_106_naming_it() {
    let sim = SimHost::new("proto-foreign", json!({}));
    pin_layout(&sim, *b"someone!", 1);
    let error = sim
        .add_container("c1", port_mappings(&[(8080, 80, "tcp")]))
        .expect_err("foreign state must be refused");
    assert_cni_error(&error.0, 106, "holds no cnibpf state");
    assert!(
        error.0.error_msg().contains("choose another pinPath"),
        "{error}"
    );
    assert!(
        sim.pin_path.join("layout").exists(),
        "foreign state is left alone"
    );
}

#[test]
fn inspect_without_root_names_the_missing_privilege() {
    let sim = SimHost::new("proto-noroot", json!({}));
    let _c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let output = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(cnibpf_tests::topology::cnibpf_binary())
        .args(["inspect", "--pin-path", &sim.pin_path.display().to_string()])
        .output()
        .expect("run cnibpf inspect as nobody");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{output:?}");
    assert!(
        stderr.contains("permission denied: run as root"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("delete"),
        "no advice to delete state pods use: {stderr}"
    );
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

#[test]
fn a_pin_path_outside_bpffs_is_error_102() {
    let dir = std::env::temp_dir().join("cnibpf-test-not-bpffs");
    let _ = std::fs::remove_dir_all(&dir);
    let sim = SimHost::new("proto-notbpffs", json!({ "pinPath": dir }));
    let error = sim
        .add_container("c1", port_mappings(&[(8080, 80, "tcp")]))
        .expect_err("a pinPath on tmpfs cannot hold pins");
    assert_cni_error(&error.0, 102, "could not prepare bpffs directory");
    assert!(!dir.exists(), "a wrong pinPath must not be created");
    let inspect = sim.cnibpf(&[
        "inspect",
        "--json",
        "--pin-path",
        &dir.display().to_string(),
    ]);
    let inspect: Value = serde_json::from_slice(&inspect.stdout).expect("inspect prints JSON");
    for file in ["lockFile", "callStatsFile"] {
        if let Some(path) = inspect[file].as_str() {
            let _ = std::fs::remove_file(path);
        }
    }
    assert!(sim.tcx_programs(UPLINK).is_empty());
    let _ = std::fs::remove_dir_all(&dir);
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
