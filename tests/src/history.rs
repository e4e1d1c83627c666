//! cnibpf as an earlier commit of this repository built it, for tests that meet the state an
//! older release left behind (a live upgrade) and benchmarks beside older builds. Built from the
//! repository's own history once per machine, not per clone: in the cache outside the work tree
//! ([`cache_dir`]), the commit's tree is built in `<commit>.build`, its binary kept as
//! `<commit>/cnibpf` (keyed by the full commit hash) and the tree removed (a debug tree takes
//! gigabytes). One cargo target directory goes from each build to the next (`carried-target`):
//! the releases share most of their dependencies and the eBPF crate's `core`, which are then
//! compiled once, not once per release. A lock on the cache serialises builds from several
//! clones or test processes.

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
    /// The nftables table layout it writes, as `releases.toml` names it (`cnibpf layout 3`).
    pub nftables_layout: String,
}

/// Every release `releases.toml` lists, oldest first.
pub fn releases() -> Vec<Release> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lives in the workspace")
        .join("releases.toml");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("read {}: {error}", path.display()));
    let mut listed: Vec<(String, Option<u32>, Option<String>)> = Vec::new();
    for line in text.lines().map(str::trim) {
        let quoted = |key: &str| {
            line.strip_prefix(key)
                .and_then(|rest| rest.strip_prefix(" = \""))
                .and_then(|rest| rest.strip_suffix('"'))
                .map(str::to_owned)
        };
        if let Some(commit) = quoted("commit") {
            listed.push((commit, None, None));
            continue;
        }
        let Some((commit, ebpf, nftables)) = listed.last_mut() else {
            continue;
        };
        if let Some(layout) = line.strip_prefix("ebpf_layout = ") {
            *ebpf = Some(layout.parse().unwrap_or_else(|error| {
                panic!("{}: ebpf_layout of {commit}: {error}", path.display())
            }));
        } else if let Some(layout) = quoted("nftables_layout") {
            *nftables = Some(layout);
        }
    }
    listed
        .into_iter()
        .map(|(commit, ebpf, nftables)| Release {
            ebpf_layout: ebpf.unwrap_or_else(|| {
                panic!("{}: release {commit} names no ebpf_layout", path.display())
            }),
            nftables_layout: nftables.unwrap_or_else(|| {
                panic!(
                    "{}: release {commit} names no nftables_layout",
                    path.display()
                )
            }),
            commit,
        })
        .collect()
}

/// How many of the last releases an upgrade is supported from (docs/upgrades.md): `./dev
/// test` upgrades from each; the releases before them are CI's upgrade layer.
pub const SUPPORTED_RELEASES: usize = 2;

/// The releases an upgrade is supported from, oldest first: the last [`SUPPORTED_RELEASES`].
pub fn supported_releases() -> Vec<Release> {
    let mut releases = releases();
    releases.drain(..releases.len().saturating_sub(SUPPORTED_RELEASES));
    releases
}

/// Where built releases are kept: `$CNIBPF_RELEASE_CACHE`, else `$XDG_CACHE_HOME/cnibpf/releases`,
/// else `~/.cache/cnibpf/releases`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CNIBPF_RELEASE_CACHE") {
        return PathBuf::from(dir);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| Path::new(&home).join(".cache")))
        .expect("HOME or XDG_CACHE_HOME names a cache directory (or set CNIBPF_RELEASE_CACHE)");
    cache.join("cnibpf/releases")
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
    let history = cache_dir();
    let full = rev_parse(repository, commit, "--verify");
    let kept = history.join(&full);
    let binary = kept.join("cnibpf");
    if binary.exists() {
        return binary;
    }
    std::fs::create_dir_all(&history)
        .unwrap_or_else(|error| panic!("create {}: {error}", history.display()));
    let lock_path = history.join(".lock");
    let lock = std::fs::File::create(&lock_path)
        .unwrap_or_else(|error| panic!("open {}: {error}", lock_path.display()));
    lock.lock()
        .unwrap_or_else(|error| panic!("lock {}: {error}", lock_path.display()));
    // Another process may have built it while this one waited.
    if binary.exists() {
        return binary;
    }
    let tree = history.join(format!("{full}.build"));
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
    build.env("CNIBPF_COMMIT", rev_parse(repository, commit, "--short=12"));
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

/// `commit` as `git rev-parse <how>` names it: `--verify` the full hash, `--short=12` the way
/// `cnibpf --version` names a commit.
fn rev_parse(repository: &Path, commit: &str, how: &str) -> String {
    let output = Command::new("git")
        .arg("-C")
        .arg(repository)
        .args(["rev-parse", how, &format!("{commit}^{{commit}}")])
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
