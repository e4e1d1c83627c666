//! Versions and the protocol's basics: VERSION, prevResult in the requested version, the
//! environment, each verb's minimum version, STATUS and GC.

use super::*;

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
        cnibpf_common::datapath::layout::stamped()
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

/// CRI-O with cniVersion 1.1.0 calls GC at start-up, and sends the list of valid attachments
/// as null when it has no pods: the reference plugins take that for an empty list, and so does
/// cnibpf — every attachment of the network goes. A list left out is still refused (above).
#[test]
fn gc_takes_a_null_list_of_valid_attachments_for_an_empty_one() {
    let sim = SimHost::new("proto-gcnull", json!({}));
    let _c1 = sim.container("c1", json!({}));
    let mut gc = cnibpf_config(&sim, "1.1.0", None);
    gc["cni.dev/valid-attachments"] = Value::Null;
    assert_silent_success(&invoke(&sim, "GC", None, &gc));
    assert!(
        sim.holds_no_state(),
        "GC with a null list removed the network's only attachment"
    );
}
