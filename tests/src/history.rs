//! cnibpf as an earlier commit of this repository built it, for tests that meet the state an
//! older release left behind (a live upgrade). Built from the repository's own history, once
//! per commit: the commit's tree is built in `target/history/<commit>.build`, its binary kept
//! as `target/history/<commit>/cnibpf` and the tree removed (a debug tree takes gigabytes, and
//! the upgrade test builds a dozen commits).

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

/// Every commit `releases.toml` lists, oldest first.
pub fn released_commits() -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lives in the workspace")
        .join("releases.toml");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("read {}: {error}", path.display()))
        .lines()
        .filter_map(|line| line.trim().strip_prefix("commit = \""))
        .filter_map(|rest| rest.strip_suffix('"'))
        .map(str::to_owned)
        .collect()
}

/// The debug cnibpf binary of `commit`, building it first if need be. Needs the full history
/// (a shallow clone lacks the commit: `git fetch --unshallow`).
pub fn cnibpf_of(commit: &str) -> PathBuf {
    let repository = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lives in the workspace");
    let history = repository.join("target/history");
    let kept = history.join(commit);
    let binary = kept.join("cnibpf");
    if binary.exists() {
        return binary;
    }
    let tree = history.join(format!("{commit}.build"));
    remove_if_present(&tree);
    std::fs::create_dir_all(&tree)
        .unwrap_or_else(|error| panic!("create {}: {error}", tree.display()));
    let started = Instant::now();
    eprintln!("building cnibpf of commit {commit} in {}", tree.display());
    let mut archive = Command::new("git")
        .arg("-C")
        .arg(repository)
        .args(["archive", "--format=tar", commit])
        .stdout(Stdio::piped())
        .spawn()
        .expect("run git archive");
    let unpacked = Command::new("tar")
        .arg("-x")
        .arg("-C")
        .arg(&tree)
        .stdin(archive.stdout.take().expect("git archive's output"))
        .status()
        .expect("run tar");
    let archived = archive.wait().expect("wait for git archive");
    assert!(
        archived.success() && unpacked.success(),
        "could not unpack commit {commit} of {} (a shallow clone lacks it: git fetch --unshallow)",
        repository.display()
    );
    // The commit's own xtask builds it with the toolchains it names; nothing of the cargo that
    // runs this test (its toolchain, target directory, flags) may leak into that build.
    let mut build = Command::new("cargo");
    build.args(["xtask", "build"]).current_dir(&tree);
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        let leaks = (name.starts_with("CARGO") && name != "CARGO_HOME")
            || name.starts_with("RUSTC")
            || name.starts_with("RUSTDOC")
            || name == "RUSTFLAGS"
            || name == "RUSTUP_TOOLCHAIN";
        if leaks {
            build.env_remove(&*name);
        }
    }
    let output = build.output().expect("run cargo xtask build");
    assert!(
        output.status.success(),
        "building commit {commit} failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    std::fs::create_dir_all(&kept)
        .unwrap_or_else(|error| panic!("create {}: {error}", kept.display()));
    // Copied under a temporary name and renamed: a binary at the kept path is a whole one.
    let partial = kept.join("cnibpf.partial");
    std::fs::copy(tree.join("target/debug/cnibpf"), &partial)
        .unwrap_or_else(|error| panic!("keep the binary of commit {commit}: {error}"));
    std::fs::rename(&partial, &binary)
        .unwrap_or_else(|error| panic!("keep the binary of commit {commit}: {error}"));
    remove_if_present(&tree);
    eprintln!(
        "built cnibpf of commit {commit} in {:.0}s",
        started.elapsed().as_secs_f64()
    );
    binary
}

fn remove_if_present(tree: &Path) {
    match std::fs::remove_dir_all(tree) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => panic!("remove {}: {error}", tree.display()),
    }
}
