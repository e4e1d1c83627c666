//! The plugin's own time: ADD and DEL at many existing attachments and many mappings, the\n//! first ADD after a load, the phases of a call, a metrics scrape — beside the reference\n//! portmap's.

use std::{
    net::{IpAddr, Ipv4Addr},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use cnibpf_tests::{
    Netns, SimHost,
    chain::{Attachment, PluginOutput, plugin_process, run_with_stdin},
    topology::cni_path,
};
use serde_json::{Value, json};

use super::{MAPPING_CYCLES, TIMED_CYCLES};
use crate::bench::{Progress, Row, median};
/// Median wall time of one ADD and DEL of the plugin chained after the bridge (that plugin
/// alone) with `levels` attachments already in place.
pub(super) fn plugin_time(
    progress: &Progress,
    sim: &SimHost,
    plugin_type: &str,
    label: &str,
    levels: &[usize],
) -> Result<Vec<Row>> {
    // The attachments filling the host share one namespace (a thousand namespaces would cost
    // more to make and remove than the measurement); the timed ones, the first and the probe,
    // have one each, as a pod has: what the plugin reads in a pod's namespace is a pod's.
    let fillers = Netns::create(&format!("cbt-{}-c", sim.id));
    let first_pod = Netns::create(&format!("cbt-{}-f", sim.id));
    let probe_pod = Netns::create(&format!("cbt-{}-p", sim.id));
    let max = levels[levels.len() - 1];
    progress.step(&format!(
        "{label}: {max} veth pairs for attachments made by the plugin alone"
    ));
    veth_pairs(sim, &first_pod, 0..1)?;
    veth_pairs(sim, &fillers, 1..max)?;
    veth_pairs(sim, &probe_pod, max..max + 1)?;
    let netns_of = |n: usize| match n {
        0 => &first_pod,
        n if n == max => &probe_pod,
        _ => &fillers,
    };

    let invoke = |command: &str, n: usize| -> Result<Timed> {
        let args = json!({ "portMappings": [{ "hostPort": 30_000 + n, "containerPort": 80, "protocol": "tcp" }] });
        invoke_attachment(sim, netns_of(n), plugin_type, command, n, &args)
    };
    // The common pod: no hostPorts, no filter (cnibpf hooks only what it sends).
    let invoke_plain = |command: &str, n: usize| -> Result<Timed> {
        invoke_attachment(sim, netns_of(n), plugin_type, command, n, &json!({}))
    };

    let mut rows = Vec::new();
    let version: Vec<f64> = (0..TIMED_CYCLES)
        .map(|_| {
            let process = plugin_process(&cni_path(), plugin_type, "VERSION", None);
            let (_, wall) = spawn_timed(sim, process, plugin_type, "VERSION", String::new());
            wall.as_secs_f64() * 1e3
        })
        .collect();
    let exec_floor = median(version);
    rows.push(Row {
        scenario: format!("{label}, process start"),
        metric: "plugin VERSION",
        unit: "ms",
        value: exec_floor,
        baseline: None,
    });
    // The first ADD on this host: the datapath is loaded, verified and hooked (eBPF), or the
    // table made (nftables).
    let first = invoke("ADD", 0)?;
    rows.push(Row {
        scenario: format!("{label}, the first ADD on a fresh host"),
        metric: "plugin ADD",
        unit: "ms",
        value: first.wall.as_secs_f64() * 1e3,
        baseline: None,
    });
    rows.extend(phase_rows(
        &format!("{label}, the first ADD on a fresh host"),
        std::slice::from_ref(&first),
    ));
    let mut existing = 1;
    let probe = max;
    for &level in levels {
        progress.step(&format!("filling to {level} attachments"));
        while existing < level {
            invoke("ADD", existing)?;
            existing += 1;
        }
        ensure_installed(sim, plugin_type, level)?;
        progress.step(&format!(
            "{TIMED_CYCLES} timed ADD/DEL cycles at {level} attachments"
        ));
        rows.extend(add_del_rows(
            &format!("{label}, {level} existing attachments"),
            TIMED_CYCLES,
            |command| invoke(command, probe),
            Some(("VERSION".to_owned(), exec_floor)),
        )?);
        if plugin_type == "cnibpf" {
            progress.step(&format!(
                "{TIMED_CYCLES} scrapes of /metrics at {level} attachments"
            ));
            rows.push(Row {
                scenario: format!("{label}, {level} existing attachments"),
                metric: "a scrape of /metrics",
                unit: "ms",
                value: scrape_time(sim)?,
                baseline: None,
            });
        }
    }
    if plugin_type == "cnibpf" {
        progress.step(&format!(
            "{TIMED_CYCLES} timed ADD/DEL cycles of a pod without hostPorts at {max} attachments"
        ));
        rows.extend(add_del_rows(
            &format!("{label}, a pod without hostPorts, {max} existing attachments"),
            TIMED_CYCLES,
            |command| invoke_plain(command, probe),
            Some(("VERSION".to_owned(), exec_floor)),
        )?);
    }
    Ok(rows)
}

/// The median wall time of a scrape of `cnibpf metrics` serving `sim`'s instance, as
/// Prometheus would make it (OpenMetrics asked for), request to last byte.
pub(super) fn scrape_time(sim: &SimHost) -> Result<f64> {
    let endpoint = cnibpf_tests::observe::Endpoint::metrics(sim, &[]);
    let netns = Netns::at(&sim.host.path());
    let address = endpoint.address;
    let times = (0..TIMED_CYCLES)
        .map(|_| {
            netns.run(move || -> Result<f64> {
                use std::io::{Read as _, Write as _};
                let started = Instant::now();
                let mut stream = std::net::TcpStream::connect(address)?;
                stream.write_all(
                    b"GET /metrics HTTP/1.0\r\nAccept: application/openmetrics-text; version=1.0.0\r\n\r\n",
                )?;
                let mut answer = String::new();
                stream.read_to_string(&mut answer)?;
                // HTTP/1.0 asked, HTTP/1.0 answered: the server closes after the body.
                let status = answer.lines().next().unwrap_or_default();
                if !status.ends_with(" 200 OK") || !answer.contains("cnibpf_attachments") {
                    bail!("the scrape failed: {answer}");
                }
                Ok(started.elapsed().as_secs_f64() * 1e3)
            })
        })
        .collect::<Result<Vec<f64>>>()?;
    Ok(median(times))
}

/// The plugin alone (`plugin_type`, configured as `sim`'s chain configures it) run for
/// attachment `n` (veth `vb<n>`/`ec<n>` made beforehand), with `args` as its capability
/// arguments; its wall time and the phases cnibpf reports.
pub(super) fn invoke_attachment(
    sim: &SimHost,
    containers: &Netns,
    plugin_type: &str,
    command: &str,
    n: usize,
    args: &Value,
) -> Result<Timed> {
    let attachment = Attachment {
        container_id: format!("scale-{n}"),
        ifname: format!("ec{n}"),
        netns: containers.path(),
        capability_args: Value::Null,
        cni_args: String::new(),
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
    let config = sim.chain.plugin_config(&plugin, "1.0.0", Some(&prev), args);
    let mut process = plugin_process(&cni_path(), plugin_type, command, Some(&attachment));
    process.env(PHASES_ENV, "1");
    let (output, wall) = spawn_timed(sim, process, plugin_type, command, config.to_string());
    if output.exit_code != 0 {
        bail!(
            "{plugin_type} {command} of attachment {n} failed: {}",
            output.stdout
        );
    }
    Ok(Timed {
        wall,
        phases: phases_of(&output.stderr),
    })
}

/// Runs `process` from a thread in `sim`'s host namespace, as a runtime runs a plugin (spawned
/// without a `pre_exec` step, see `plugin_process`): its output, and the wall time from spawn
/// to exit with its stdin written and its output read.
pub(super) fn spawn_timed(
    sim: &SimHost,
    process: std::process::Command,
    plugin_type: &str,
    command: &str,
    stdin: String,
) -> (PluginOutput, Duration) {
    let (plugin_type, command) = (plugin_type.to_owned(), command.to_owned());
    sim.host.run(move || {
        let started = Instant::now();
        let output = run_with_stdin(process, &plugin_type, &command, &stdin);
        (output, started.elapsed())
    })
}

/// What cnibpf reports of its phases when asked (`CNIBPF_PHASES=1`, see `cnibpf/src/phases.rs`).
pub(super) const PHASES_ENV: &str = "CNIBPF_PHASES";

/// One plugin run: its wall time, and where cnibpf says the time went (in ms; empty for
/// another plugin).
pub(super) struct Timed {
    wall: Duration,
    phases: Vec<(String, f64)>,
}

/// The median wall time of `runs`, in ms.
pub(super) fn median_wall(runs: &[Timed]) -> f64 {
    median(
        runs.iter()
            .map(|run| run.wall.as_secs_f64() * 1e3)
            .collect(),
    )
}

/// The phases of cnibpf's report line: `cnibpf: ADD phases (ms): decode 0.21, …, total 4.10`.
pub(super) fn phases_of(stderr: &str) -> Vec<(String, f64)> {
    let Some(line) = stderr.lines().find(|line| line.contains(" phases (ms): ")) else {
        return Vec::new();
    };
    let Some((_, list)) = line.split_once(" phases (ms): ") else {
        return Vec::new();
    };
    list.split(", ")
        .filter_map(|phase| {
            let (name, ms) = phase.rsplit_once(' ')?;
            Some((name.to_owned(), ms.parse().ok()?))
        })
        .filter(|(name, _)| name != "total")
        .collect()
}

/// Veth pairs `vb<n>` (in `sim`'s host, up) / `ec<n>` (in `containers`) for n in `numbers`:
/// the interfaces of attachments the plugin makes alone.
pub(super) fn veth_pairs(
    sim: &SimHost,
    containers: &Netns,
    numbers: std::ops::Range<usize>,
) -> Result<()> {
    let mut batch = String::new();
    for n in numbers {
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
    Ok(())
}

/// Node set-up ahead of the first pod (`cnibpf load`, what the DaemonSet's `install --load`
/// does) on a fresh host: the load's wall time, then the host's first ADD and its phases.
pub(super) fn first_add_after_load(progress: &Progress) -> Result<Vec<Row>> {
    progress.step("cnibpf load on a fresh host, then its first ADD");
    let sim = SimHost::new("bench-load", json!({ "backend": "ebpf" }));
    let containers = Netns::create(&format!("cbt-{}-c", sim.id));
    veth_pairs(&sim, &containers, 0..2)?;
    let pin_path = sim.pin_path.display().to_string();
    let started = Instant::now();
    let loaded = sim.cnibpf(&["load", "--pin-path", &pin_path, "--backend", "ebpf"]);
    let load = started.elapsed();
    if !loaded.status.success() {
        bail!("cnibpf load failed: {loaded:?}");
    }
    let args =
        json!({ "portMappings": [{ "hostPort": 30_000, "containerPort": 80, "protocol": "tcp" }] });
    let second =
        json!({ "portMappings": [{ "hostPort": 30_001, "containerPort": 80, "protocol": "tcp" }] });
    let first = invoke_attachment(&sim, &containers, "cnibpf", "ADD", 0, &args)?;
    invoke_attachment(&sim, &containers, "cnibpf", "DEL", 0, &args)?;
    progress.step(&format!(
        "{TIMED_CYCLES} rounds: the ADD after the node's last pod left, then one beside it"
    ));
    let (mut after_last, mut beside) = (Vec::new(), Vec::new());
    for _ in 0..TIMED_CYCLES {
        after_last.push(invoke_attachment(
            &sim,
            &containers,
            "cnibpf",
            "ADD",
            0,
            &args,
        )?);
        beside.push(invoke_attachment(
            &sim,
            &containers,
            "cnibpf",
            "ADD",
            1,
            &second,
        )?);
        invoke_attachment(&sim, &containers, "cnibpf", "DEL", 1, &second)?;
        invoke_attachment(&sim, &containers, "cnibpf", "DEL", 0, &args)?;
    }
    let scenario = "cnibpf, the first ADD after `cnibpf load`";
    let mut rows = vec![
        Row {
            scenario: "cnibpf, `cnibpf load` on a fresh host (node set-up)".to_owned(),
            metric: "cnibpf load",
            unit: "ms",
            value: load.as_secs_f64() * 1e3,
            baseline: None,
        },
        Row {
            scenario: scenario.to_owned(),
            metric: "plugin ADD",
            unit: "ms",
            value: first.wall.as_secs_f64() * 1e3,
            baseline: None,
        },
        Row {
            scenario: "cnibpf, the ADD after the node's last pod left (vs an ADD beside a pod)"
                .to_owned(),
            metric: "plugin ADD",
            unit: "ms",
            value: median_wall(&after_last),
            baseline: Some(("beside a pod".to_owned(), median_wall(&beside))),
        },
    ];
    rows.extend(phase_rows(scenario, std::slice::from_ref(&first)));
    Ok(rows)
}

/// ADD and DEL of one pod with `count` UDP hostPorts (a media server's port range), for each
/// of `counts`: what one attachment's size costs.
pub(super) fn mapping_count_time(
    progress: &Progress,
    sim: &SimHost,
    plugin_type: &str,
    label: &str,
    counts: &[usize],
) -> Result<Vec<Row>> {
    let containers = Netns::create(&format!("cbt-{}-m", sim.id));
    // Pod 0 is measured; pod 1 stays, as on any node, so that pod 0's DEL is never the last.
    veth_pairs(sim, &containers, 0..2)?;
    let keeper =
        json!({ "portMappings": [{ "hostPort": 19_999, "containerPort": 80, "protocol": "tcp" }] });
    invoke_attachment(sim, &containers, plugin_type, "ADD", 1, &keeper)?;
    let mut rows = Vec::new();
    for &count in counts {
        progress.step(&format!(
            "{label}: {MAPPING_CYCLES} ADD/DEL cycles of one pod with {count} hostPorts"
        ));
        let mappings: Vec<Value> = (0..count)
            .map(|n| json!({ "hostPort": 20_000 + n, "containerPort": 20_000 + n, "protocol": "udp" }))
            .collect();
        let args = json!({ "portMappings": mappings });
        rows.extend(add_del_rows(
            &format!("{label}, one pod with {count} hostPorts"),
            MAPPING_CYCLES,
            |command| invoke_attachment(sim, &containers, plugin_type, command, 0, &args),
            None,
        )?);
    }
    Ok(rows)
}

/// The median wall times of `cycles` ADD-then-DEL runs of `invoke`, as the rows "plugin ADD"
/// and "plugin DEL" of `scenario`.
pub(super) fn add_del_rows(
    scenario: &str,
    cycles: usize,
    mut invoke: impl FnMut(&str) -> Result<Timed>,
    baseline: Option<(String, f64)>,
) -> Result<Vec<Row>> {
    let (mut adds, mut dels) = (Vec::new(), Vec::new());
    for _ in 0..cycles {
        adds.push(invoke("ADD")?);
        dels.push(invoke("DEL")?);
    }
    let mut rows = Vec::new();
    for (verb, metric, runs) in [("ADD", "plugin ADD", adds), ("DEL", "plugin DEL", dels)] {
        rows.push(Row {
            scenario: scenario.to_owned(),
            metric,
            unit: "ms",
            value: median_wall(&runs),
            baseline: baseline.clone(),
        });
        rows.extend(phase_rows(&format!("{scenario}, {verb}"), &runs));
    }
    Ok(rows)
}

/// The median of each phase cnibpf reported over `runs`, as rows "plugin phase" of
/// `<scenario>: <phase>`, and what the process spent outside them (start, exit).
pub(super) fn phase_rows(scenario: &str, runs: &[Timed]) -> Vec<Row> {
    let Some(first) = runs.first() else {
        return Vec::new();
    };
    let mut rows: Vec<Row> = first
        .phases
        .iter()
        .map(|(name, _)| Row {
            scenario: format!("{scenario}: {name}"),
            metric: "plugin phase",
            unit: "ms",
            value: median(
                runs.iter()
                    .filter_map(|run| {
                        run.phases
                            .iter()
                            .find(|(held, _)| held == name)
                            .map(|(_, ms)| *ms)
                    })
                    .collect(),
            ),
            baseline: None,
        })
        .collect();
    if !first.phases.is_empty() {
        rows.push(Row {
            scenario: format!("{scenario}: process start and exit"),
            metric: "plugin phase",
            unit: "ms",
            value: median(
                runs.iter()
                    .map(|run| {
                        run.wall.as_secs_f64() * 1e3
                            - run.phases.iter().map(|(_, ms)| ms).sum::<f64>()
                    })
                    .collect(),
            ),
            baseline: None,
        });
    }
    rows
}

/// Guards the timings against a plugin that answered ADD without doing anything: the mapping
/// of the last attachment added must be in place.
pub(super) fn ensure_installed(sim: &SimHost, plugin_type: &str, level: usize) -> Result<()> {
    let port_number = u64::try_from(30_000 + level - 1)?;
    let port = port_number.to_string();
    let installed = if plugin_type == "portmap" {
        sim.host
            .exec(&["iptables-save", "-t", "nat"])
            .contains(&format!("--dport {port}"))
    } else {
        let inspect = sim.inspect();
        inspect["attachments"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|attachment| {
                attachment["portMappings"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .any(|mapping| mapping["hostPort"].as_u64() == Some(port_number))
    };
    if !installed {
        bail!("{plugin_type} reported success but hostPort {port} is not installed");
    }
    Ok(())
}

pub(super) fn mac(prefix: u8, n: usize) -> String {
    format!(
        "02:00:00:{prefix:02x}:{:02x}:{:02x}",
        (n >> 8) & 0xff,
        n & 0xff
    )
}

pub(super) fn address(n: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(
        10,
        77,
        u8::try_from(n / 200).unwrap_or(255),
        u8::try_from(n % 200 + 2).unwrap_or(255),
    ))
}
