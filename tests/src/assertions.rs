//! Assertions on what a plugin invocation printed, and on what is left of cnibpf on a node.

use std::path::Path;

use serde_json::Value;

use crate::{PluginOutput, SimHost, observe::call_log, topology};

/// The invocation failed with CNI error `code` whose message contains `fragment`, printed as
/// the spec's error object (and only that) on stdout.
pub fn assert_cni_error(output: &PluginOutput, code: u64, fragment: &str) {
    assert_ne!(
        output.exit_code, 0,
        "expected error {code} ({fragment}), the plugin succeeded: {output:?}"
    );
    let error: Value = serde_json::from_str(output.stdout.trim()).unwrap_or_else(|parse| {
        panic!("stdout is not one JSON error object ({parse}): {output:?}")
    });
    assert_eq!(
        error["code"].as_u64(),
        Some(code),
        "wrong code for {fragment:?}: {output:?}"
    );
    let msg = error["msg"].as_str().unwrap_or_default();
    assert!(msg.contains(fragment), "message {msg:?} lacks {fragment:?}");
    assert!(
        error["cniVersion"].is_string(),
        "error without cniVersion: {output:?}"
    );
}

/// The invocation succeeded and printed nothing on stdout (DEL, CHECK, GC, STATUS).
pub fn assert_silent_success(output: &PluginOutput) {
    assert_eq!(output.exit_code, 0, "the plugin failed: {output:?}");
    assert!(
        output.stdout.trim().is_empty(),
        "stdout must stay empty: {output:?}"
    );
}

/// Nothing of cnibpf is left on `sim`'s node after the DEL that released its last attachment
/// in release-only mode: no pin, lock, statistics or release file, `own_conflist` or `binary`, no program
/// on the uplink, no socket hook on the instance's cgroup; and the call log says what that DEL
/// removed.
pub fn assert_uninstalled(sim: &SimHost, own_conflist: &Path, binary: &Path) {
    let stats = topology::call_stats_file(&sim.pin_path);
    let lock = stats.with_extension("lock");
    let release = stats.with_extension("release");
    let left: Vec<String> = [
        sim.pin_path.clone(),
        stats,
        lock,
        release,
        own_conflist.to_owned(),
        binary.to_owned(),
    ]
    .into_iter()
    .filter(|path| path.symlink_metadata().is_ok())
    .map(|path| path.display().to_string())
    .collect();
    assert!(
        left.is_empty(),
        "left on the node: {left:?}; the plugin's calls: {:#?}",
        call_log(&sim.call_log())
    );
    let hooks = sim
        .host
        .exec(&["bpftool", "net", "show", "dev", topology::UPLINK]);
    assert!(
        !hooks.contains("uplink_"),
        "no cnibpf program on the uplink: {hooks}"
    );
    let socket_hooks = sim.host.exec(&[
        "bpftool",
        "cgroup",
        "show",
        &sim.cgroup.display().to_string(),
    ]);
    assert!(
        socket_hooks.trim().is_empty(),
        "no socket hook on the instance's cgroup: {socket_hooks}"
    );
    let log = call_log(&sim.call_log());
    assert!(
        log.iter()
            .any(|line| line["verb"] == "DEL" && line["uninstalled"].is_string()),
        "the last DEL says what it removed: {log:#?}"
    );
}
