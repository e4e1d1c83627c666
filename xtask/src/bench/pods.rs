//! `cargo xtask bench pods`: pod start and teardown as kubelet sees them, through containerd's
//! CRI — RunPodSandbox until the sandbox is ready, StopPodSandbox + RemovePodSandbox — for a
//! pod with two hostPorts, with cnibpf (eBPF and nftables) against the reference chain (bridge
//! with ipMasq + portmap) in the same run: the first pod on a fresh host (cnibpf loads, pins
//! and hooks everything), then with 1 and 100 pods already running; and for eBPF the first pod
//! on a host whose datapath `cnibpf load` loaded, and the pod after the node's last one left.

use std::{path::Path, time::Instant};

use anyhow::{Context as _, Result};
use cnibpf_tests::{
    SimHost,
    cri::{Containerd, Cri, PodSandboxConfig, Protocol, host_port},
};
use serde_json::json;

use super::{
    Progress, Row,
    chart::{self, BarPanel},
    median, write_report,
};

const ROUNDS: usize = 7;
const RUNNING: [usize; 2] = [1, 100];

/// Milliseconds of one variant: the first pod's RunPodSandbox, then per number of running
/// pods the medians of RunPodSandbox and of Stop + Remove.
struct Times {
    first_run: f64,
    with_running: Vec<(usize, f64, f64)>,
}

fn milliseconds(started: Instant) -> f64 {
    started.elapsed().as_secs_f64() * 1e3
}

/// A pod with two TCP hostPorts derived from `slot`.
fn pod(cri: &Cri, name: &str, slot: usize) -> PodSandboxConfig {
    let base = i32::try_from(20_000 + 2 * slot).unwrap_or(i32::MAX);
    cri.pod_config(
        "bench",
        name,
        0,
        vec![
            host_port(Protocol::Tcp, 80, base, ""),
            host_port(Protocol::Tcp, 443, base + 1, ""),
        ],
    )
}

fn measure(sim: &SimHost, label: &str, progress: &Progress) -> Result<Times> {
    let containerd = Containerd::start(sim);
    let mut cri = containerd.client();
    progress.step(&format!("{label}: the first pod on a fresh host"));
    let started = Instant::now();
    cri.run_pod(pod(&cri, "first", 0))
        .with_context(|| format!("{label}: first RunPodSandbox\n{}", containerd.log()))?;
    let first_run = milliseconds(started);
    let mut running = 1;
    let mut with_running = Vec::new();
    for wanted in RUNNING {
        while running < wanted {
            cri.run_pod(pod(&cri, &format!("bg{running}"), running))
                .with_context(|| format!("{label}: RunPodSandbox of running pod {running}"))?;
            running += 1;
        }
        progress.step(&format!(
            "{label}: {ROUNDS} pods started and removed beside {running} running"
        ));
        let (mut runs, mut teardowns) = (Vec::new(), Vec::new());
        for round in 0..ROUNDS {
            let config = pod(&cri, &format!("probe{wanted}-{round}"), 500 + round);
            let started = Instant::now();
            let probe = cri
                .run_pod(config)
                .with_context(|| format!("{label}: RunPodSandbox"))?;
            runs.push(milliseconds(started));
            let started = Instant::now();
            cri.stop_pod(&probe.id)
                .and_then(|()| cri.remove_pod(&probe.id))
                .with_context(|| format!("{label}: StopPodSandbox + RemovePodSandbox"))?;
            teardowns.push(milliseconds(started));
        }
        with_running.push((running, median(runs), median(teardowns)));
    }
    Ok(Times {
        first_run,
        with_running,
    })
}

/// Milliseconds of the first pod's RunPodSandbox on a host whose datapath `cnibpf load` loaded
/// (node set-up, as `install --load` does), then of the next pod's after that pod was removed
/// (the node's last pod gone, its datapath left in place).
fn after_load(progress: &Progress) -> Result<(f64, f64)> {
    let sim = SimHost::new("bench-pl", json!({ "backend": "ebpf", "ipMasq": true }));
    progress.step("cnibpf eBPF: the first pod after `cnibpf load`, then one after it left");
    let pin_path = sim.pin_path.display().to_string();
    let loaded = sim.cnibpf(&["load", "--pin-path", &pin_path, "--backend", "ebpf"]);
    anyhow::ensure!(loaded.status.success(), "cnibpf load failed: {loaded:?}");
    let containerd = Containerd::start(&sim);
    let mut cri = containerd.client();
    let started = Instant::now();
    let first = cri
        .run_pod(pod(&cri, "loaded", 0))
        .with_context(|| format!("first RunPodSandbox after load\n{}", containerd.log()))?;
    let first_run = milliseconds(started);
    cri.stop_pod(&first.id)
        .and_then(|()| cri.remove_pod(&first.id))
        .context("StopPodSandbox + RemovePodSandbox of the only pod")?;
    let started = Instant::now();
    cri.run_pod(pod(&cri, "next", 1))
        .context("RunPodSandbox after the last pod left")?;
    Ok((first_run, milliseconds(started)))
}

pub fn run(out_dir: &Path) -> Result<()> {
    let progress = Progress::new();
    let (first_after_load, after_last) = after_load(&progress)?;
    let ebpf = measure(
        &SimHost::new("bench-pe", json!({ "backend": "ebpf", "ipMasq": true })),
        "cnibpf eBPF",
        &progress,
    )?;
    let nftables = measure(
        &SimHost::new("bench-pn", json!({ "backend": "nftables", "ipMasq": true })),
        "cnibpf nftables",
        &progress,
    )?;
    let reference = measure(
        &SimHost::with_reference_chain("bench-pr"),
        "reference (bridge ipMasq + portmap)",
        &progress,
    )?;
    let baseline = |value: f64| Some(("reference bridge ipMasq + portmap".to_owned(), value));
    let mut rows = Vec::new();
    rows.push(Row {
        scenario: "cnibpf eBPF: first pod after `cnibpf load`".to_owned(),
        metric: "RunPodSandbox",
        unit: "ms",
        value: first_after_load,
        baseline: baseline(reference.first_run),
    });
    rows.push(Row {
        scenario: "cnibpf eBPF: the pod after the node's last pod left".to_owned(),
        metric: "RunPodSandbox",
        unit: "ms",
        value: after_last,
        baseline: Some((
            "cnibpf eBPF beside 1 running pod".to_owned(),
            ebpf.with_running[0].1,
        )),
    });
    for (name, times) in [("cnibpf eBPF", &ebpf), ("cnibpf nftables", &nftables)] {
        rows.push(Row {
            scenario: format!("{name}: first pod on a fresh host"),
            metric: "RunPodSandbox",
            unit: "ms",
            value: times.first_run,
            baseline: baseline(reference.first_run),
        });
        for ((running, run, teardown), (_, reference_run, reference_teardown)) in
            times.with_running.iter().zip(&reference.with_running)
        {
            rows.push(Row {
                scenario: format!(
                    "{name}: {running} pod{} running",
                    if *running == 1 { "" } else { "s" }
                ),
                metric: "RunPodSandbox",
                unit: "ms",
                value: *run,
                baseline: baseline(*reference_run),
            });
            rows.push(Row {
                scenario: format!(
                    "{name}: {running} pod{} running",
                    if *running == 1 { "" } else { "s" }
                ),
                metric: "StopPodSandbox + RemovePodSandbox",
                unit: "ms",
                value: *teardown,
                baseline: baseline(*reference_teardown),
            });
        }
    }
    let notes = vec![format!(
        "containerd 1.6 (Debian) in the simulated host, its CRI driven over its socket as kubelet drives it; \
         each pod has two TCP hostPorts and masquerade. Wall time of the CRI calls, medians of {ROUNDS} pods \
         started and removed beside the running ones; the first pod is one measurement. Baseline: the \
         reference bridge plugin with ipMasq: true chained with the reference portmap (iptables), \
         measured in the same run."
    )];
    write_report(
        out_dir,
        "pods",
        "cnibpf bench: pods through containerd's CRI",
        &rows,
        &notes,
    )?;
    let bar = |label: &str, value: f64| (label.to_owned(), value);
    chart::bars(
        &out_dir.join("pods.png"),
        "pod start and teardown through containerd's CRI (ms, lower is better)",
        &[
            BarPanel {
                title: "RunPodSandbox",
                y_label: "ms",
                bars: vec![
                    bar("eBPF first", ebpf.first_run),
                    bar("eBPF first, loaded", first_after_load),
                    bar("eBPF after last", after_last),
                    bar("nft first", nftables.first_run),
                    bar("ref first", reference.first_run),
                    bar("eBPF @1", ebpf.with_running[0].1),
                    bar("nft @1", nftables.with_running[0].1),
                    bar("ref @1", reference.with_running[0].1),
                    bar("eBPF @100", ebpf.with_running[1].1),
                    bar("nft @100", nftables.with_running[1].1),
                    bar("ref @100", reference.with_running[1].1),
                ],
                reference: None,
            },
            BarPanel {
                title: "StopPodSandbox + RemovePodSandbox",
                y_label: "ms",
                bars: vec![
                    bar("eBPF @1", ebpf.with_running[0].2),
                    bar("nft @1", nftables.with_running[0].2),
                    bar("ref @1", reference.with_running[0].2),
                    bar("eBPF @100", ebpf.with_running[1].2),
                    bar("nft @100", nftables.with_running[1].2),
                    bar("ref @100", reference.with_running[1].2),
                ],
                reference: None,
            },
        ],
    )?;
    super::publish(out_dir, "pods", "./dev bench pods")?;
    Ok(())
}
