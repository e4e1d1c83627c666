//! Embeds the datapath object built by `cargo xtask build-ebpf`, and the commit the build is
//! of (for `cnibpf --version`).

use std::{env, path::PathBuf, process::Command};

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let object = match env::var_os("CNIBPF_EBPF_OBJECT") {
        Some(path) => PathBuf::from(path),
        None => manifest_dir.join("../target/bpfel-unknown-none/release/cnibpf"),
    };
    println!("cargo::rerun-if-env-changed=CNIBPF_EBPF_OBJECT");
    println!("cargo::rerun-if-changed={}", object.display());
    assert!(
        object.exists(),
        "the eBPF object {} does not exist: run `cargo xtask build-ebpf` first",
        object.display()
    );
    println!("cargo::rustc-env=CNIBPF_EBPF_OBJECT={}", object.display());
    // FNV-1a of the object: lets a new cnibpf notice programs pinned by another build.
    let bytes = std::fs::read(&object).expect("readable eBPF object");
    let id = bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    println!("cargo::rustc-env=CNIBPF_EBPF_OBJECT_ID={id}");
    let (commit, watched) = commit(&manifest_dir);
    for path in watched {
        println!("cargo::rerun-if-changed={}", path.display());
    }
    println!("cargo::rerun-if-env-changed=CNIBPF_COMMIT");
    println!("cargo::rustc-env=CNIBPF_COMMIT={commit}");
}

/// The commit the sources are of — `CNIBPF_COMMIT` if set, else git's HEAD, else "unknown"
/// (a tree without its history) — and the files whose change moves HEAD.
fn commit(manifest_dir: &std::path::Path) -> (String, Vec<PathBuf>) {
    if let Some(commit) = env::var_os("CNIBPF_COMMIT") {
        return (commit.to_string_lossy().into_owned(), Vec::new());
    }
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(manifest_dir)
            .args(args)
            .output()
            .ok()
            .filter(|output| output.status.success())
            .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_owned())
    };
    let Some(head) = git(&["rev-parse", "--short=12", "HEAD"]) else {
        return ("unknown".to_owned(), Vec::new());
    };
    let mut watched = Vec::new();
    if let Some(git_dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        let git_dir = PathBuf::from(git_dir);
        watched.push(git_dir.join("HEAD"));
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watched.push(git_dir.join(branch));
        }
        watched.push(git_dir.join("packed-refs"));
    }
    (head, watched)
}
