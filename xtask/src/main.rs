//! Developer and CI commands: `cargo xtask <command>`. Run through `./dev`, which first installs
//! what is missing (scripts/bootstrap.sh).

mod bench;
mod demo;
mod fail_closed;
mod ksyms;
mod modules;
mod test;

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(about = "cnibpf developer commands")]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// Build the eBPF object (with BTF) that the cnibpf binary embeds.
    BuildEbpf,
    /// Build the eBPF object and the cnibpf binary that embeds it (target/debug/cnibpf).
    Build {
        /// Optimised, for installing: target/release/cnibpf.
        #[arg(long)]
        release: bool,
    },
    /// Disassemble the eBPF object with source lines (the nightly's llvm-objdump).
    Objdump,
    /// cargo fmt --check, clippy -D warnings (userspace and eBPF), no module import cycle, and
    /// no error read as a value without a `fail-closed:` comment.
    Lint,
    /// The module graph of the eBPF and userspace crates, and whether it has a cycle.
    Modules,
    /// What a contributor runs before every commit: build, lint, unit and integration tests.
    Test {
        /// Arguments passed on to `cargo test` after `--` (e.g. a test name filter).
        #[arg(trailing_var_arg = true)]
        filter: Vec<String>,
    },
    /// What CI runs beyond `test`: the node image's tests (static builds for amd64 and arm64)
    /// and upgrades from the releases before the supported window.
    TestCi {
        /// Arguments passed on to `cargo test` after `--`.
        #[arg(trailing_var_arg = true)]
        filter: Vec<String>,
    },
    /// Wire a container in a simulated host with cnibpf and show it working.
    Demo,
    /// Build the node image (deploy/Containerfile): cnibpf linked statically, nothing else,
    /// for amd64 and arm64, as one multi-arch manifest list (deploy/build-image.sh).
    Image,
    /// Benchmarks against same-run baselines; results in target/bench (table, JSON, PNG).
    Bench {
        /// Which suite (default: all): portmap, masquerade, filter, packets, hot, pods.
        suite: Option<String>,
        /// An older commit to measure beside the last release and this build (hot, packets);
        /// repeat for more.
        #[arg(long = "baseline")]
        baselines: Vec<String>,
    },
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Task::BuildEbpf => build_ebpf(),
        Task::Build { release: false } => build(),
        Task::Build { release: true } => build_release(),
        Task::Objdump => objdump(),
        Task::Lint => lint(),
        Task::Modules => modules::run(true),
        Task::Test { filter } => test::contributor(&filter),
        Task::TestCi { filter } => test::ci_layer(&filter),
        Task::Demo => {
            build()?;
            build_test_client()?;
            demo::run()
        }
        Task::Image => image(),
        Task::Bench { suite, baselines } => {
            build()?;
            build_release()?;
            build_test_client()?;
            bench::run(suite.as_deref(), &baselines)
        }
    }
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_owned()
}

/// The toolchain channel a `rust-toolchain.toml` names.
fn toolchain_channel(file: &Path) -> Result<String> {
    let text = std::fs::read_to_string(file).with_context(|| format!("read {}", file.display()))?;
    text.lines()
        .find_map(|line| {
            let value = line
                .trim()
                .strip_prefix("channel")?
                .trim()
                .strip_prefix('=')?;
            Some(value.trim().trim_matches('"').to_owned())
        })
        .with_context(|| format!("no channel in {}", file.display()))
}

/// A cargo command for the eBPF crate: run from its directory so that its rust-toolchain.toml
/// (the nightly) and .cargo/config.toml (bpf target, build-std, BTF) apply, with the bpf-linker
/// that scripts/bootstrap.sh built for that nightly first on PATH.
fn ebpf_cargo(args: &[&str]) -> Result<Command> {
    let root = workspace_root();
    let ebpf_dir = root.join("cnibpf-ebpf");
    let channel = toolchain_channel(&ebpf_dir.join("rust-toolchain.toml"))?;
    let tools = std::env::var_os("CNIBPF_TOOLS_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|home| PathBuf::from(home).join(".local/share/cnibpf-tools"))
        })
        .context("neither CNIBPF_TOOLS_DIR nor HOME is set")?
        .join(&channel)
        .join("bin");
    if !tools.join("bpf-linker").exists() {
        bail!(
            "bpf-linker is missing in {}: run scripts/bootstrap.sh (./dev does)",
            tools.display()
        );
    }
    let path = std::env::join_paths(std::iter::once(tools).chain(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    )))?;
    let mut command = Command::new("cargo");
    command
        .current_dir(&ebpf_dir)
        .env("PATH", path)
        // The userspace toolchain's cargo sets these for xtask; the nightly must pick its own.
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("CARGO")
        .env_remove("RUSTC")
        .env_remove("RUSTDOC")
        .args(args);
    Ok(command)
}

fn run(mut command: Command, what: &str) -> Result<()> {
    let started = Instant::now();
    eprintln!("\x1b[1m==> {what}\x1b[0m");
    let status = command
        .status()
        .with_context(|| format!("could not start: {what}"))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    eprintln!(
        "\x1b[1m<== {what}: {:.1}s\x1b[0m",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn build_ebpf() -> Result<()> {
    run(ebpf_cargo(&["build", "--release"])?, "build eBPF object")?;
    let object = workspace_root().join("target/bpfel-unknown-none/release/cnibpf");
    let declared = ksyms::declare(&object)?;
    if !declared.is_empty() {
        eprintln!("    kfuncs declared in .ksyms: {}", declared.join(", "));
    }
    eprintln!(
        "    {} ({} bytes)",
        object.display(),
        std::fs::metadata(&object)?.len()
    );
    Ok(())
}

fn objdump() -> Result<()> {
    build_ebpf()?;
    let root = workspace_root();
    let channel = toolchain_channel(&root.join("cnibpf-ebpf/rust-toolchain.toml"))?;
    let output = Command::new("rustup")
        .args(["run", &channel, "rustc", "--print", "sysroot"])
        .output()
        .context("ask rustup for the nightly's sysroot")?;
    let sysroot = PathBuf::from(String::from_utf8(output.stdout)?.trim());
    let host = std::env::consts::ARCH.to_owned() + "-unknown-linux-gnu";
    let tool = sysroot
        .join("lib/rustlib")
        .join(host)
        .join("bin/llvm-objdump");
    let mut command = Command::new(&tool);
    command
        .args([
            "--disassemble",
            "--line-numbers",
            "--no-show-raw-insn",
            "--section=classifier",
        ])
        .arg(root.join("target/bpfel-unknown-none/release/cnibpf"));
    run(command, "llvm-objdump of the eBPF object")
}

fn cargo(args: &[&str]) -> Command {
    let mut command = Command::new("cargo");
    command.current_dir(workspace_root()).args(args);
    command
}

fn build() -> Result<()> {
    build_ebpf()?;
    run(cargo(&["build", "--package", "cnibpf"]), "build cnibpf")
}

/// The traffic client the demo and the benches send with (`cnibpf-test-client`), which a
/// fresh clone lacks until the tests are built.
fn build_test_client() -> Result<()> {
    run(
        cargo(&["build", "--package", "cnibpf-tests", "--bins"]),
        "build the traffic client",
    )
}

fn build_release() -> Result<()> {
    build_ebpf()?;
    run(
        cargo(&["build", "--release", "--package", "cnibpf"]),
        "build cnibpf (release)",
    )?;
    eprintln!(
        "    {}",
        workspace_root().join("target/release/cnibpf").display()
    );
    Ok(())
}

/// The architectures of the node image: (Rust target, the image's architecture, the cross
/// linker when it is not the host's).
pub const IMAGE_TARGETS: [(&str, &str, Option<&str>); 2] = [
    ("x86_64-unknown-linux-gnu", "amd64", None),
    (
        "aarch64-unknown-linux-gnu",
        "arm64",
        Some("aarch64-linux-gnu-gcc"),
    ),
];

/// cnibpf linked statically (glibc's static libc: it calls no name service), for an image of
/// nothing else, for Rust target `target` (one of [`IMAGE_TARGETS`]: another architecture than
/// the host's is cross-compiled with Debian's cross linker, which bootstrap installs); its
/// path.
pub fn build_static_for(target: &str) -> Result<PathBuf> {
    build_ebpf()?;
    let mut command = cargo(&[
        "build",
        "--release",
        "--package",
        "cnibpf",
        "--target",
        target,
        "--target-dir",
        "target/static",
    ]);
    // With --target, RUSTFLAGS reach the target's crates only, not the build scripts.
    command.env("RUSTFLAGS", "-C target-feature=+crt-static");
    let cross = IMAGE_TARGETS
        .iter()
        .find(|(rust, _, _)| *rust == target)
        .and_then(|(_, _, linker)| *linker)
        .filter(|_| !target.starts_with(std::env::consts::ARCH));
    if let Some(linker) = cross {
        let variable = format!(
            "CARGO_TARGET_{}_LINKER",
            target.to_uppercase().replace('-', "_")
        );
        command.env(variable, linker);
    }
    run(
        command,
        &format!("build cnibpf for {target}, statically linked"),
    )?;
    Ok(workspace_root()
        .join("target/static")
        .join(target)
        .join("release/cnibpf"))
}

/// The image `localhost/cnibpf:<version>` in podman's storage: a manifest list of amd64 and
/// arm64 (deploy/build-image.sh).
fn image() -> Result<()> {
    let mut binaries = Vec::new();
    for (target, _, _) in IMAGE_TARGETS {
        binaries.push(build_static_for(target)?);
    }
    let tag = format!("localhost/cnibpf:{}", env!("CARGO_PKG_VERSION"));
    let mut command = Command::new(workspace_root().join("deploy/build-image.sh"));
    command.arg(&tag).args(&binaries);
    run(command, &format!("podman build {tag} (amd64, arm64)"))?;
    eprintln!(
        "    {tag}: push it where your nodes pull from (podman manifest push {tag} <registry>/cnibpf:{}), and set it in deploy/base/cnibpf.yaml (or a kustomize overlay: deploy/overlays/example)",
        env!("CARGO_PKG_VERSION")
    );
    Ok(())
}

fn lint() -> Result<()> {
    run(cargo(&["fmt", "--all", "--check"]), "rustfmt (all crates)")?;
    run(
        cargo(&["clippy", "--all-targets", "--", "-D", "warnings"]),
        "clippy (userspace)",
    )?;
    run(
        ebpf_cargo(&["clippy", "--release", "--", "-D", "warnings"])?,
        "clippy (eBPF)",
    )?;
    modules::run(false)?;
    modules::check_lengths()?;
    fail_closed::run()
}
