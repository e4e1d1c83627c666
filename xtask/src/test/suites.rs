//! The integration suites of `./dev test`: each suite's test binary built by one `cargo test
//! --no-run`, then run `CNIBPF_TEST_JOBS` at a time (default 2: the suites mostly wait on the
//! simulated hosts' traffic and on processes they start), the longest first by the durations
//! the last run recorded, each suite's output printed whole when it ends. Every test names its
//! own namespaces, pinPath and cgroup, so suites, like the tests inside one, run side by side.
//! The suites of the datapath's traffic run a second time on simulated hosts shaped as a
//! Kubernetes node's, `br_netfilter` on ([`BRIDGE_NETFILTER_SUITES`]).

use std::{
    collections::VecDeque,
    io::{BufRead as _, BufReader},
    path::PathBuf,
    process::{Command, Stdio},
    sync::Mutex,
    time::Instant,
};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;

use super::{Tally, count, fresh_skip_log};
use crate::{cargo, workspace_root};

/// Where each suite's duration of the last run is kept (`name seconds` lines).
const DURATIONS: &str = "target/test-durations";
const DEFAULT_JOBS: usize = 2;

/// The suites that run once more with `br_netfilter` on (kube-proxy requires it): masquerade
/// and hostPorts (hairpin among them), whose packets a bridge that hands its frames to the IP
/// hooks changes most. (The `kubernetes` suite has it on itself; the CI layer runs the other
/// traffic suites with it too, `crate::test::CI_BRIDGE_NETFILTER_SUITES`.)
const BRIDGE_NETFILTER_SUITES: [&str; 2] = ["masquerade", "hostport"];

struct Suite {
    name: String,
    executable: PathBuf,
    /// The run's simulated hosts keep `br_netfilter` on.
    bridge_netfilter: bool,
}

/// What one suite's run came to.
struct Ran {
    name: String,
    seconds: f64,
    passed: u64,
    failed: u64,
}

/// Builds and runs every integration suite with `args` (filters and skips) after `--`.
pub fn run(tally: &mut Tally, args: &[String]) -> Result<()> {
    let started = Instant::now();
    eprintln!("\x1b[1m==> integration tests\x1b[0m");
    let mut suites = built()?;
    let durations = last_durations();
    let last = |suite: &Suite| {
        durations
            .iter()
            .find(|(name, _)| *name == suite.name)
            // fail-closed: a suite the last run did not time goes first, as the longest.
            .map_or(f64::INFINITY, |(_, seconds)| *seconds)
    };
    suites.sort_by(|a, b| last(b).total_cmp(&last(a)));
    let jobs = std::env::var("CNIBPF_TEST_JOBS")
        .ok()
        .map(|jobs| jobs.parse::<usize>())
        .transpose()
        .context("CNIBPF_TEST_JOBS is a number")?
        .unwrap_or(DEFAULT_JOBS)
        .max(1);
    let skip_log = fresh_skip_log()?;
    let queue = Mutex::new(suites.into_iter().collect::<VecDeque<_>>());
    let ran = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| {
                loop {
                    let next = queue
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .pop_front();
                    let Some(suite) = next else { break };
                    let result = run_one(&suite, args, &skip_log);
                    ran.lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push(result);
                }
            });
        }
    });
    let ran = ran
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut record = String::new();
    for result in ran {
        let ran = result?;
        tally.passed += ran.passed;
        tally.failed += ran.failed;
        record.push_str(&format!("{} {:.1}\n", ran.name, ran.seconds));
    }
    let durations_path = workspace_root().join(DURATIONS);
    std::fs::write(&durations_path, record)
        .with_context(|| format!("write {}", durations_path.display()))?;
    tally.take_skips(&skip_log)?;
    eprintln!(
        "\x1b[1m<== integration tests: {:.1}s\x1b[0m",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Every integration suite's test binary, built.
fn built() -> Result<Vec<Suite>> {
    let mut build = cargo(&[
        "test",
        // The same package set as the unit tests, so that nothing is rebuilt with other
        // features; only the tests crate has integration tests.
        "--workspace",
        "--exclude",
        "cnibpf-ebpf",
        "--test",
        "*",
        "--no-run",
        "--message-format=json-render-diagnostics",
    ]);
    let mut child = build
        .stdout(Stdio::piped())
        .spawn()
        .context("start cargo test --no-run")?;
    let stdout = child.stdout.take().context("piped stdout")?;
    let mut suites = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let message: Value = serde_json::from_str(&line?).context("cargo's JSON message")?;
        let is_test = message["target"]["kind"]
            .as_array()
            .is_some_and(|kinds| kinds.iter().any(|kind| kind == "test"));
        if let (true, Some(name), Some(executable)) = (
            is_test,
            message["target"]["name"].as_str(),
            message["executable"].as_str(),
        ) {
            if BRIDGE_NETFILTER_SUITES.contains(&name) {
                suites.push(Suite {
                    name: format!("{name}+br_netfilter"),
                    executable: PathBuf::from(executable),
                    bridge_netfilter: true,
                });
            }
            suites.push(Suite {
                name: name.to_owned(),
                executable: PathBuf::from(executable),
                bridge_netfilter: false,
            });
        }
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("building the integration tests failed ({status})");
    }
    Ok(suites)
}

/// Runs one suite's binary as `cargo test` would (from the tests crate's directory), then
/// prints its output.
fn run_one(suite: &Suite, args: &[String], skip_log: &std::path::Path) -> Result<Ran> {
    let started = Instant::now();
    eprintln!("    {} started", suite.name);
    let mut command = Command::new(&suite.executable);
    command
        .args(args)
        .current_dir(workspace_root().join("tests"))
        .env(cnibpf_tests::SKIP_LOG_ENV, skip_log);
    if suite.bridge_netfilter {
        command.env(cnibpf_tests::topology::BRIDGE_NETFILTER_ENV, "1");
    }
    let output = command
        .output()
        .with_context(|| format!("run {}", suite.executable.display()))?;
    let seconds = started.elapsed().as_secs_f64();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let (mut passed, mut failed) = (0, 0);
    for summary in stdout
        .lines()
        .filter_map(|line| line.strip_prefix("test result: "))
    {
        passed += count(summary, "passed");
        failed += count(summary, "failed");
    }
    if !output.status.success() && failed == 0 {
        // The harness itself died (a signal, a panic outside a test): one failure.
        failed = 1;
    }
    println!(
        "     Running {} ({:.1}s, {})\n{}{}",
        suite.name,
        seconds,
        output.status,
        stdout,
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(Ran {
        name: suite.name.clone(),
        seconds,
        passed,
        failed,
    })
}

/// Each suite's duration on a fresh clone of this project's test machine, no release built
/// yet (`./dev test`, 92c5848): the order of a clone's first run, which has no record of its own
/// (the upgrade suite, which builds the releases then, and the other long ones first).
const FIRST_RUN: &str = include_str!("durations.txt");

/// The durations the last run recorded, by suite; a fresh clone's from [`FIRST_RUN`].
fn last_durations() -> Vec<(String, f64)> {
    // fail-closed: no record (a fresh clone) or an unreadable one only changes the order.
    let recorded = std::fs::read_to_string(workspace_root().join(DURATIONS)).unwrap_or_default();
    let text = if recorded.is_empty() {
        FIRST_RUN
    } else {
        &recorded
    };
    text.lines()
        .filter_map(|line| {
            let (name, seconds) = line.split_once(' ')?;
            Some((name.to_owned(), seconds.parse().ok()?))
        })
        .collect()
}
