//! cnibpf as an earlier commit of this repository built it, for tests that meet the state an
//! older release left behind (a live upgrade). Built from the repository's own history, once
//! per commit: the commit's tree is built in `target/history/<commit>.build`, its binary kept
//! as `target/history/<commit>/cnibpf` and the tree removed (a debug tree takes gigabytes, and
//! the upgrade test builds a dozen commits). One cargo target directory goes from each build to
//! the next (`target/history/carried-target`): the releases share most of their dependencies
//! and the eBPF crate's `core`, which are then compiled once, not once per release.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

/// A commit `releases.toml` lists.
#[derive(Debug)]
pub struct Release {
    pub commit: String,
    /// The eBPF state layout it writes.
    pub ebpf_layout: u32,
}

/// Every release `releases.toml` lists, oldest first.
pub fn releases() -> Vec<Release> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lives in the workspace")
        .join("releases.toml");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("read {}: {error}", path.display()));
    let mut listed: Vec<(String, Option<u32>)> = Vec::new();
    for line in text.lines().map(str::trim) {
        if let Some(commit) = line
            .strip_prefix("commit = \"")
            .and_then(|rest| rest.strip_suffix('"'))
        {
            listed.push((commit.to_owned(), None));
        } else if let Some(layout) = line.strip_prefix("ebpf_layout = ") {
            let (commit, slot) = listed
                .last_mut()
                .unwrap_or_else(|| panic!("{}: an ebpf_layout before any commit", path.display()));
            *slot = Some(layout.parse().unwrap_or_else(|error| {
                panic!("{}: ebpf_layout of {commit}: {error}", path.display())
            }));
        }
    }
    listed
        .into_iter()
        .map(|(commit, layout)| Release {
            ebpf_layout: layout.unwrap_or_else(|| {
                panic!("{}: release {commit} names no ebpf_layout", path.display())
            }),
            commit,
        })
        .collect()
}

/// Every commit `releases.toml` lists, oldest first.
pub fn released_commits() -> Vec<String> {
    releases()
        .into_iter()
        .map(|release| release.commit)
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
    let carried = history.join("carried-target");
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
    // `--touch`: git archive stamps every file with the commit's time, older than what the
    // carried target directory holds, so cargo would take this commit's crates for built;
    // stamped now, every crate of the workspace (and its build script) is built from them.
    let unpacked = Command::new("tar")
        .args(["-x", "--touch", "-C"])
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
    move_if_present(&carried, &tree.join("target"));
    // The commit's own xtask builds it with the toolchains it names; nothing of the cargo that
    // runs this test (its toolchain, target directory, flags) may leak into that build.
    let mut build = Command::new("cargo");
    build.args(["xtask", "build"]).current_dir(&tree);
    // The tree has no history of its own, and git would answer for the repository around it
    // (`target/` is inside it): the commit is named to the builds that print it.
    build.env("CNIBPF_COMMIT", short_commit(repository, commit));
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        let leaks = (name.starts_with("CARGO") && name != "CARGO_HOME")
            || name.starts_with("RUSTC")
            || name.starts_with("RUSTDOC")
            || name == "RUSTFLAGS"
            || name == "RUSTUP_TOOLCHAIN"
            || name == "CNIBPF_EBPF_OBJECT";
        if leaks {
            build.env_remove(&*name);
        }
    }
    // Nothing debugs these binaries: without debug info and incremental state, the carried
    // target directory stays a fraction of its size and every link is faster. The eBPF object
    // is built in its own profile, with its BTF, as ever.
    build
        .env("CARGO_INCREMENTAL", "0")
        .env("CARGO_PROFILE_DEV_DEBUG", "0");
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
    move_if_present(&tree.join("target"), &carried);
    remove_if_present(&tree);
    eprintln!(
        "built cnibpf of commit {commit} in {:.0}s",
        started.elapsed().as_secs_f64()
    );
    binary
}

/// `commit` the way `cnibpf --version` names a commit: its first twelve hex digits.
fn short_commit(repository: &Path, commit: &str) -> String {
    let output = Command::new("git")
        .arg("-C")
        .arg(repository)
        .args(["rev-parse", "--short=12", commit])
        .output()
        .expect("run git rev-parse");
    assert!(
        output.status.success(),
        "git rev-parse {commit}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// Renames `from` to `to`; nothing to move is not an error (the first build has no carried
/// target directory).
fn move_if_present(from: &Path, to: &Path) {
    match std::fs::rename(from, to) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => panic!("move {} to {}: {error}", from.display(), to.display()),
    }
}

fn remove_if_present(tree: &Path) {
    match std::fs::remove_dir_all(tree) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => panic!("remove {}: {error}", tree.display()),
    }
}
