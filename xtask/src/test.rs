//! The test layers: `cargo xtask test` (`./dev test`), what a contributor runs before every
//! commit — build, lint, unit tests, then the integration suites — and `cargo xtask test-ci`,
//! what CI runs after it: the tests that need the node image's static builds for both
//! architectures, and upgrades from the releases before the supported window. Each prints one
//! closing line, `tests: N passed, F failed, S skipped`.

use std::{
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, Result, bail};

use crate::{IMAGE_TARGETS, build, build_static_for, cargo, lint, workspace_root};

mod suites;

/// The integration tests only `test-ci` runs, as (suite, test).
const CI_LAYER: [(&str, &str); 3] = [
    (
        "deploy",
        "the_image_installs_into_the_host_dirs_and_uninstalls_from_them",
    ),
    (
        "deploy",
        "the_image_is_built_for_amd64_and_arm64_and_the_arm64_binary_runs",
    ),
    (
        "upgrade",
        "the_releases_before_the_supported_window_pass_through_it",
    ),
];

/// Passed, failed and skipped tests of a layer so far.
#[derive(Default)]
pub struct Tally {
    passed: u64,
    failed: u64,
    skipped: Vec<String>,
}

/// `cargo xtask test`.
pub fn contributor(filter: &[String]) -> Result<()> {
    let started = Instant::now();
    build()?;
    lint()?;
    // Unit tests first: seconds, no root, and a failure there says more than any suite.
    let mut unit = cargo(&[
        "test",
        "--workspace",
        "--exclude",
        "cnibpf-ebpf",
        "--lib",
        "--bins",
        "--",
    ]);
    unit.args(filter);
    let mut tally = Tally::default();
    tally.add(&mut unit, "unit tests")?;
    if tally.failed > 0 {
        return tally.close(started);
    }
    let mut args: Vec<String> = filter.to_vec();
    for (_, test) in CI_LAYER {
        args.extend(["--skip".to_owned(), test.to_owned()]);
    }
    suites::run(&mut tally, &args)?;
    tally.close(started)
}

/// `cargo xtask test-ci`.
pub fn ci_layer(filter: &[String]) -> Result<()> {
    let started = Instant::now();
    build()?;
    for (target, _, _) in IMAGE_TARGETS {
        build_static_for(target)?;
    }
    let mut layer = cargo(&[
        "test",
        "--workspace",
        "--exclude",
        "cnibpf-ebpf",
        "--no-fail-fast",
    ]);
    let mut suites: Vec<&str> = CI_LAYER.iter().map(|(suite, _)| *suite).collect();
    suites.dedup();
    for suite in suites {
        layer.args(["--test", suite]);
    }
    layer.args(["--", "--exact"]);
    layer.args(CI_LAYER.iter().map(|(_, test)| *test));
    layer.args(filter);
    let mut tally = Tally::default();
    tally.add(
        &mut layer,
        "CI layer: the image's and the older releases' tests",
    )?;
    let mut bridged = cargo(&["test", "--package", "cnibpf-tests", "--no-fail-fast"]);
    for suite in CI_BRIDGE_NETFILTER_SUITES {
        bridged.args(["--test", suite]);
    }
    bridged
        .env(cnibpf_tests::topology::BRIDGE_NETFILTER_ENV, "1")
        .arg("--")
        .args(filter);
    tally.add(
        &mut bridged,
        "CI layer: the traffic suites `./dev test` runs without br_netfilter only",
    )?;
    tally.close(started)
}

/// The suites of the datapath's traffic the CI layer runs with `br_netfilter` on, beside those
/// `./dev test` runs so (`suites::BRIDGE_NETFILTER_SUITES`), which keeps it within ten minutes.
pub const CI_BRIDGE_NETFILTER_SUITES: [&str; 2] = ["portmap", "host_access"];

impl Tally {
    /// Runs `command` (a `cargo test`), echoing its output, and adds its binaries' "test
    /// result" lines; tests that cannot run on this machine record themselves
    /// (`cnibpf_tests::skip`) and count as skipped, not passed.
    fn add(&mut self, command: &mut Command, what: &str) -> Result<()> {
        let skip_log = fresh_skip_log()?;
        command.env(cnibpf_tests::SKIP_LOG_ENV, &skip_log);
        let started = Instant::now();
        eprintln!("\x1b[1m==> {what}\x1b[0m");
        let mut child = command
            .stdout(Stdio::piped())
            .spawn()
            .context("could not start cargo test")?;
        let stdout = child.stdout.take().context("piped stdout")?;
        let (mut passed, mut failed) = (0, 0);
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            println!("{line}");
            if let Some(summary) = line.strip_prefix("test result: ") {
                passed += count(summary, "passed");
                failed += count(summary, "failed");
            }
        }
        let status = child.wait()?;
        eprintln!(
            "\x1b[1m<== {what}: {:.1}s\x1b[0m",
            started.elapsed().as_secs_f64()
        );
        if !status.success() && failed == 0 {
            bail!("cargo test failed ({status})");
        }
        self.passed += passed;
        self.failed += failed;
        self.take_skips(&skip_log)
    }

    /// Moves the tests a skip log names from passed to skipped.
    fn take_skips(&mut self, skip_log: &Path) -> Result<()> {
        let skipped: Vec<String> = match std::fs::read_to_string(skip_log) {
            Ok(text) => text.lines().map(str::to_owned).collect(),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(error) => {
                return Err(error).with_context(|| format!("read {}", skip_log.display()));
            }
        };
        self.passed -= skipped.len() as u64;
        self.skipped.extend(skipped);
        Ok(())
    }

    /// Prints the skipped tests and, last, the one closing line; an error if any failed.
    fn close(self, started: Instant) -> Result<()> {
        eprintln!(
            "\x1b[1mbuild, lint and tests took {:.1}s\x1b[0m",
            started.elapsed().as_secs_f64()
        );
        for line in &self.skipped {
            println!("skipped {line}");
        }
        // One plain closing line, last, for whoever reads the end of the log (CI included).
        println!(
            "tests: {} passed, {} failed, {} skipped",
            self.passed,
            self.failed,
            self.skipped.len()
        );
        if self.failed > 0 {
            bail!("{} tests failed", self.failed);
        }
        Ok(())
    }
}

/// The file tests that cannot run on this machine record themselves in, emptied.
fn fresh_skip_log() -> Result<std::path::PathBuf> {
    let skip_log = workspace_root().join("target/test-skips.log");
    remove_if_present(&skip_log)?;
    Ok(skip_log)
}

/// The count of `word` ("passed", "failed") in a "test result:" summary.
fn count(summary: &str, word: &str) -> u64 {
    summary
        .split(';')
        .find_map(|part| {
            part.trim()
                .trim_start_matches("ok. ")
                .trim_start_matches("FAILED. ")
                .strip_suffix(word)
        })
        .and_then(|number| number.trim().parse::<u64>().ok())
        // fail-closed: a summary without the word counts none of it; cargo's exit status
        // still fails the layer.
        .unwrap_or(0)
}

fn remove_if_present(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(error).with_context(|| format!("remove {}", path.display())),
    }
}
