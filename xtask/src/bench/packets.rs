//! `cargo xtask bench packets`: what the eBPF datapath costs per packet on each path an
//! operator pays for — masquerade and its replies, DNAT to a hostPort and its replies, a filter
//! of 1 and 256 rules — in traffic and hot (`hot`), the instructions of its programs, and the
//! forwarding-bound loads, for this build beside the last release `releases.toml` lists (and
//! any older commit asked for), in one run whose rounds alternate between the builds. Where
//! the time goes: the same hooks on packets that miss every lookup and are left to the host
//! stack, and the prices of the lookups and helper calls a packet makes (`prices`).

use std::{net::SocketAddr, path::Path};

use anyhow::{Context as _, Result, bail};
use cnibpf_tests::{
    Container, Netns, SimHost,
    topology::{Family, OUTSIDE_ADDR, UPLINK, port_mappings},
    traffic::{EchoServer, connection_rate},
};
use serde_json::Value;

use super::{
    BUSY_CLIENTS, Hook, IPERF_SECONDS, Iperf3Server, Measured, Progress, RATE_WINDOW,
    chart::{self, BarPanel},
    filter::filter_keys,
    hot::{self, Build, Compared},
    in_turn, instructions, iperf3, iperf3_udp_rate, median, prices,
    stats::{Counts, count},
};

const ROUNDS: usize = 5;
/// The outside's iperf3 servers: the masqueraded container's, and each filtered one's.
pub(super) const MASQUERADED_SERVER: u16 = 5201;
pub(super) const FILTERED_SERVERS: [u16; 2] = [5202, 5203];
/// Rules of the filtered containers' filters (see `filter_keys`: each new connection walks
/// them all, its later packets take the verdict kept with the connection).
pub(super) const RULE_COUNTS: [usize; 2] = [1, 256];
/// The hostPort the outside uploads through, and the container's iperf3 server behind it.
pub(super) const HOST_PORT: u16 = 8080;
pub(super) const CONTAINER_PORT: u16 = 5201;
/// A host process's iperf3 server: packets for it miss every lookup of either hook.
pub(super) const HOST_SERVER: u16 = 5301;
/// The outside's echo server, for the connection rate of `BUSY_CLIENTS` clients.
const ECHO_PORT: u16 = 7000;

/// What a round measures, in this order (see `Node::round`); `TARGETS` are the budgets of
/// the per-packet ones.
const METRICS: [(&str, &str, &str); 16] = [
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
        "hostPort, 64-byte UDP datagrams from outside (not clones)",
        "uplink_ingress time per packet (DNAT)",
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
    (
        "a host process's unconnected UDP socket, from a port no hostPort has",
        "sock_sendmsg4 time per datagram, as counted",
        "ns",
    ),
    (
        "a host process's unconnected UDP socket, from a UDP hostPort's number",
        "sock_sendmsg4 time per datagram, as counted",
        "ns",
    ),
];

/// Datagrams each sendmsg figure counts over.
const SENDMSG_DATAGRAMS: u32 = 20_000;

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

pub fn run(out_dir: &Path, older: &[String]) -> Result<()> {
    let progress = Progress::new();
    let builds = hot::builds(&progress, older)?;
    progress.step(
        "one simulated host per build: masqueraded, hostPort and filtered containers, servers",
    );
    let nodes = hot::nodes(&builds, "bench-pk")?;
    let echo: Vec<EchoServer> = nodes
        .iter()
        .map(|node| EchoServer::start(&node.sim.outside, Family::V4.any(ECHO_PORT), BUSY_CLIENTS))
        .collect();
    let mut rounds: Vec<Vec<[f64; METRICS.len()]>> = vec![Vec::new(); nodes.len()];
    for round in 1..=ROUNDS {
        for index in in_turn(round, nodes.len()) {
            progress.step(&format!("round {round}/{ROUNDS}: {}", builds[index].label));
            rounds[index].push(nodes[index].round()?);
        }
    }
    drop(echo);
    let traffic: Vec<[f64; METRICS.len()]> = rounds
        .iter()
        .map(|rounds| {
            std::array::from_fn(|metric| median(rounds.iter().map(|round| round[metric]).collect()))
        })
        .collect();
    progress.step("each build's programs on one crafted segment per path (BPF_PROG_TEST_RUN)");
    let times = hot::path_times(&nodes)?;
    let counts = nodes
        .iter()
        .map(instructions::by_program)
        .collect::<Result<Vec<_>>>()?;
    progress
        .step("prices of the datapath's building blocks (BPF_PROG_TEST_RUN), in this build's host");
    let this = nodes.last().context("a host per build")?;
    let route = prices::Route {
        interface: this.sim.host_interface(&this.masqueraded),
        source: this.masqueraded.address,
        destination: OUTSIDE_ADDR,
    };
    let prices = this.sim.host.run(move || prices::rows(&route))?;
    let mut rows: Vec<Compared> = METRICS
        .iter()
        .enumerate()
        .map(|(index, (scenario, metric, unit))| Compared {
            what: format!("{scenario}: {metric}"),
            unit,
            values: traffic.iter().map(|build| build[index]).collect(),
            target: TARGETS.get(index).copied().flatten(),
        })
        .collect();
    rows.extend(hot::compared(&times, &counts));
    rows.extend(instructions::by_function_rows(this, builds.len())?);
    rows.extend(prices.into_iter().map(|price| {
        Compared {
            what: format!("{}: {} (this build's host)", price.scenario, price.metric),
            unit: price.unit,
            // Priced in this build's host only, the last.
            values: (1..=builds.len())
                .map(|position| {
                    if position == builds.len() {
                        price.value
                    } else {
                        f64::NAN
                    }
                })
                .collect(),
            target: None,
        }
    }));
    let mut notes = notes(&builds);
    notes.extend(hot::notes());
    let report = hot::write_compared(
        out_dir,
        "packets",
        "cnibpf bench: time per packet in traffic and hot, and the programs' instructions, by build",
        &builds,
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
            "DNAT, UDP",
        ]
        .iter()
        .zip(values)
        .map(|(label, value)| ((*label).to_owned(), *value))
        .collect()
    };
    chart::bars(
        &out_dir.join("packets.png"),
        "cnibpf eBPF datapath: own time per packet in traffic (ns, net of the statistics' cost)",
        &builds
            .iter()
            .zip(&traffic)
            .map(|(build, values)| BarPanel {
                title: build.label.as_str(),
                y_label: "ns",
                bars: per_packet(values),
                reference: Some(400.0),
            })
            .collect::<Vec<_>>(),
    )?;
    // A run beside the older builds the documentation shows is published there.
    let published =
        !older.is_empty() && super::publish(out_dir, "packets", &publish_command(older))?;
    progress.step(&format!(
        "report: {} and packets.png{}",
        report.display(),
        if published {
            ", published to docs/"
        } else {
            ""
        }
    ));
    Ok(())
}

/// The command a published run was made with, as the documentation names it.
fn publish_command(older: &[String]) -> String {
    let baselines: String = older
        .iter()
        .map(|commit| format!(" --baseline {commit}"))
        .collect();
    format!("./dev bench packets{baselines}")
}

/// How the traffic figures and the prices were taken.
fn notes(builds: &[Build]) -> Vec<String> {
    let labels: Vec<&str> = builds.iter().map(|build| build.label.as_str()).collect();
    vec![
        format!(
            "Traffic: medians of {ROUNDS} rounds alternating between the builds ({}), each first in turn, each in its own simulated host \
             (cnibpf with ipMasq, eBPF backend) in the same run. Per-packet figures: a program's run time over \
             its runs as the kernel counts them (kernel.bpf_stats_enabled) during one {IPERF_SECONDS} s iperf3 \
             TCP upload, less an empty program's at the same hook over the same packets (the statistics' own \
             cost, shown in its own row). A local TCP stack keeps a clone of every segment it sends, which the \
             datapath's first write copies; the UDP datagrams to the hostPort are not clones, as a NIC's \
             packets are not. \"The connection\": the datapath's time over a container's upload — from_container on its segments, \
             uplink_ingress on the replies, to_container where they pass it (a reply handed straight to the \
             container does not) — over its packets, each counted once (the empty programs count them); the \
             filter rows are that figure with the filter less without. The filters: filterDefault DROP, the upload's ALLOW after rules that differ from it \
             only in the destination port. Older builds are built from their commits (their userspace in \
             debug; their eBPF objects are optimised, as every build's is). Targets of the traffic rows are the \
             budgets of the previous round; those of the hot paths below are this round's.",
            labels.join(", ")
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
        format!(
            "Forwarding-bound loads (no statistics): 64-byte UDP datagrams from one iperf3 client at its highest rate, \
             received per second; {BUSY_CLIENTS} clients' connection rate (connect + 1-byte request/response + close, \
             {} s windows) and the 99th percentile of one connection's time under that load.",
            RATE_WINDOW.as_secs()
        ),
    ]
}

/// One build's simulated host: a masqueraded container, one with a hostPort, one per filter,
/// and their servers.
pub(super) struct Node {
    pub(super) sim: SimHost,
    pub(super) masqueraded: Container,
    pub(super) host_port: Container,
    pub(super) filtered: Vec<Container>,
    _servers: Vec<Iperf3Server>,
}

impl Node {
    pub(super) fn new(sim: SimHost) -> Result<Self> {
        let masqueraded = sim.container("m", Value::Null);
        // UDP too: iperf3 sends its datagrams where its TCP control connection goes.
        let host_port = sim.container(
            "p",
            port_mappings(&[
                (HOST_PORT, CONTAINER_PORT, "tcp"),
                (HOST_PORT, CONTAINER_PORT, "udp"),
            ]),
        );
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
        let [_, _, dnat_datagrams] = self.count_hooks(&self.host_port, || {
            iperf3_udp_rate(
                &self.sim.outside,
                self.sim.uplink_target(HOST_PORT),
                IPERF_SECONDS,
                64,
            )
            .map(drop)
        })?;
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
        let [sendmsg, sendmsg_host_port] = [0, HOST_PORT].map(|port| self.sendmsg_time(port));
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
            own_per_run(&dnat_datagrams, "uplink_ingress, DNAT of UDP datagrams")?,
            statistics,
            datagrams,
            busy.per_second,
            busy.latency_p99.as_secs_f64() * 1e6,
            sendmsg?,
            sendmsg_host_port?,
        ])
    }

    /// `sock_sendmsg4`'s time per datagram as the kernel counts it (with the statistics' own
    /// clock reads: there is no empty cgroup program beside it), over datagrams a host
    /// process's unconnected socket bound to the wildcard and `port` (0: one the kernel picks)
    /// sends to the outside.
    fn sendmsg_time(&self, port: u16) -> Result<f64> {
        let socket = self.sim.host_udp_socket(Family::V4.any(port));
        let target = Self::outside(9);
        let stats = super::BpfStats::enable()?;
        let before = stats.programs(&self.sim.pin_path, &["sock_sendmsg4"])?;
        for _ in 0..SENDMSG_DATAGRAMS {
            socket.send_to(b"tick", target)?;
        }
        let after = stats.programs(&self.sim.pin_path, &["sock_sendmsg4"])?;
        let runs = after.1.saturating_sub(before.1);
        if runs == 0 {
            bail!("sock_sendmsg4 did not run for a host process's datagrams");
        }
        Ok(after.0.saturating_sub(before.0) as f64 / runs as f64)
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
