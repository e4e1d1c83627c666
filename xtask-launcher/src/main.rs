//! `cargo xtask` starts here, built by whatever toolchain `cargo` is (this crate has no
//! dependencies and builds in a second with any Rust of edition 2024). It makes sure the pinned
//! toolchains and bpf-linker are installed — running `scripts/bootstrap.sh` when one is missing —
//! then runs the real `xtask` with the pinned userspace toolchain.
//!
//! Why not a `rust-toolchain.toml` at the root: rustup (with auto-install off, as on these
//! machines) refuses to run `cargo` at all in a directory that names a toolchain it does not
//! have, so `cargo xtask` typed first on a fresh clone could never start to install it.

use std::{
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};

fn main() -> ExitCode {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the launcher lives in the workspace")
        .to_owned();
    let Some(userspace) = channel(&root.join("toolchains.toml"), Some("[userspace]")) else {
        eprintln!("xtask: no [userspace] channel in toolchains.toml");
        return ExitCode::FAILURE;
    };
    let Some(ebpf) = channel(&root.join("cnibpf-ebpf/rust-toolchain.toml"), None) else {
        eprintln!("xtask: no channel in cnibpf-ebpf/rust-toolchain.toml");
        return ExitCode::FAILURE;
    };
    let missing = missing(&userspace, &ebpf);
    if !missing.is_empty() {
        eprintln!(
            "xtask: {} missing; installing with scripts/bootstrap.sh",
            missing.join(", ")
        );
        let bootstrap = Command::new(root.join("scripts/bootstrap.sh")).status();
        if !bootstrap.is_ok_and(|status| status.success()) {
            eprintln!(
                "xtask: scripts/bootstrap.sh failed (it must run as root); run it, then retry"
            );
            return ExitCode::FAILURE;
        }
    }
    let error = Command::new("cargo")
        .arg(format!("+{userspace}"))
        .args(["run", "--quiet", "--package", "xtask", "--"])
        .args(std::env::args_os().skip(1))
        .current_dir(&root)
        // The launcher's own toolchain must not leak into the pinned one's cargo.
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("CARGO")
        .env_remove("RUSTC")
        .exec();
    eprintln!("xtask: could not run cargo +{userspace}: {error}");
    ExitCode::FAILURE
}

/// What `scripts/bootstrap.sh` installs and is not there.
fn missing(userspace: &str, ebpf: &str) -> Vec<String> {
    let installed = Command::new("rustup")
        .args(["toolchain", "list"])
        .output()
        .map(|output| String::from_utf8_lossy(&output.stdout).into_owned())
        .unwrap_or_default();
    let has = |channel: &str| {
        installed
            .lines()
            .any(|line| line.starts_with(&format!("{channel}-")))
    };
    let mut missing = Vec::new();
    for channel in [userspace, ebpf] {
        if !has(channel) {
            missing.push(format!("Rust {channel}"));
        }
    }
    if !tools_dir(ebpf).join("bin/bpf-linker").exists() {
        missing.push("bpf-linker".to_owned());
    }
    missing
}

/// Where `scripts/bootstrap.sh` puts the tools built for the eBPF nightly.
fn tools_dir(ebpf: &str) -> PathBuf {
    std::env::var_os("CNIBPF_TOOLS_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|home| PathBuf::from(home).join(".local/share/cnibpf-tools"))
        })
        .unwrap_or_default()
        .join(ebpf)
}

/// The `channel = "..."` of `file`, in `section` when given.
fn channel(file: &Path, section: Option<&str>) -> Option<String> {
    let text = std::fs::read_to_string(file).ok()?;
    let mut in_section = section.is_none();
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            in_section = section.is_none_or(|wanted| line == wanted);
            continue;
        }
        if !in_section {
            continue;
        }
        if let Some(value) = line
            .strip_prefix("channel")
            .and_then(|rest| rest.trim().strip_prefix('='))
        {
            return Some(value.trim().trim_matches('"').to_owned());
        }
    }
    None
}
