//! `cargo xtask bench portmap`: the hostPort datapath against plain routing to the container,
//! with 1 and 5,000 mappings installed, and the plugin's own ADD/DEL time at 1, 100 and 1,000
//! existing attachments.

use std::{
    net::{IpAddr, Ipv4Addr},
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use cnibpf_tests::{
    Netns, SimHost,
    chain::Attachment,
    topology::{HOST_UPLINK_ADDR, port_mappings},
    traffic::{EchoServer, connection_rate},
};
use serde_json::{Value, json};

use super::{
    Iperf3Server, Progress, Row,
    chart::{self, BarPanel},
    iperf3, median, write_report,
};

const ROUNDS: usize = 5;
const IPERF_SECONDS: u32 = 4;
const RATE_WINDOW: Duration = Duration::from_secs(3);
const RATE_CLIENTS: usize = 2;
const SCALE_LEVELS: [usize; 3] = [1, 100, 1_000];
const TIMED_CYCLES: usize = 15;

pub fn run(out_dir: &Path) -> Result<()> {
    let progress = Progress::new();
    let mut rows = datapath(&progress)?;
    rows.extend(plugin_time(&progress)?);
    let notes = vec![format!(
        "Medians of {ROUNDS} alternating rounds; iperf3 {IPERF_SECONDS} s single stream; connection rate: {RATE_CLIENTS} clients, \
         connect + 1-byte request/response + close, {} s windows. Baseline \"routed\": the outside client talks to the container \
         address directly, routed by the host (bridge, no NAT).",
        RATE_WINDOW.as_secs()
    )];
    let report = write_report(
        out_dir,
        "portmap",
        "cnibpf bench: port mapping",
        &rows,
        &notes,
    )?;
    let find = |scenario: &str, metric: &str| {
        rows.iter()
            .find(|row| row.scenario == scenario && row.metric == metric)
            .and_then(Row::ratio)
            .unwrap_or(f64::NAN)
    };
    let times: Vec<(String, f64)> = rows
        .iter()
        .filter(|row| row.metric.starts_with("plugin"))
        .map(|row| {
            (
                format!(
                    "{} {}",
                    row.metric.trim_start_matches("plugin "),
                    row.scenario.trim_end_matches(" existing attachments")
                ),
                row.value,
            )
        })
        .collect();
    chart::bars(
        &out_dir.join("portmap.png"),
        "cnibpf port mapping (eBPF backend)",
        &[
            BarPanel {
                title: "hostPort / routed without NAT (higher is better)",
                y_label: "ratio",
                bars: vec![
                    (
                        "throughput, 1 map".to_owned(),
                        find("hostPort, 1 mapping", "TCP throughput"),
                    ),
                    (
                        "throughput, 5000".to_owned(),
                        find("hostPort, 5,000 mappings", "TCP throughput"),
                    ),
                    (
                        "conn/s, 1 map".to_owned(),
                        find("hostPort, 1 mapping", "connection rate"),
                    ),
                    (
                        "conn/s, 5000".to_owned(),
                        find("hostPort, 5,000 mappings", "connection rate"),
                    ),
                ],
                reference: Some(1.0),
            },
            BarPanel {
                title: "plugin time, median (lower is better)",
                y_label: "ms",
                bars: times,
                reference: Some(3.0),
            },
        ],
    )?;
    progress.step(&format!("report: {} and portmap.png", report.display()));
    Ok(())
}

/// Throughput and connection rate through a hostPort against routing to the container.
fn datapath(progress: &Progress) -> Result<Vec<Row>> {
    progress.step("simulated host with one container (iperf3 and an echo server inside)");
    let sim = SimHost::new("bench-pm", json!({}));
    sim.outside.exec(&[
        "ip",
        "route",
        "add",
        "10.22.0.0/16",
        "via",
        &HOST_UPLINK_ADDR.to_string(),
    ]);
    let target = sim.container(
        "target",
        port_mappings(&[(8080, 5201, "tcp"), (8081, 7000, "tcp")]),
    );
    let _iperf = Iperf3Server::start(&target.netns, 5201)?;
    let _echo = EchoServer::start(&target.netns, target.socket(7000), 2);
    let routed = (target.socket(5201), target.socket(7000));
    let host_port = (sim.uplink_target(8080), sim.uplink_target(8081));

    let measure = |label: &str| -> Result<[Vec<f64>; 4]> {
        let mut samples: [Vec<f64>; 4] = Default::default();
        for round in 1..=ROUNDS {
            progress.step(&format!("{label}: round {round}/{ROUNDS}"));
            samples[0].push(iperf3(&sim.outside, routed.0, IPERF_SECONDS)?);
            samples[1].push(iperf3(&sim.outside, host_port.0, IPERF_SECONDS)?);
            samples[2].push(connection_rate(
                &sim.outside,
                routed.1,
                RATE_CLIENTS,
                RATE_WINDOW,
            ));
            samples[3].push(connection_rate(
                &sim.outside,
                host_port.1,
                RATE_CLIENTS,
                RATE_WINDOW,
            ));
        }
        Ok(samples)
    };
    let [routed_tput, nat_tput, routed_rate, nat_rate] = measure("1 mapping")?.map(median);
    if nat_rate == 0.0 || nat_tput == 0.0 {
        bail!("no traffic passed the hostPort");
    }

    progress.step("a second container with 5,000 hostPorts");
    let many: Vec<Value> = (20_000..25_000u16)
        .map(|port| json!({ "hostPort": port, "containerPort": 80, "protocol": "tcp" }))
        .collect();
    let _crowd = sim.container("crowd", json!({ "portMappings": many }));
    let [routed_tput_5k, nat_tput_5k, routed_rate_5k, nat_rate_5k] =
        measure("5,000 mappings")?.map(median);

    let row = |scenario: &str,
               metric: &'static str,
               unit: &'static str,
               value: f64,
               baseline: (&str, f64)| Row {
        scenario: scenario.to_owned(),
        metric,
        unit,
        value,
        baseline: Some((baseline.0.to_owned(), baseline.1)),
    };
    Ok(vec![
        row(
            "hostPort, 1 mapping",
            "TCP throughput",
            "Gbit/s",
            nat_tput,
            ("routed", routed_tput),
        ),
        row(
            "hostPort, 1 mapping",
            "connection rate",
            "conn/s",
            nat_rate,
            ("routed", routed_rate),
        ),
        row(
            "hostPort, 5,000 mappings",
            "TCP throughput",
            "Gbit/s",
            nat_tput_5k,
            ("routed", routed_tput_5k),
        ),
        row(
            "hostPort, 5,000 mappings",
            "connection rate",
            "conn/s",
            nat_rate_5k,
            ("routed", routed_rate_5k),
        ),
        row(
            "5,000 vs 1 mapping",
            "TCP throughput",
            "Gbit/s",
            nat_tput_5k,
            ("1 mapping", nat_tput),
        ),
        row(
            "5,000 vs 1 mapping",
            "connection rate",
            "conn/s",
            nat_rate_5k,
            ("1 mapping", nat_rate),
        ),
    ])
}

/// Median wall time of one cnibpf ADD and DEL (the plugin process alone) with 1, 100 and
/// 1,000 attachments already in place.
fn plugin_time(progress: &Progress) -> Result<Vec<Row>> {
    let sim = SimHost::new("bench-scale", json!({}));
    let containers = Netns::create("cbt-bench-scale-c");
    let max = SCALE_LEVELS[SCALE_LEVELS.len() - 1];
    progress.step(&format!(
        "{max} veth pairs for attachments made by cnibpf alone"
    ));
    let mut batch = String::new();
    for n in 0..=max {
        batch.push_str(&format!(
            "link add vb{n} address {} type veth peer name ec{n} address {} netns {}\nlink set vb{n} up\n",
            mac(0xaa, n),
            mac(0xbb, n),
            containers.name()
        ));
    }
    let mut ip = sim.host.command(&["ip", "-batch", "-"]);
    ip.stdin(std::process::Stdio::piped());
    let mut child = ip.spawn().context("ip -batch")?;
    std::io::Write::write_all(child.stdin.as_mut().context("stdin")?, batch.as_bytes())?;
    if !child.wait()?.success() {
        bail!("creating veth pairs failed");
    }

    let invoke = |command: &str, n: usize| -> Result<Duration> {
        let attachment = Attachment {
            container_id: format!("scale-{n}"),
            ifname: format!("ec{n}"),
            netns: containers.path(),
            capability_args: Value::Null,
        };
        let plugin = sim.chain.conflist()["plugins"][1].clone();
        let prev = json!({
            "cniVersion": "1.0.0",
            "interfaces": [
                { "name": format!("vb{n}"), "mac": mac(0xaa, n) },
                { "name": format!("ec{n}"), "mac": mac(0xbb, n), "sandbox": containers.path() }
            ],
            "ips": [{ "address": format!("{}/16", address(n)), "interface": 1 }]
        });
        let args = json!({ "portMappings": [{ "hostPort": 30_000 + n, "containerPort": 80 }] });
        let config = sim
            .chain
            .plugin_config(&plugin, "1.0.0", Some(&prev), &args);
        let started = Instant::now();
        let output = sim.invoke_cnibpf(command, Some(&attachment), &config.to_string());
        let elapsed = started.elapsed();
        if output.exit_code != 0 {
            bail!(
                "cnibpf {command} of attachment {n} failed: {}",
                output.stdout
            );
        }
        Ok(elapsed)
    };

    let mut rows = Vec::new();
    let version: Vec<f64> = (0..TIMED_CYCLES)
        .map(|_| {
            let started = Instant::now();
            sim.invoke_cnibpf("VERSION", None, "");
            started.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    let exec_floor = median(version);
    rows.push(Row {
        scenario: "process start (VERSION)".to_owned(),
        metric: "plugin VERSION",
        unit: "ms",
        value: exec_floor,
        baseline: None,
    });
    let mut existing = 0;
    let probe = max;
    for level in SCALE_LEVELS {
        progress.step(&format!("filling to {level} attachments"));
        while existing < level {
            invoke("ADD", existing)?;
            existing += 1;
        }
        progress.step(&format!(
            "{TIMED_CYCLES} timed ADD/DEL cycles at {level} attachments"
        ));
        let (mut adds, mut dels) = (Vec::new(), Vec::new());
        for _ in 0..TIMED_CYCLES {
            adds.push(invoke("ADD", probe)?.as_secs_f64() * 1e3);
            dels.push(invoke("DEL", probe)?.as_secs_f64() * 1e3);
        }
        let scenario = format!("{level} existing attachments");
        for (metric, samples) in [("plugin ADD", adds), ("plugin DEL", dels)] {
            rows.push(Row {
                scenario: scenario.clone(),
                metric,
                unit: "ms",
                value: median(samples),
                baseline: Some(("VERSION".to_owned(), exec_floor)),
            });
        }
    }
    Ok(rows)
}

fn mac(prefix: u8, n: usize) -> String {
    format!(
        "02:00:00:{prefix:02x}:{:02x}:{:02x}",
        (n >> 8) & 0xff,
        n & 0xff
    )
}

fn address(n: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(
        10,
        77,
        u8::try_from(n / 200).unwrap_or(255),
        u8::try_from(n % 200 + 2).unwrap_or(255),
    ))
}
