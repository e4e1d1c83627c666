//! What of a pod's ADD and DEL is the kernel's wait for RCU grace periods: the same calls with
//! the node's grace periods normal and expedited in turn.

use anyhow::{Context as _, Result};
use cnibpf_tests::{Netns, SimHost};
use serde_json::json;

use super::{
    TIMED_CYCLES,
    plugin::{Timed, invoke_attachment, median_wall, phase_rows, veth_pairs},
};
use crate::bench::{Progress, Row, in_turn};

/// The kernel's switch that makes every RCU grace period on the node an expedited one.
const RCU_EXPEDITED: &str = "/sys/kernel/rcu_expedited";

/// [`RCU_EXPEDITED`] set for as long as it lives, and put back as it was on drop.
struct ExpeditedRcu {
    before: String,
}

impl ExpeditedRcu {
    fn set(on: bool) -> Result<Self> {
        let before = std::fs::read_to_string(RCU_EXPEDITED)
            .with_context(|| format!("read {RCU_EXPEDITED}"))?;
        std::fs::write(RCU_EXPEDITED, if on { "1" } else { "0" })
            .with_context(|| format!("write {RCU_EXPEDITED}"))?;
        Ok(Self { before })
    }
}

impl Drop for ExpeditedRcu {
    fn drop(&mut self) {
        if let Err(error) = std::fs::write(RCU_EXPEDITED, self.before.trim()) {
            eprintln!(
                "could not put {RCU_EXPEDITED} back to {}: {error}",
                self.before.trim()
            );
        }
    }
}

/// ADD and DEL of a pod with a hostPort beside another, the node's RCU grace periods normal and
/// expedited in turn within each cycle: what of an ADD is the kernel's wait for the grace
/// periods its tcx links take (see docs/datapath.md), and what a node that expedites them pays.
pub(super) fn expedited_grace_periods(progress: &Progress) -> Result<Vec<Row>> {
    progress.step(&format!(
        "cnibpf: {TIMED_CYCLES} ADD/DEL cycles beside a pod, {RCU_EXPEDITED} 0 and 1 in turn"
    ));
    let sim = SimHost::new("bench-rcu", json!({ "backend": "ebpf" }));
    let containers = Netns::create(&format!("cbt-{}-r", sim.id));
    veth_pairs(&sim, &containers, 0..2)?;
    let mapping = |port: u16| json!({ "portMappings": [{ "hostPort": port, "containerPort": 80, "protocol": "tcp" }] });
    let (keeper, timed) = (mapping(30_001), mapping(30_000));
    invoke_attachment(&sim, &containers, "cnibpf", "ADD", 1, &keeper)?;
    let mut runs: [(Vec<Timed>, Vec<Timed>); 2] = Default::default();
    for cycle in 1..=TIMED_CYCLES {
        for expedited in in_turn(cycle, runs.len()) {
            let _switch = ExpeditedRcu::set(expedited == 1)?;
            let (adds, dels) = &mut runs[expedited];
            adds.push(invoke_attachment(
                &sim,
                &containers,
                "cnibpf",
                "ADD",
                0,
                &timed,
            )?);
            dels.push(invoke_attachment(
                &sim,
                &containers,
                "cnibpf",
                "DEL",
                0,
                &timed,
            )?);
        }
    }
    let [(normal_adds, normal_dels), (expedited_adds, expedited_dels)] = &runs;
    let (normal, expedited) = (
        "cnibpf, a pod with a hostPort beside another, RCU grace periods normal",
        "cnibpf, a pod with a hostPort beside another, RCU grace periods expedited (rcu_expedited=1)",
    );
    let mut rows = Vec::new();
    for (verb, metric, normal_runs, expedited_runs) in [
        ("ADD", "plugin ADD", normal_adds, expedited_adds),
        ("DEL", "plugin DEL", normal_dels, expedited_dels),
    ] {
        rows.push(Row {
            scenario: expedited.to_owned(),
            metric,
            unit: "ms",
            value: median_wall(expedited_runs),
            baseline: Some(("normal".to_owned(), median_wall(normal_runs))),
        });
        rows.extend(phase_rows(&format!("{normal}, {verb}"), normal_runs));
        rows.extend(phase_rows(&format!("{expedited}, {verb}"), expedited_runs));
    }
    Ok(rows)
}
