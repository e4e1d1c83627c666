//! `cargo xtask bench portmap`: the hostPort datapath against plain routing to the container,
//! with 1 and 5,000 mappings installed, and the plugin's own ADD/DEL time at 1, 100 and 1,000
//! existing attachments.

mod grace;
mod plugin;

use std::path::Path;

use anyhow::{Result, bail};
use cnibpf_tests::{
    Container, SimHost,
    topology::{ReferencePlugins, UPLINK, port_mappings},
    traffic::{EchoServer, connection_rate},
};
use serde_json::{Value, json};

use self::{
    grace::expedited_grace_periods,
    plugin::{first_add_after_load, mapping_count_time, plugin_time},
};
use super::{
    self as bench, BUSY_CLIENTS, Hook, IPERF_SECONDS, Iperf3Server, Measured, Progress,
    RATE_CLIENTS, RATE_WINDOW, Row,
    chart::{self, BarPanel},
    iperf3, iperf3_udp_rate, median, write_report,
};

const ROUNDS: usize = 5;
const SCALE_LEVELS: [usize; 3] = [1, 100, 1_000];
/// The reference portmap adds iptables chains per container: 1,000 would take many minutes.
const REFERENCE_SCALE_LEVELS: [usize; 2] = [1, 100];
const TIMED_CYCLES: usize = 15;
/// hostPorts on one pod: one, a hundred, a media server's range.
const MAPPING_COUNTS: [usize; 3] = [1, 100, 1_500];
/// The reference portmap takes minutes for 1,500 (an iptables rule each).
const REFERENCE_MAPPING_COUNTS: [usize; 2] = [1, 100];
const MAPPING_CYCLES: usize = 5;

pub fn run(out_dir: &Path) -> Result<()> {
    let progress = Progress::new();
    let mut rows = datapath(&progress)?;
    let sim = SimHost::new("bench-scale", json!({ "backend": "ebpf" }));
    rows.extend(plugin_time(
        &progress,
        &sim,
        "cnibpf",
        "cnibpf",
        &SCALE_LEVELS,
    )?);
    drop(sim);
    rows.extend(first_add_after_load(&progress)?);
    rows.extend(expedited_grace_periods(&progress)?);
    let sim = SimHost::new("bench-mapcount", json!({ "backend": "ebpf" }));
    rows.extend(mapping_count_time(
        &progress,
        &sim,
        "cnibpf",
        "cnibpf",
        &MAPPING_COUNTS,
    )?);
    drop(sim);
    let nftables = SimHost::new("bench-nftscale", json!({ "backend": "nftables" }));
    rows.extend(plugin_time(
        &progress,
        &nftables,
        "cnibpf",
        "cnibpf nftables",
        &SCALE_LEVELS,
    )?);
    drop(nftables);
    let nftables = SimHost::new("bench-nftcount", json!({ "backend": "nftables" }));
    rows.extend(mapping_count_time(
        &progress,
        &nftables,
        "cnibpf",
        "cnibpf nftables",
        &MAPPING_COUNTS,
    )?);
    drop(nftables);
    let reference = SimHost::with_reference_portmap("bench-refscale");
    rows.extend(plugin_time(
        &progress,
        &reference,
        "portmap",
        "portmap",
        &REFERENCE_SCALE_LEVELS,
    )?);
    drop(reference);
    let reference = SimHost::with_reference_portmap("bench-refcount");
    rows.extend(mapping_count_time(
        &progress,
        &reference,
        "portmap",
        "portmap",
        &REFERENCE_MAPPING_COUNTS,
    )?);
    let notes = vec![format!(
        "Medians of {ROUNDS} alternating rounds; iperf3 {IPERF_SECONDS} s single stream; connection rate: {RATE_CLIENTS} clients, \
         connect + 1-byte request/response + close, {} s windows. Forwarding-bound loads: 64-byte UDP datagrams from one \
         iperf3 client at its highest rate, received per second; {BUSY_CLIENTS} clients' connection rate and the 99th \
         percentile of one connection's time (connect to the answer's byte) under that load. Baseline \"routed\": the outside client talks to the container \
         address directly, routed by the host (bridge, no NAT). Plugin times: wall time of the plugin process from spawn to exit, the chained plugin alone (no bridge), spawned as \
         containerd spawns it (posix_spawn from a thread in the host namespace); \"process start\" is the same for VERSION. \
         \"5,000 vs 1 mapping\" compares hostPort/routed ratios, which cancels the drift between the two states. \
         \"RCU grace periods\": the node's /sys/kernel/rcu_expedited set to 0 and to 1 in turn within each ADD/DEL cycle, \
         then put back as it was.",
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
    // "ADD 1", "DEL 1000", "ref ADD 100": plugin, verb and number of existing attachments (or
    // of hostPorts on the one pod).
    let plugin_times = |per: &str| -> Vec<(String, f64)> {
        rows.iter()
            .filter(|row| row.metric.starts_with("plugin ") && row.metric != "plugin VERSION")
            .filter(|row| row.scenario.ends_with(per))
            .map(|row| {
                let (plugin, rest) = row.scenario.split_once(", ").unwrap_or_default();
                let count = rest
                    .trim_start_matches("one pod with ")
                    .split(' ')
                    .next()
                    .unwrap_or_default();
                let prefix = match plugin {
                    "cnibpf" => "",
                    "cnibpf nftables" => "nft ",
                    _ => "ref ",
                };
                let verb = row.metric.trim_start_matches("plugin ");
                (format!("{prefix}{verb} {count}"), row.value)
            })
            .collect()
    };
    let times = plugin_times("existing attachments");
    let sizes = plugin_times("hostPorts");
    chart::bars(
        &out_dir.join("portmap.png"),
        "cnibpf port mapping (eBPF and nftables backends)",
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
                    (
                        "UDP pkt/s".to_owned(),
                        find("hostPort, 1 mapping", "64-byte UDP datagrams received"),
                    ),
                    (
                        "8 clients conn/s".to_owned(),
                        find("hostPort, 1 mapping, 8 clients", "connection rate"),
                    ),
                    (
                        "nft throughput".to_owned(),
                        find("hostPort, nftables backend", "TCP throughput"),
                    ),
                    (
                        "nft conn/s".to_owned(),
                        find("hostPort, nftables backend", "connection rate"),
                    ),
                    (
                        "nft UDP pkt/s".to_owned(),
                        find(
                            "hostPort, nftables backend",
                            "64-byte UDP datagrams received",
                        ),
                    ),
                    (
                        "nft 8 clients".to_owned(),
                        find("hostPort, nftables backend, 8 clients", "connection rate"),
                    ),
                    (
                        "ref throughput".to_owned(),
                        find("reference portmap (iptables)", "TCP throughput"),
                    ),
                    (
                        "ref conn/s".to_owned(),
                        find("reference portmap (iptables)", "connection rate"),
                    ),
                    (
                        "ref UDP pkt/s".to_owned(),
                        find(
                            "reference portmap (iptables)",
                            "64-byte UDP datagrams received",
                        ),
                    ),
                    (
                        "ref 8 clients".to_owned(),
                        find("reference portmap (iptables), 8 clients", "connection rate"),
                    ),
                    (
                        "ref nft throughput".to_owned(),
                        find("reference portmap (nftables)", "TCP throughput"),
                    ),
                    (
                        "ref nft conn/s".to_owned(),
                        find("reference portmap (nftables)", "connection rate"),
                    ),
                    (
                        "ref nft UDP pkt/s".to_owned(),
                        find(
                            "reference portmap (nftables)",
                            "64-byte UDP datagrams received",
                        ),
                    ),
                ],
                reference: Some(1.0),
            },
            BarPanel {
                title: "plugin time in ms by existing attachments; nft = nftables, ref = reference portmap",
                y_label: "ms",
                bars: times,
                reference: Some(3.0),
            },
            BarPanel {
                title: "plugin time in ms by hostPorts on one pod; nft = nftables, ref = reference portmap",
                y_label: "ms",
                bars: sizes,
                reference: None,
            },
        ],
    )?;
    let published = super::publish(out_dir, "portmap", "./dev bench portmap")?;
    progress.step(&format!(
        "report: {} and portmap.png{}",
        report.display(),
        if published {
            ", published to docs/"
        } else {
            ""
        }
    ));
    Ok(())
}

/// One measured hostPort setup: a simulated host with a container serving iperf3 (5201, via
/// hostPort 8080, TCP and UDP) and an echo server (7000, via hostPort 8081), reachable routed
/// too.
pub(super) struct HostPortSetup {
    pub(super) sim: SimHost,
    target: Container,
    _iperf: Iperf3Server,
    _echo: EchoServer,
}

impl HostPortSetup {
    pub(super) fn new(sim: SimHost) -> Result<Self> {
        sim.route_outside_to_containers();
        let target = sim.container(
            "target",
            port_mappings(&[
                (8080, 5201, "tcp"),
                (8080, 5201, "udp"),
                (8081, 7000, "tcp"),
            ]),
        );
        let iperf = Iperf3Server::start(&target.netns, 5201)?;
        let echo = EchoServer::start(&target.netns, target.socket(7000), BUSY_CLIENTS);
        Ok(Self {
            sim,
            target,
            _iperf: iperf,
            _echo: echo,
        })
    }

    pub(super) fn target(&self) -> &Container {
        &self.target
    }

    /// One round: (routed throughput, hostPort throughput, routed rate, hostPort rate).
    pub(super) fn round(&self) -> Result<[f64; 4]> {
        let routed = (self.target.socket(5201), self.target.socket(7000));
        let host_port = (self.sim.uplink_target(8080), self.sim.uplink_target(8081));
        let outside = &self.sim.outside;
        Ok([
            iperf3(outside, routed.0, IPERF_SECONDS)?,
            iperf3(outside, host_port.0, IPERF_SECONDS)?,
            connection_rate(outside, routed.1, RATE_CLIENTS, RATE_WINDOW).per_second,
            connection_rate(outside, host_port.1, RATE_CLIENTS, RATE_WINDOW).per_second,
        ])
    }

    /// One round of the forwarding-bound loads, routed then through the hostPort: 64-byte UDP
    /// datagrams received per second as fast as one sender goes, and the connection rate of
    /// `BUSY_CLIENTS` clients at once with its 99th percentile connection time in µs.
    pub(super) fn forwarding_round(&self) -> Result<[f64; 6]> {
        let routed = (self.target.socket(5201), self.target.socket(7000));
        let host_port = (self.sim.uplink_target(8080), self.sim.uplink_target(8081));
        let outside = &self.sim.outside;
        let routed_datagrams = iperf3_udp_rate(outside, routed.0, IPERF_SECONDS, 64)?;
        let host_port_datagrams = iperf3_udp_rate(outside, host_port.0, IPERF_SECONDS, 64)?;
        let routed_busy = connection_rate(outside, routed.1, BUSY_CLIENTS, RATE_WINDOW);
        let host_port_busy = connection_rate(outside, host_port.1, BUSY_CLIENTS, RATE_WINDOW);
        Ok([
            routed_datagrams,
            host_port_datagrams,
            routed_busy.per_second,
            host_port_busy.per_second,
            routed_busy.latency_p99.as_secs_f64() * 1e6,
            host_port_busy.latency_p99.as_secs_f64() * 1e6,
        ])
    }
}

/// The forwarding-bound rows of `label`'s rounds (see `HostPortSetup::forwarding_round`):
/// medians, hostPort against routed.
fn forwarding_rows(label: &str, rounds: &[[f64; 6]]) -> Result<Vec<Row>> {
    let [
        routed_datagrams,
        datagrams,
        routed_busy,
        busy,
        routed_p99,
        p99,
    ] = std::array::from_fn(|series| median(rounds.iter().map(|round| round[series]).collect()));
    if datagrams == 0.0 || busy == 0.0 {
        bail!("{label}: no forwarding-bound traffic passed the hostPort");
    }
    let clients = format!("{label}, {BUSY_CLIENTS} clients");
    Ok(vec![
        ratio_row(
            label,
            "64-byte UDP datagrams received",
            "packets/s",
            datagrams,
            ("routed", routed_datagrams),
        ),
        ratio_row(
            &clients,
            "connection rate",
            "conn/s",
            busy,
            ("routed", routed_busy),
        ),
        ratio_row(
            &clients,
            "p99 connection time (lower is better)",
            "µs",
            p99,
            ("routed", routed_p99),
        ),
    ])
}

/// Medians per series of `rounds`, which must have seen traffic through the hostPort.
fn medians(label: &str, rounds: Vec<[f64; 4]>) -> Result<[f64; 4]> {
    let medians =
        [0, 1, 2, 3].map(|series| median(rounds.iter().map(|round| round[series]).collect()));
    if medians[1] == 0.0 || medians[3] == 0.0 {
        bail!("{label}: no traffic passed the hostPort");
    }
    Ok(medians)
}

fn ratio_row(
    scenario: &str,
    metric: &'static str,
    unit: &'static str,
    value: f64,
    baseline: (&str, f64),
) -> Row {
    Row {
        scenario: scenario.to_owned(),
        metric,
        unit,
        value,
        baseline: Some((baseline.0.to_owned(), baseline.1)),
    }
}

/// Throughput and connection rate through a hostPort against routing to the container, with 1
/// and 5,000 mappings, and the reference portmap (on iptables and on its own nftables backend)
/// in the same topology.
fn datapath(progress: &Progress) -> Result<Vec<Row>> {
    progress.step("cnibpf: simulated host with one container (iperf3 and an echo server inside)");
    let cnibpf = HostPortSetup::new(SimHost::new("bench-pm", json!({ "backend": "ebpf" })))?;
    let many: Vec<Value> = (20_000..25_000u16)
        .map(|port| json!({ "hostPort": port, "containerPort": 80, "protocol": "tcp" }))
        .collect();
    // 1 and 5,000 mappings alternate within each round, so that drift on this noisy machine
    // falls on both alike.
    let (mut one, mut five_thousand, mut forwarding) = (Vec::new(), Vec::new(), Vec::new());
    for round in 1..=ROUNDS {
        progress.step(&format!("cnibpf, round {round}/{ROUNDS}: 1 mapping"));
        one.push(cnibpf.round()?);
        forwarding.push(cnibpf.forwarding_round()?);
        progress.step(&format!("cnibpf, round {round}/{ROUNDS}: 5,000 mappings"));
        let crowd = cnibpf
            .sim
            .container(&format!("crowd{round}"), json!({ "portMappings": many }));
        five_thousand.push(cnibpf.round()?);
        cnibpf
            .sim
            .del(&crowd)
            .map_err(|error| anyhow::anyhow!("DEL of the crowd: {error}"))?;
    }
    let [routed_tput, nat_tput, routed_rate, nat_rate] = medians("cnibpf, 1 mapping", one)?;
    let [routed_tput_5k, nat_tput_5k, routed_rate_5k, nat_rate_5k] =
        medians("cnibpf, 5,000 mappings", five_thousand)?;
    progress.step(
        "datapath time per packet: one TCP upload through the hostPort, kernel BPF statistics on",
    );
    let veth = cnibpf.sim.host_interface(&cnibpf.target);
    let per_packet = bench::time_per_packet(
        &cnibpf.sim,
        "cnibpf hostPort, one TCP upload from outside",
        &[
            Measured {
                program: "uplink_ingress",
                interface: UPLINK,
                hook: Hook::Ingress,
                metric: "uplink_ingress time per packet (DNAT to the container)",
            },
            Measured {
                program: "from_container",
                interface: &veth,
                hook: Hook::Ingress,
                metric: "from_container time per packet (replies translated back)",
            },
        ],
        || {
            iperf3(
                &cnibpf.sim.outside,
                cnibpf.sim.uplink_target(8080),
                IPERF_SECONDS,
            )
            .map(drop)
        },
    )?;
    drop(cnibpf);

    let mut rows = vec![
        ratio_row(
            "hostPort, 1 mapping",
            "TCP throughput",
            "Gbit/s",
            nat_tput,
            ("routed", routed_tput),
        ),
        ratio_row(
            "hostPort, 1 mapping",
            "connection rate",
            "conn/s",
            nat_rate,
            ("routed", routed_rate),
        ),
        ratio_row(
            "hostPort, 5,000 mappings",
            "TCP throughput",
            "Gbit/s",
            nat_tput_5k,
            ("routed", routed_tput_5k),
        ),
        ratio_row(
            "hostPort, 5,000 mappings",
            "connection rate",
            "conn/s",
            nat_rate_5k,
            ("routed", routed_rate_5k),
        ),
        ratio_row(
            "5,000 vs 1 mapping",
            "TCP throughput",
            "× routed",
            nat_tput_5k / routed_tput_5k,
            ("1 mapping", nat_tput / routed_tput),
        ),
        ratio_row(
            "5,000 vs 1 mapping",
            "connection rate",
            "× routed",
            nat_rate_5k / routed_rate_5k,
            ("1 mapping", nat_rate / routed_rate),
        ),
    ];
    rows.extend(forwarding_rows("hostPort, 1 mapping", &forwarding)?);
    rows.extend(per_packet);

    progress.step("cnibpf nftables backend: the same topology and traffic");
    let nftables = HostPortSetup::new(SimHost::new("bench-pmn", json!({ "backend": "nftables" })))?;
    let (mut rounds, mut forwarding) = (Vec::new(), Vec::new());
    for round in 1..=ROUNDS {
        progress.step(&format!("nftables backend, round {round}/{ROUNDS}"));
        rounds.push(nftables.round()?);
        forwarding.push(nftables.forwarding_round()?);
    }
    drop(nftables);
    let [nft_routed_tput, nft_tput, nft_routed_rate, nft_rate] =
        medians("nftables backend", rounds)?;
    rows.extend([
        ratio_row(
            "hostPort, nftables backend",
            "TCP throughput",
            "Gbit/s",
            nft_tput,
            ("routed", nft_routed_tput),
        ),
        ratio_row(
            "hostPort, nftables backend",
            "connection rate",
            "conn/s",
            nft_rate,
            ("routed", nft_routed_rate),
        ),
    ]);
    rows.extend(forwarding_rows("hostPort, nftables backend", &forwarding)?);

    for plugins in [ReferencePlugins::Iptables, ReferencePlugins::Nftables] {
        rows.extend(reference_datapath(progress, plugins)?);
    }
    Ok(rows)
}

/// The same topology and traffic through the reference portmap on `plugins`' netfilter.
fn reference_datapath(progress: &Progress, plugins: ReferencePlugins) -> Result<Vec<Row>> {
    let label = format!("reference portmap ({})", plugins.name());
    progress.step(&format!("{label}: the same topology and traffic"));
    let reference = HostPortSetup::new(SimHost::with_reference_portmap_on(
        plugins,
        &format!("bench-ref{}", &plugins.name()[..1]),
    ))?;
    let (mut rounds, mut forwarding) = (Vec::new(), Vec::new());
    for round in 1..=ROUNDS {
        progress.step(&format!("{label}, round {round}/{ROUNDS}"));
        rounds.push(reference.round()?);
        forwarding.push(reference.forwarding_round()?);
    }
    let [routed_tput, tput, routed_rate, rate] = medians(&label, rounds)?;
    let mut rows = vec![
        ratio_row(
            &label,
            "TCP throughput",
            "Gbit/s",
            tput,
            ("routed", routed_tput),
        ),
        ratio_row(
            &label,
            "connection rate",
            "conn/s",
            rate,
            ("routed", routed_rate),
        ),
    ];
    rows.extend(forwarding_rows(&label, &forwarding)?);
    Ok(rows)
}
