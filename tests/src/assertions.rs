//! Assertions on what a plugin invocation printed.

use serde_json::Value;

use crate::PluginOutput;

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
