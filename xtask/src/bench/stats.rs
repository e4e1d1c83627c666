//! The kernel's per-program run-time statistics (`kernel.bpf_stats_enabled`), and what they
//! themselves cost: the kernel reads a clock before and after every program run it counts, so
//! a program's time per run includes that read. An empty program at the same hook, counted over
//! the same packets, measures it, and the benches take it off.

use std::path::Path;

use anyhow::{Context as _, Result, bail};
pub use cnibpf_tests::foreign::Hook;
use cnibpf_tests::{SimHost, foreign::EmptyProgram};

use super::Row;

/// The kernel's per-program run time statistics, on while this lives (they cost a clock read
/// per run, for every program alike).
#[derive(Debug)]
pub struct BpfStats {
    previous: String,
}

const BPF_STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";

impl BpfStats {
    pub fn enable() -> Result<Self> {
        let previous = std::fs::read_to_string(BPF_STATS)?.trim().to_owned();
        std::fs::write(BPF_STATS, "1")?;
        Ok(Self { previous })
    }

    /// (run time in ns, runs) of `programs` pinned under `pin_path`, summed.
    pub fn programs(&self, pin_path: &Path, programs: &[&str]) -> Result<(u64, u64)> {
        let mut total = (0, 0);
        for program in programs {
            let output = std::process::Command::new("bpftool")
                .args(["-j", "prog", "show", "pinned"])
                .arg(pin_path.join("programs").join(program))
                .output()?;
            let shown: serde_json::Value = serde_json::from_slice(&output.stdout)
                .with_context(|| format!("bpftool prog show {program}"))?;
            // bpftool leaves both out while the program has not run.
            total.0 += shown["run_time_ns"].as_u64().unwrap_or(0);
            total.1 += shown["run_cnt"].as_u64().unwrap_or(0);
        }
        Ok(total)
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        let _ = std::fs::write(BPF_STATS, &self.previous);
    }
}

/// (run time in ns, runs), as the kernel counts them.
type Counted = (u64, u64);

/// A datapath program measured at its hook, and the row it gets.
#[derive(Debug)]
pub struct Measured<'a> {
    /// Its pin name under the instance's `programs/`.
    pub program: &'a str,
    /// The host namespace's interface it runs on.
    pub interface: &'a str,
    pub hook: Hook,
    pub metric: &'static str,
}

/// One row per `measured` program over what `load` sends: its own time per packet — its run
/// time per run as the kernel counts it, less that of an empty program at the same hook over
/// the same packets — beside the figure as counted.
pub fn time_per_packet(
    sim: &SimHost,
    scenario: &str,
    measured: &[Measured<'_>],
    load: impl FnOnce() -> Result<()>,
) -> Result<Vec<Row>> {
    let stats = BpfStats::enable()?;
    let empty: Vec<EmptyProgram> = measured
        .iter()
        .map(|program| EmptyProgram::attach(&sim.host, program.interface, program.hook))
        .collect();
    // (the program's, the empty program's) (run time, runs) so far.
    let counts = || -> Result<Vec<(Counted, Counted)>> {
        measured
            .iter()
            .zip(&empty)
            .map(|(program, empty)| {
                Ok((
                    stats.programs(&sim.pin_path, &[program.program])?,
                    empty.counted(),
                ))
            })
            .collect()
    };
    let before = counts()?;
    load()?;
    let after = counts()?;
    let per_run = |before: Counted, after: Counted| -> Option<f64> {
        let runs = after.1.checked_sub(before.1).filter(|runs| *runs > 0)?;
        Some(after.0.saturating_sub(before.0) as f64 / runs as f64)
    };
    measured
        .iter()
        .zip(before.into_iter().zip(after))
        .map(
            |(program, ((own_before, empty_before), (own_after, empty_after)))| {
                let (Some(counted), Some(empty)) = (
                    per_run(own_before, own_after),
                    per_run(empty_before, empty_after),
                ) else {
                    bail!("{} did not run on {}", program.program, program.interface);
                };
                Ok(Row {
                    scenario: scenario.to_owned(),
                    metric: program.metric,
                    unit: "ns",
                    // A program that costs no more than the empty one shows 0, not the noise
                    // between two counts (the baseline column keeps what was counted).
                    value: (counted - empty).max(0.0),
                    baseline: Some((
                        format!("as counted, with the statistics' own {empty:.0} ns"),
                        counted,
                    )),
                })
            },
        )
        .collect()
}
