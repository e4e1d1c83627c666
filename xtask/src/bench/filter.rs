//! `cargo xtask bench filter`: TCP throughput and connection rate of containers whose filter
//! has 1, 16 and 256 rules, against a container without a filter, in one simulated host per
//! backend (eBPF, then nftables) in the same run.

use std::{net::SocketAddr, path::Path};

use anyhow::{Result, bail};
use cnibpf_tests::{
    Container, SimHost,
    topology::Family,
    traffic::{EchoServer, connection_rate},
};
use serde_json::{Value, json};

use super::{
    BpfStats, IPERF_SECONDS, Iperf3Server, Progress, RATE_CLIENTS, RATE_WINDOW, Row,
    chart::{self, BarPanel},
    in_turn, iperf3, median, write_report,
};

const ROUNDS: usize = 5;
/// Rule counts of the filtered containers (the unfiltered one is the baseline).
const RULE_COUNTS: [usize; 3] = [1, 16, 256];

/// `count` rules, default DROP, the only one that matches the bench's traffic last: the
/// others differ from it in the destination port alone, the last field a rule compares, so
/// that every new connection walks all of them.
pub(super) fn filter_keys(count: usize) -> Value {
    let mut rules: Vec<Value> = (1..count)
        .map(|index| {
            json!({ "index": index, "direction": "egress", "proto": "tcp",
                    "dst": "0.0.0.0/0", "dport": 20_000 + index, "target": "DROP" })
        })
        .collect();
    rules.push(json!({ "index": 1000, "direction": "egress", "proto": "tcp", "target": "ALLOW" }));
    json!({ "filterDefault": "DROP", "filter": rules })
}

pub fn run(out_dir: &Path) -> Result<()> {
    let progress = Progress::new();
    progress.step("a simulated host with 4 containers: no filter, 1, 16 and 256 rules");
    let sim = SimHost::new("bench-fl", json!({ "backend": "ebpf" }));
    let (containers, servers) = filtered_containers(&sim)?;
    let server = |port| SocketAddr::new(Family::V4.outside(), port);
    let stats = BpfStats::enable()?;
    let mut throughput = vec![Vec::new(); containers.len()];
    let mut cost = vec![Vec::new(); containers.len()];
    let mut connection_cost = vec![Vec::new(); containers.len()];
    let mut rate = vec![Vec::new(); containers.len()];
    // The containers alternate within each round, each first in turn, so that drift on this
    // noisy machine falls on all of them.
    for round in 1..=ROUNDS {
        for index in in_turn(round, containers.len()) {
            let (label, container) = &containers[index];
            progress.step(&format!("round {round}/{ROUNDS}: {label}"));
            let before = stats.programs(&sim.pin_path, &["from_container", "to_container"])?;
            throughput[index].push(iperf3(
                &container.netns,
                server(5201 + index as u16),
                IPERF_SECONDS,
            )?);
            let after = stats.programs(&sim.pin_path, &["from_container", "to_container"])?;
            if after.1 <= before.1 {
                bail!("no run of the container programs counted during iperf3 ({label})");
            }
            cost[index].push((after.0 - before.0) as f64 / (after.1 - before.1) as f64);
            let before = stats.programs(&sim.pin_path, &["from_container", "to_container"])?;
            rate[index].push(
                connection_rate(&container.netns, server(7000), RATE_CLIENTS, RATE_WINDOW)
                    .per_second,
            );
            let after = stats.programs(&sim.pin_path, &["from_container", "to_container"])?;
            if after.1 <= before.1 {
                bail!("no run of the container programs counted during the connections ({label})");
            }
            connection_cost[index].push((after.0 - before.0) as f64 / (after.1 - before.1) as f64);
        }
    }
    let throughput: Vec<f64> = throughput.into_iter().map(median).collect();
    let rate: Vec<f64> = rate.into_iter().map(median).collect();
    let cost: Vec<f64> = cost.into_iter().map(median).collect();
    let connection_cost: Vec<f64> = connection_cost.into_iter().map(median).collect();
    drop(stats);
    if throughput.contains(&0.0) || rate.contains(&0.0) {
        bail!("no traffic passed a filter");
    }
    let mut rows = Vec::new();
    for (index, (label, _)) in containers.iter().enumerate() {
        for (metric, unit, values) in [
            ("TCP throughput", "Gbit/s", &throughput),
            ("connection rate", "conn/s", &rate),
        ] {
            rows.push(Row {
                scenario: label.clone(),
                metric,
                unit,
                value: values[index],
                baseline: Some(("no filter".to_owned(), values[0])),
            });
        }
    }
    for (index, (label, _)) in containers.iter().enumerate() {
        for (metric, values) in [
            ("datapath time per packet during the throughput run", &cost),
            (
                "datapath time per packet during the connection-rate run",
                &connection_cost,
            ),
        ] {
            rows.push(Row {
                scenario: label.clone(),
                metric,
                unit: "ns",
                value: values[index],
                baseline: Some(("no filter".to_owned(), values[0])),
            });
        }
    }
    // The targets compare 256 rules with 1 rule.
    for (metric, unit, values) in [
        ("TCP throughput", "Gbit/s", &throughput),
        ("connection rate", "conn/s", &rate),
        (
            "datapath time per packet during the throughput run",
            "ns",
            &cost,
        ),
        (
            "datapath time per packet during the connection-rate run",
            "ns",
            &connection_cost,
        ),
    ] {
        rows.push(Row {
            scenario: "256 rules vs 1 rule".to_owned(),
            metric,
            unit,
            value: values[3],
            baseline: Some(("1 rule".to_owned(), values[1])),
        });
    }
    let notes = vec![format!(
        "Medians of {ROUNDS} alternating rounds, container → a server in the outside namespace, routed \
         (no NAT). iperf3 {IPERF_SECONDS} s, one stream; connection rate: {RATE_CLIENTS} clients, \
         connect + 1-byte request/response + close, {} s windows. Filters: filterDefault DROP, the \
         ALLOW for the traffic last, after rules that differ from it only in the destination port \
         (each new connection walks every rule). Targets: throughput at 256 rules ≥ 0.97× of 1 rule \
         (later packets take the verdict cached with their connection), connection rate ≥ 0.9×. \
         Datapath time per packet: run time over run count of from_container and to_container \
         (kernel.bpf_stats_enabled) while the container's iperf3 or connections run alone — the cost \
         the filter adds, without the machine's throughput noise.",
        RATE_WINDOW.as_secs()
    ), "A rule by network: two eBPF containers, filterDefault DROP, one rule allowing their TCP by \
        their own subnet (`src`) or by their own network (`srcNetwork`: one lookup of the source in \
        network_members once the rest of the rule matched); datapath time per packet while each \
        opens connections, medians of alternating rounds. Target: at most one hash lookup (about \
        20 ns) on a connection's first packet, spread over its packets.".to_owned()];
    drop(servers);
    drop(containers);
    drop(sim);
    rows.extend(drop_counting_rows(&progress)?);
    rows.extend(network_rule_rows(&progress)?);
    let nftables = nftables_rows(&progress)?;
    rows.extend(nftables.0);
    let report = write_report(out_dir, "filter", "cnibpf bench: filter", &rows, &notes)?;
    let panel = |title, values: &Vec<f64>| BarPanel {
        title,
        y_label: "ratio",
        bars: LABELS
            .iter()
            .zip(values)
            .map(|(label, value)| ((*label).to_owned(), value / values[0]))
            .collect(),
        reference: Some(1.0),
    };
    chart::bars(
        &out_dir.join("filter.png"),
        "cnibpf filter / no filter (higher is better)",
        &[
            panel("eBPF: TCP throughput", &throughput),
            panel("eBPF: connection rate", &rate),
            panel("nftables: TCP throughput", &nftables.1),
            panel("nftables: connection rate", &nftables.2),
        ],
    )?;
    let published = super::publish(out_dir, "filter", "./dev bench filter")?;
    progress.step(&format!(
        "report: {} and filter.png{}",
        report.display(),
        if published {
            ", published to docs/"
        } else {
            ""
        }
    ));
    Ok(())
}

/// The commit before the datapath counted its drops by reason (`drop_stats`, the event
/// budget): the baseline of what counting costs.
const BEFORE_DROP_COUNTING: &str = "fd7ba15";
/// The port a filtered container's flood is dropped at.
const DROPPED_PORT: u16 = 9;

/// What counting drops costs per packet, this build against the one before it in the same run:
/// one filtered container on each (a DROP rule for UDP to port 9, everything else allowed), the
/// datapath's time per packet while the container uploads (packets that go on) and while it
/// floods port 9 (packets dropped), rounds alternating between the two builds.
fn drop_counting_rows(progress: &Progress) -> Result<Vec<Row>> {
    progress.step(&format!(
        "drop counting: building cnibpf of {BEFORE_DROP_COUNTING} (once)"
    ));
    let before = cnibpf_tests::history::cnibpf_of(BEFORE_DROP_COUNTING);
    let this = cnibpf_tests::topology::cnibpf_binary();
    let keys = json!({
        "backend": "ebpf",
        "filter": [
            { "index": 1, "direction": "egress", "proto": "udp", "dport": DROPPED_PORT, "target": "DROP" },
        ],
    });
    let mut builds = Vec::new();
    for (id, binary) in [("bench-dcb", &before), ("bench-dcn", &this)] {
        // SAFETY: the bench runs one thread that reads the environment, this one.
        unsafe { std::env::set_var("CNIBPF_BIN", binary) };
        let sim = SimHost::new(id, keys.clone());
        sim.route_outside_to_containers();
        let container = sim.container("c", Value::Null);
        let iperf = Iperf3Server::start(&sim.outside, 5201)?;
        builds.push((sim, container, iperf));
    }
    // SAFETY: as above.
    unsafe { std::env::set_var("CNIBPF_BIN", &this) };
    let stats = BpfStats::enable()?;
    let mut passed = [Vec::new(), Vec::new()];
    let mut dropped = [Vec::new(), Vec::new()];
    for round in 1..=ROUNDS {
        for index in in_turn(round, builds.len()) {
            let (sim, container, _) = &builds[index];
            let label = if index == 0 {
                BEFORE_DROP_COUNTING
            } else {
                "this build"
            };
            progress.step(&format!("drop counting round {round}/{ROUNDS}: {label}"));
            let before = stats.programs(&sim.pin_path, &["from_container", "to_container"])?;
            iperf3(
                &container.netns,
                SocketAddr::new(Family::V4.outside(), 5201),
                IPERF_SECONDS,
            )?;
            let after = stats.programs(&sim.pin_path, &["from_container", "to_container"])?;
            if after.1 <= before.1 {
                bail!("no run of the container programs counted during iperf3 ({label})");
            }
            passed[index].push((after.0 - before.0) as f64 / (after.1 - before.1) as f64);
            let before = stats.programs(&sim.pin_path, &["from_container"])?;
            flood(container, std::time::Duration::from_secs(2));
            let after = stats.programs(&sim.pin_path, &["from_container"])?;
            if after.1 <= before.1 {
                bail!("no run of from_container counted during the flood ({label})");
            }
            dropped[index].push((after.0 - before.0) as f64 / (after.1 - before.1) as f64);
        }
    }
    drop(stats);
    let [passed_before, passed_now] = passed.map(median);
    let [dropped_before, dropped_now] = dropped.map(median);
    let baseline = |value| {
        Some((
            format!("{BEFORE_DROP_COUNTING}, before drop counting"),
            value,
        ))
    };
    Ok(vec![
        Row {
            scenario: "drop counting, a packet that goes on (1 rule, TCP upload)".to_owned(),
            metric: "datapath time per packet, this build",
            unit: "ns",
            value: passed_now,
            baseline: baseline(passed_before),
        },
        Row {
            scenario: format!(
                "drop counting, a packet dropped by a rule (UDP flood to port {DROPPED_PORT})"
            ),
            metric: "from_container time per packet, this build",
            unit: "ns",
            value: dropped_now,
            baseline: baseline(dropped_before),
        },
    ])
}

/// What naming a network costs a rule: two containers whose filter (default DROP) allows their
/// TCP by one rule, by their own subnet (`src`) or by their own network (`srcNetwork`), the
/// datapath's time per packet while each opens connections (every connection's first packet
/// walks the rule), rounds alternating between them.
fn network_rule_rows(progress: &Progress) -> Result<Vec<Row>> {
    progress.step("a rule by network: two containers, src and srcNetwork");
    let sim = SimHost::new("bench-flnet", json!({ "backend": "ebpf" }));
    sim.route_outside_to_containers();
    let rule = |matches: Value| {
        let mut rule =
            json!({ "index": 1, "direction": "egress", "proto": "tcp", "target": "ALLOW" });
        for (key, value) in matches.as_object().into_iter().flatten() {
            rule[key] = value.clone();
        }
        json!({ "filterDefault": "DROP", "filter": [rule] })
    };
    let mut containers = Vec::new();
    for (name, keys) in [
        (
            "src",
            rule(json!({ "src": cnibpf_tests::topology::SUBNET })),
        ),
        ("net", rule(json!({ "srcNetwork": sim.network() }))),
    ] {
        let container = sim.container(name, Value::Null);
        sim.readd_with(&container, keys)
            .map_err(|error| anyhow::anyhow!("the {name} rule: {error}"))?;
        containers.push(container);
    }
    let _echo = EchoServer::start(&sim.outside, Family::V4.any(7000), 2);
    let stats = BpfStats::enable()?;
    let mut cost = [Vec::new(), Vec::new()];
    let mut rate = [Vec::new(), Vec::new()];
    for round in 1..=ROUNDS {
        for index in in_turn(round, containers.len()) {
            let container = &containers[index];
            progress.step(&format!("rule by network round {round}/{ROUNDS}: {index}"));
            let before = stats.programs(&sim.pin_path, &["from_container", "to_container"])?;
            let server = SocketAddr::new(Family::V4.outside(), 7000);
            rate[index].push(
                connection_rate(&container.netns, server, RATE_CLIENTS, RATE_WINDOW).per_second,
            );
            let after = stats.programs(&sim.pin_path, &["from_container", "to_container"])?;
            if after.1 <= before.1 || rate[index].last() == Some(&0.0) {
                bail!("no connection passed the rule by network bench's filter ({index})");
            }
            cost[index].push((after.0 - before.0) as f64 / (after.1 - before.1) as f64);
        }
    }
    let [by_src, by_network] = cost.map(median);
    let [rate_src, rate_network] = rate.map(median);
    let baseline = |value| Some(("1 src rule".to_owned(), value));
    Ok(vec![
        Row {
            scenario: "1 srcNetwork rule vs 1 src rule".to_owned(),
            metric: "datapath time per packet during the connection-rate run",
            unit: "ns",
            value: by_network,
            baseline: baseline(by_src),
        },
        Row {
            scenario: "1 srcNetwork rule vs 1 src rule".to_owned(),
            metric: "connection rate",
            unit: "conn/s",
            value: rate_network,
            baseline: baseline(rate_src),
        },
    ])
}

/// Sends UDP datagrams from `container` to the outside's port [`DROPPED_PORT`] for `length`.
fn flood(container: &Container, length: std::time::Duration) {
    let target = SocketAddr::new(Family::V4.outside(), DROPPED_PORT);
    container.netns.run(move || {
        let socket = std::net::UdpSocket::bind("0.0.0.0:0").expect("bind");
        let until = std::time::Instant::now() + length;
        while std::time::Instant::now() < until {
            for _ in 0..256 {
                // A send the kernel refuses (its queue full) is one less packet, not a failure.
                let _ = socket.send_to(&[0u8; 64], target);
            }
        }
    });
}

/// Labels of the four containers, in order.
const LABELS: [&str; 4] = ["no filter", "1 rule", "16 rules", "256 rules"];

/// The outside servers the containers talk to: one iperf3 server each (5201 on) and an echo
/// server (7000).
type Servers = (Vec<Iperf3Server>, EchoServer);

/// The four containers of `sim` (no filter, then the `RULE_COUNTS` filters), and their servers.
fn filtered_containers(sim: &SimHost) -> Result<(Vec<(String, Container)>, Servers)> {
    sim.route_outside_to_containers();
    let mut containers: Vec<(String, Container)> =
        vec![(LABELS[0].to_owned(), sim.container("c0", Value::Null))];
    for (count, label) in RULE_COUNTS.into_iter().zip(&LABELS[1..]) {
        let container = sim.container(&format!("c{count}"), Value::Null);
        sim.readd_with(&container, filter_keys(count))
            .map_err(|error| anyhow::anyhow!("filter of {count} rules: {error}"))?;
        containers.push(((*label).to_owned(), container));
    }
    let iperf = (0..containers.len())
        .map(|index| Iperf3Server::start(&sim.outside, 5201 + index as u16))
        .collect::<Result<_>>()?;
    let echo = EchoServer::start(&sim.outside, Family::V4.any(7000), 2);
    Ok((containers, (iperf, echo)))
}

/// The same containers and traffic with the nftables backend: rows against its own unfiltered
/// container, and the medians (throughput, connection rate) per container.
fn nftables_rows(progress: &Progress) -> Result<(Vec<Row>, Vec<f64>, Vec<f64>)> {
    progress.step("nftables backend: the same 4 containers");
    let sim = SimHost::new("bench-fln", json!({ "backend": "nftables" }));
    let (containers, _servers) = filtered_containers(&sim)?;
    let server = |port| SocketAddr::new(Family::V4.outside(), port);
    let mut throughput = vec![Vec::new(); containers.len()];
    let mut rate = vec![Vec::new(); containers.len()];
    for round in 1..=ROUNDS {
        for index in in_turn(round, containers.len()) {
            let (label, container) = &containers[index];
            progress.step(&format!("nftables round {round}/{ROUNDS}: {label}"));
            throughput[index].push(iperf3(
                &container.netns,
                server(5201 + index as u16),
                IPERF_SECONDS,
            )?);
            rate[index].push(
                connection_rate(&container.netns, server(7000), RATE_CLIENTS, RATE_WINDOW)
                    .per_second,
            );
        }
    }
    let throughput: Vec<f64> = throughput.into_iter().map(median).collect();
    let rate: Vec<f64> = rate.into_iter().map(median).collect();
    if throughput.contains(&0.0) || rate.contains(&0.0) {
        bail!("no traffic passed an nftables filter");
    }
    let mut rows = Vec::new();
    for (index, label) in LABELS.iter().enumerate() {
        for (metric, unit, values) in [
            ("TCP throughput", "Gbit/s", &throughput),
            ("connection rate", "conn/s", &rate),
        ] {
            rows.push(Row {
                scenario: format!("nftables backend, {label}"),
                metric,
                unit,
                value: values[index],
                baseline: Some(("nftables, no filter".to_owned(), values[0])),
            });
        }
    }
    for (metric, unit, values) in [
        ("TCP throughput", "Gbit/s", &throughput),
        ("connection rate", "conn/s", &rate),
    ] {
        rows.push(Row {
            scenario: "nftables backend, 256 rules vs 1 rule".to_owned(),
            metric,
            unit,
            value: values[3],
            baseline: Some(("nftables, 1 rule".to_owned(), values[1])),
        });
    }
    Ok((rows, throughput, rate))
}
