//! `cargo xtask bench packets`: what the eBPF datapath costs per packet on each path an
//! operator pays for — masquerade and its replies, DNAT to a hostPort and its replies, a filter
//! of 1 and 256 rules — and the forwarding-bound loads, for this build beside the last release
//! `releases.toml` lists, in one run whose rounds alternate between the two. Where the time
//! goes: the same hooks on packets that miss every lookup and are left to the host stack, the
//! prices of the lookups and helper calls a packet makes (`prices`), and this build's programs
//! on one crafted segment per path with their maps hot (`isolated`).

use std::{net::SocketAddr, path::Path};

use anyhow::{Context as _, Result, bail};
use cnibpf_tests::{
    Container, Netns, SimHost,
    topology::{Family, HOST_UPLINK_ADDR, OUTSIDE_ADDR, UPLINK, port_mappings},
    traffic::{EchoServer, connection_rate},
};
use serde_json::{Value, json};

use super::{
    BUSY_CLIENTS, Hook, IPERF_SECONDS, Iperf3Server, Measured, Progress, RATE_WINDOW, Row,
    chart::{self, BarPanel},
    filter::filter_keys,
    iperf3, iperf3_udp_rate, isolated, median, prices,
    stats::{Counts, count},
    write_report,
};

const ROUNDS: usize = 5;
/// The outside's iperf3 servers: the masqueraded container's, and each filtered one's.
const MASQUERADED_SERVER: u16 = 5201;
const FILTERED_SERVERS: [u16; 2] = [5202, 5203];
/// Rules of the filtered containers' filters (see `filter_keys`: each new connection walks
/// them all, its later packets take the verdict kept with the connection).
const RULE_COUNTS: [usize; 2] = [1, 256];
/// The hostPort the outside uploads through, and the container's iperf3 server behind it.
const HOST_PORT: u16 = 8080;
const CONTAINER_PORT: u16 = 5201;
/// A host process's iperf3 server: packets for it miss every lookup of either hook.
const HOST_SERVER: u16 = 5301;
/// The outside's echo server, for the connection rate of `BUSY_CLIENTS` clients.
const ECHO_PORT: u16 = 7000;

/// What a round measures, in this order (see `Node::round`); `TARGETS` are the budgets of
/// the per-packet ones.
const METRICS: [(&str, &str, &str); 13] = [
    (
        "masquerade, one TCP upload",
        "from_container time per packet",
        "ns",
    ),
    (
        "masquerade, one TCP upload",
        "uplink_ingress time per reply",
        "ns",
    ),
    (
        "hostPort, one TCP upload from outside",
        "uplink_ingress time per packet (DNAT)",
        "ns",
    ),
    (
        "hostPort, one TCP upload from outside",
        "from_container time per reply",
        "ns",
    ),
    (
        "masquerade, one TCP upload, no filter",
        "datapath time per packet of the connection, either direction",
        "ns",
    ),
    (
        "masquerade, one TCP upload, 1 filter rule",
        "filter's time per packet of the connection over no filter",
        "ns",
    ),
    (
        "masquerade, one TCP upload, 256 filter rules",
        "filter's time per packet of the connection over no filter",
        "ns",
    ),
    (
        "a container's upload to a host process (every lookup misses)",
        "from_container time per packet",
        "ns",
    ),
    (
        "an outside upload to a host process (every lookup misses)",
        "uplink_ingress time per packet",
        "ns",
    ),
    (
        "masquerade, statistics' own cost",
        "empty program's time per run (taken off above)",
        "ns",
    ),
    (
        "masquerade, 1 container",
        "64-byte UDP datagrams received",
        "packets/s",
    ),
    (
        "masquerade, 1 container, 8 clients",
        "connection rate",
        "conn/s",
    ),
    (
        "masquerade, 1 container, 8 clients",
        "p99 connection time (lower is better)",
        "µs",
    ),
];

/// Budgets (ns) of the per-packet metrics of the same index in `METRICS`.
const TARGETS: [Option<f64>; 7] = [
    Some(400.0),
    Some(400.0),
    Some(350.0),
    Some(400.0),
    None,
    Some(60.0),
    Some(60.0),
];

pub fn run(out_dir: &Path) -> Result<()> {
    let progress = Progress::new();
    let previous = cnibpf_tests::history::released_commits()
        .pop()
        .context("releases.toml lists no release")?;
    progress.step(&format!(
        "building cnibpf of {previous}, the last release (once, into target/history)"
    ));
    let previous_binary = cnibpf_tests::history::cnibpf_of(&previous);
    let this_binary = cnibpf_tests::topology::cnibpf_binary();
    progress
        .step("two simulated hosts, one per build: masqueraded, hostPort and filtered containers");
    let mut nodes = Vec::new();
    for (id, binary) in [("bench-pkp", &previous_binary), ("bench-pkt", &this_binary)] {
        // SAFETY: the bench runs one thread that reads the environment, this one (the echo
        // servers, whose threads read none, start below).
        unsafe { std::env::set_var("CNIBPF_BIN", binary) };
        nodes.push(Node::new(SimHost::new(
            id,
            json!({ "backend": "ebpf", "ipMasq": true }),
        ))?);
    }
    // SAFETY: as above; the DELs when the hosts are dropped run this build.
    unsafe { std::env::set_var("CNIBPF_BIN", &this_binary) };
    let echo: Vec<EchoServer> = nodes
        .iter()
        .map(|node| EchoServer::start(&node.sim.outside, Family::V4.any(ECHO_PORT), BUSY_CLIENTS))
        .collect();
    let labels = [
        format!("{previous} (last release)"),
        "this build".to_owned(),
    ];
    let mut rounds: [Vec<[f64; METRICS.len()]>; 2] = Default::default();
    for round in 1..=ROUNDS {
        for (index, node) in nodes.iter().enumerate() {
            progress.step(&format!("round {round}/{ROUNDS}: {}", labels[index]));
            rounds[index].push(node.round()?);
        }
    }
    drop(echo);
    progress
        .step("prices of the datapath's building blocks (BPF_PROG_TEST_RUN), in this build's host");
    let this = &nodes[1];
    let route = prices::Route {
        interface: this.sim.host_interface(&this.masqueraded),
        source: this.masqueraded.address,
        destination: OUTSIDE_ADDR,
    };
    let mut prices = this.sim.host.run(move || prices::rows(&route))?;
    progress.step("each build's programs on one crafted segment per path (BPF_PROG_TEST_RUN)");
    // Alternating between the builds, as the traffic rounds do: one build measured after the
    // other would carry the machine's drift (its clock, its caches) into the ratio.
    let mut crafted_rounds: [Vec<Vec<f64>>; 2] = Default::default();
    for _ in 0..ROUNDS {
        for (index, node) in nodes.iter().enumerate() {
            let cases = node.crafted_cases();
            let pin_path = node.sim.pin_path.clone();
            crafted_rounds[index].push(
                node.sim
                    .host
                    .run(move || isolated::times(&pin_path, &cases))?,
            );
        }
    }
    let [crafted_before, crafted_now] = crafted_rounds.map(|rounds| {
        (0..rounds[0].len())
            .map(|case| median(rounds.iter().map(|round| round[case]).collect()))
            .collect::<Vec<f64>>()
    });
    let crafted = nodes[1]
        .crafted_cases()
        .into_iter()
        .zip(crafted_before.iter().zip(&crafted_now));
    prices.extend(crafted.map(|(case, (before, now))| Row {
        scenario: format!("{}, one crafted segment, caches hot", case.name),
        metric: "program time per run, BPF_PROG_TEST_RUN",
        unit: "ns",
        value: *now,
        baseline: Some((format!("{previous} (last release)"), *before)),
    }));
    let [before, now] = rounds.map(|rounds| {
        std::array::from_fn::<f64, { METRICS.len() }, _>(|metric| {
            median(rounds.iter().map(|round| round[metric]).collect())
        })
    });
    let mut rows: Vec<Row> = METRICS
        .iter()
        .enumerate()
        .map(|(index, (scenario, metric, unit))| Row {
            scenario: (*scenario).to_owned(),
            metric,
            unit,
            value: now[index],
            baseline: Some((labels[0].clone(), before[index])),
        })
        .collect();
    rows.extend(prices);
    let notes = notes(&labels, &now, &before);
    let report = write_report(
        out_dir,
        "packets",
        "cnibpf bench: time per packet, this build beside the last release",
        &rows,
        &notes,
    )?;
    let per_packet = |values: &[f64; METRICS.len()]| -> Vec<(String, f64)> {
        [
            "masq",
            "masq reply",
            "DNAT",
            "DNAT reply",
            "no filter",
            "+1 rule",
            "+256 rules",
            "miss, veth",
            "miss, uplink",
        ]
        .iter()
        .zip(values)
        .map(|(label, value)| ((*label).to_owned(), *value))
        .collect()
    };
    chart::bars(
        &out_dir.join("packets.png"),
        "cnibpf eBPF datapath: own time per packet (ns, net of the statistics' cost)",
        &[
            BarPanel {
                title: labels[0].as_str(),
                y_label: "ns",
                bars: per_packet(&before),
                reference: Some(400.0),
            },
            BarPanel {
                title: "this build (line: the 400 ns budget)",
                y_label: "ns",
                bars: per_packet(&now),
                reference: Some(400.0),
            },
        ],
    )?;
    progress.step(&format!("report: {} and packets.png", report.display()));
    Ok(())
}

/// How the figures were taken, and each budget met or not by this build.
fn notes(labels: &[String; 2], now: &[f64], before: &[f64]) -> Vec<String> {
    let mut budgets = String::from("Budgets, this build: ");
    let judged: Vec<String> = TARGETS
        .iter()
        .enumerate()
        .filter_map(|(index, target)| {
            let target = (*target)?;
            let (scenario, metric, _) = METRICS[index];
            let verdict = if now[index] <= target {
                "met"
            } else {
                "not met"
            };
            Some(format!(
                "{scenario}, {metric}: {:.0} ns against ≤ {target:.0} ns, {verdict} ({}: {:.0} ns)",
                now[index], labels[0], before[index]
            ))
        })
        .collect();
    budgets.push_str(&judged.join("; "));
    budgets.push('.');
    vec![
        format!(
            "Medians of {ROUNDS} rounds alternating between {} and this build, each in its own simulated host \
             (cnibpf with ipMasq, eBPF backend) in the same run. Per-packet figures: a program's run time over \
             its runs as the kernel counts them (kernel.bpf_stats_enabled) during one {IPERF_SECONDS} s iperf3 \
             TCP upload, less an empty program's at the same hook over the same packets (the statistics' own \
             cost, shown in its own row). \"The connection\": the datapath's time over a container's upload — from_container on its segments, \
             uplink_ingress on the replies, to_container where they pass it (a reply handed straight to the \
             container does not) — over its packets, each counted once (the empty programs count them); the \
             filter rows are that figure with the filter less without. The filters: filterDefault DROP, the upload's ALLOW after rules that differ from it \
             only in the destination port. The last release is built from its commit (its userspace in \
             debug; its eBPF object is optimised, as every build's is).",
            labels[0]
        ),
        "Where the time goes: the two \"every lookup misses\" rows are the same hooks on packets for a \
         host process — parsed, looked up in every table the path consults (endpoint, source check, \
         connections, translations, hostPorts, masquerade sources and exclusions) and left to the host \
         stack: what a packet costs before anything is rewritten. The masquerade and DNAT rows less them \
         approximate what the rewrite, the checksum updates and the redirect add; at the container's veth \
         the miss also pays a FIB lookup that an established flow's packets take from the per-CPU cache \
         (next_hops)."
            .to_owned(),
        format!(
            "Prices of one (this build's host, {}): small TC programs assembled by the bench repeat one lookup or \
             helper call in a bounded loop, timed by the kernel (BPF_PROG_TEST_RUN, the median of 9 means of 2,000 \
             runs), less the same loop without it. They run on one uncloned segment with the maps hot in the caches, \
             so they are what the datapath's building blocks cost at least: the random-entry lookup shows what a \
             lookup costs when its entry is not in the caches, and a write into a segment a local TCP stack sent (a \
             clone) first copies its headers, which a test run cannot show.",
            "FIB lookup from the masqueraded container's veth to the outside"
        ),
        "Crafted segments: each build's pinned programs run by the kernel on one segment each, on the \
         interface they are hooked to (BPF_PROG_TEST_RUN, one run per call so that each run meets the \
         segment as sent; the median of 4,001, less that of a program that does nothing; the median of \
         5 such rounds alternating between the builds): the same paths \
         with their maps hot and an uncloned segment. Beside the per-packet rows above they split a path's \
         time in traffic into the program's own work and what traffic adds; beside the prices, the \
         program's work into its lookups and helper calls and its own instructions."
            .to_owned(),
        format!(
            "Forwarding-bound loads (no statistics): 64-byte UDP datagrams from one iperf3 client at its highest rate, \
             received per second; {BUSY_CLIENTS} clients' connection rate (connect + 1-byte request/response + close, \
             {} s windows) and the 99th percentile of one connection's time under that load.",
            RATE_WINDOW.as_secs()
        ),
        budgets,
    ]
}

/// One build's simulated host: a masqueraded container, one with a hostPort, one per filter,
/// and their servers.
struct Node {
    sim: SimHost,
    masqueraded: Container,
    host_port: Container,
    filtered: Vec<Container>,
    _servers: Vec<Iperf3Server>,
}

impl Node {
    fn new(sim: SimHost) -> Result<Self> {
        let masqueraded = sim.container("m", Value::Null);
        let host_port = sim.container("p", port_mappings(&[(HOST_PORT, CONTAINER_PORT, "tcp")]));
        let filtered = RULE_COUNTS
            .iter()
            .map(|rules| {
                let container = sim.container(&format!("f{rules}"), Value::Null);
                sim.readd_with(&container, filter_keys(*rules))
                    .map_err(|error| anyhow::anyhow!("filter of {rules} rules: {error}"))?;
                Ok(container)
            })
            .collect::<Result<Vec<_>>>()?;
        let mut servers = vec![
            Iperf3Server::start(&sim.outside, MASQUERADED_SERVER)?,
            Iperf3Server::start(&host_port.netns, CONTAINER_PORT)?,
            Iperf3Server::start(&sim.host, HOST_SERVER)?,
        ];
        for port in FILTERED_SERVERS {
            servers.push(Iperf3Server::start(&sim.outside, port)?);
        }
        Ok(Self {
            sim,
            masqueraded,
            host_port,
            filtered,
            _servers: servers,
        })
    }

    /// The crafted segments of the paths measured in traffic, on this host's interfaces.
    fn crafted_cases(&self) -> Vec<isolated::Case> {
        let veth = self.sim.host_interface(&self.masqueraded);
        let container = self.masqueraded.address;
        let uplink = |name: &str, source_port, destination_port| isolated::Case {
            name: name.to_owned(),
            program: "uplink_ingress",
            interface: UPLINK.to_owned(),
            source: (OUTSIDE_ADDR, source_port),
            destination: (HOST_UPLINK_ADDR, destination_port),
        };
        let mut cases = vec![
            uplink(
                "uplink_ingress, a segment for a host process (every lookup misses)",
                40_000,
                HOST_SERVER,
            ),
            uplink(
                "uplink_ingress, a segment to a hostPort (DNAT)",
                40_001,
                HOST_PORT,
            ),
            isolated::Case {
                name: "from_container, a segment for a host process (every lookup misses)"
                    .to_owned(),
                program: "from_container",
                interface: veth.clone(),
                source: (container, 40_002),
                destination: (HOST_UPLINK_ADDR, HOST_SERVER),
            },
            isolated::Case {
                name: "from_container, a masqueraded segment (its flow begun by the first run)"
                    .to_owned(),
                program: "from_container",
                interface: veth,
                source: (container, 40_003),
                destination: (OUTSIDE_ADDR, MASQUERADED_SERVER),
            },
        ];
        // The same segment of a filtered container's connection: the first run walks the
        // rules, the others take the verdict kept with the connection.
        cases.extend(
            self.filtered
                .iter()
                .zip(RULE_COUNTS.iter().zip(FILTERED_SERVERS))
                .zip([40_004, 40_005])
                .map(|((container, (rules, server)), source_port)| isolated::Case {
                    name: format!(
                        "from_container, a masqueraded segment of a connection its filter of {rules} rule{} allowed",
                        if *rules == 1 { "" } else { "s" }
                    ),
                    program: "from_container",
                    interface: self.sim.host_interface(container),
                    source: (container.address, source_port),
                    destination: (OUTSIDE_ADDR, server),
                }),
        );
        cases
    }

    fn outside(port: u16) -> SocketAddr {
        SocketAddr::new(Family::V4.outside(), port)
    }

    /// Counts of `from_container` and `to_container` on `container`'s veth and of
    /// `uplink_ingress`, over `load`.
    fn count_hooks(
        &self,
        container: &Container,
        load: impl FnOnce() -> Result<()>,
    ) -> Result<[Counts; 3]> {
        let veth = self.sim.host_interface(container);
        let hooks = [
            ("from_container", veth.as_str(), Hook::Ingress),
            ("to_container", veth.as_str(), Hook::Egress),
            ("uplink_ingress", UPLINK, Hook::Ingress),
        ]
        .map(|(program, interface, hook)| Measured {
            program,
            interface,
            hook,
            metric: "",
        });
        count(&self.sim, &hooks, load)?
            .try_into()
            .map_err(|_| anyhow::anyhow!("three programs counted"))
    }

    /// One round, the figures in `METRICS`' order.
    fn round(&self) -> Result<[f64; METRICS.len()]> {
        let [masq, masq_to, masq_replies] = self.count_hooks(
            &self.masqueraded,
            upload(&self.masqueraded.netns, Self::outside(MASQUERADED_SERVER)),
        )?;
        let [dnat_replies, _, dnat] = self.count_hooks(
            &self.host_port,
            upload(&self.sim.outside, self.sim.uplink_target(HOST_PORT)),
        )?;
        let unfiltered = per_packet_of_the_connection(&masq, &masq_to, &masq_replies);
        let mut filter_costs = Vec::new();
        for (container, port) in self.filtered.iter().zip(FILTERED_SERVERS) {
            let [from, to, replies] =
                self.count_hooks(container, upload(&container.netns, Self::outside(port)))?;
            filter_costs.push(per_packet_of_the_connection(&from, &to, &replies) - unfiltered);
        }
        let [veth_miss, _, _] = self.count_hooks(
            &self.masqueraded,
            upload(&self.masqueraded.netns, self.sim.uplink_target(HOST_SERVER)),
        )?;
        let [_, _, uplink_miss] = self.count_hooks(
            &self.masqueraded,
            upload(&self.sim.outside, self.sim.uplink_target(HOST_SERVER)),
        )?;
        let datagrams = iperf3_udp_rate(
            &self.masqueraded.netns,
            Self::outside(MASQUERADED_SERVER),
            IPERF_SECONDS,
            64,
        )?;
        let busy = connection_rate(
            &self.masqueraded.netns,
            Self::outside(ECHO_PORT),
            BUSY_CLIENTS,
            RATE_WINDOW,
        );
        let statistics = masq.per_run().map_or(f64::NAN, |(_, empty)| empty);
        Ok([
            own_per_run(&masq, "from_container, masquerade")?,
            own_per_run(&masq_replies, "uplink_ingress, masquerade replies")?,
            own_per_run(&dnat, "uplink_ingress, DNAT")?,
            own_per_run(&dnat_replies, "from_container, DNAT replies")?,
            unfiltered,
            filter_costs[0],
            filter_costs[1],
            own_per_run(&veth_miss, "from_container, to a host process")?,
            own_per_run(&uplink_miss, "uplink_ingress, to a host process")?,
            statistics,
            datagrams,
            busy.per_second,
            busy.latency_p99.as_secs_f64() * 1e6,
        ])
    }
}

/// One iperf3 TCP upload from `netns` to the server at `target`.
fn upload(netns: &Netns, target: SocketAddr) -> impl FnOnce() -> Result<()> + '_ {
    move || iperf3(netns, target, IPERF_SECONDS).map(drop)
}

/// A program's own time per run, net of the statistics' cost.
fn own_per_run(counts: &Counts, what: &str) -> Result<f64> {
    if counts.runs() == 0 {
        bail!("{what}: the program did not run");
    }
    Ok(counts.net_ns() / counts.runs() as f64)
}

/// The datapath's own time over a container's connection — `from_container` on what it
/// sends, `uplink_ingress` on the replies, `to_container` where they pass it (a reply handed
/// straight to the container does not) — per packet of the connection, each counted once: at
/// `from_container` going out, at `uplink_ingress` coming in.
fn per_packet_of_the_connection(
    from_container: &Counts,
    to_container: &Counts,
    uplink_ingress: &Counts,
) -> f64 {
    let packets = from_container.packets() + uplink_ingress.packets();
    (from_container.net_ns() + to_container.net_ns() + uplink_ingress.net_ns())
        / packets.max(1) as f64
}
