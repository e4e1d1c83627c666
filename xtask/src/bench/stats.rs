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

/// What a program and the empty program beside it at its hook were counted over one load.
#[derive(Clone, Copy, Debug)]
pub struct Counts {
    own: Counted,
    empty: Counted,
}

impl Counts {
    /// The program's runs.
    pub fn runs(&self) -> u64 {
        self.own.1
    }

    /// The packets that passed the hook: the empty program ran for each, whether or not the
    /// program is attached there.
    pub fn packets(&self) -> u64 {
        self.empty.1
    }

    /// The program's run time per run as counted, and the statistics' own cost per run (the
    /// empty program's); `None` when either did not run.
    pub fn per_run(&self) -> Option<(f64, f64)> {
        let per_run = |(time, runs): Counted| (runs > 0).then(|| time as f64 / runs as f64);
        Some((per_run(self.own)?, per_run(self.empty)?))
    }

    /// The program's own run time over the load, net of the statistics' cost of each run.
    pub fn net_ns(&self) -> f64 {
        let statistics = self.per_run().map_or(0.0, |(_, empty)| empty);
        (self.own.0 as f64 - self.own.1 as f64 * statistics).max(0.0)
    }
}

/// The kernel's counts of each `measured` program, and of an empty program attached beside
/// it, over what `load` sends.
pub fn count(
    sim: &SimHost,
    measured: &[Measured<'_>],
    load: impl FnOnce() -> Result<()>,
) -> Result<Vec<Counts>> {
    let stats = BpfStats::enable()?;
    let empty: Vec<EmptyProgram> = measured
        .iter()
        .map(|program| EmptyProgram::attach(&sim.host, program.interface, program.hook))
        .collect();
    let snapshot = || -> Result<Vec<Counts>> {
        measured
            .iter()
            .zip(&empty)
            .map(|(program, empty)| {
                Ok(Counts {
                    own: stats.programs(&sim.pin_path, &[program.program])?,
                    empty: empty.counted(),
                })
            })
            .collect()
    };
    let before = snapshot()?;
    load()?;
    let after = snapshot()?;
    Ok(before
        .into_iter()
        .zip(after)
        .map(|(before, after)| Counts {
            own: (
                after.own.0.saturating_sub(before.own.0),
                after.own.1.saturating_sub(before.own.1),
            ),
            empty: (
                after.empty.0.saturating_sub(before.empty.0),
                after.empty.1.saturating_sub(before.empty.1),
            ),
        })
        .collect())
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
    measured
        .iter()
        .zip(count(sim, measured, load)?)
        .map(|(program, counts)| {
            let Some((counted, empty)) = counts.per_run() else {
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
        })
        .collect()
}
