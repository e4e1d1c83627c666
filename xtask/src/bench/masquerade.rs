//! `cargo xtask bench masquerade`: container → outside traffic masqueraded by cnibpf against
//! the same traffic routed without NAT (the outside has a route back), in the same run.

use std::{net::SocketAddr, path::Path, thread};

use anyhow::{Context as _, Result, bail};
use cnibpf_tests::{
    Container, SimHost,
    topology::{Family, ReferencePlugins, UPLINK},
    traffic::{EchoServer, connection_rate},
};
use serde_json::{Value, json};

use super::{
    self as bench, BUSY_CLIENTS, Hook, IPERF_SECONDS, Iperf3Server, Measured, Progress,
    RATE_CLIENTS, RATE_WINDOW, Row,
    chart::{self, BarPanel},
    in_turn, iperf3_streams, iperf3_udp_rate, median, write_report,
};

const ROUNDS: usize = 7;
const CONTAINERS: usize = 8;
const STREAMS: u32 = 8;
/// What a round measures (see `Setup::round`).
const METRICS: usize = 6;

pub fn run(out_dir: &Path) -> Result<()> {
    let progress = Progress::new();
    progress.step(&format!(
        "five simulated hosts with {CONTAINERS} containers each: cnibpf masquerade (eBPF, nftables), routed without NAT, the reference's iptables and nftables masquerade"
    ));
    let masquerade = Setup::new(
        SimHost::new("bench-mq", json!({ "ipMasq": true, "backend": "ebpf" })),
        false,
    )?;
    let routed = Setup::new(SimHost::new("bench-rt", json!({})), true)?;
    let reference = Setup::new(SimHost::with_reference_masquerade("bench-ipt"), false)?;
    let nftables = Setup::new(
        SimHost::new(
            "bench-mqn",
            json!({ "ipMasq": true, "backend": "nftables" }),
        ),
        false,
    )?;
    let reference_nftables = Setup::new(
        SimHost::with_reference_masquerade_on(ReferencePlugins::Nftables, "bench-nft"),
        false,
    )?;
    let setups = [
        ("cnibpf masquerade", &masquerade),
        ("routed", &routed),
        ("iptables MASQUERADE", &reference),
        ("cnibpf nftables masquerade", &nftables),
        ("reference nftables masquerade", &reference_nftables),
    ];
    let mut rounds: [Vec<[f64; METRICS]>; 5] = Default::default();
    // They alternate within each round, each first in turn, so that drift on this noisy
    // machine falls on all.
    for round in 1..=ROUNDS {
        for series in in_turn(round, setups.len()) {
            let (label, setup) = &setups[series];
            progress.step(&format!("round {round}/{ROUNDS}: {label}"));
            rounds[series].push(setup.round()?);
        }
    }
    let [nat, plain, iptables, nft, reference_nft] = rounds.map(|rounds| {
        std::array::from_fn::<f64, METRICS, _>(|series| {
            median(rounds.iter().map(|round| round[series]).collect())
        })
    });
    if [nat, iptables, nft, reference_nft]
        .iter()
        .any(|values| values.contains(&0.0))
    {
        bail!("no traffic passed a masquerade");
    }
    let parallel = format!("{CONTAINERS} containers × {STREAMS} streams");
    let mut rows = Vec::new();
    for (name, values) in [
        ("cnibpf masquerade", nat),
        ("cnibpf masquerade, nftables backend", nft),
        ("iptables MASQUERADE (reference bridge ipMasq)", iptables),
        (
            "nftables masquerade (reference bridge ipMasqBackend nftables)",
            reference_nft,
        ),
    ] {
        for (scenario, metric, unit, series) in [
            ("1 container", "TCP throughput", "Gbit/s", 0),
            ("1 container", "connection rate", "conn/s", 1),
            (parallel.as_str(), "TCP throughput", "Gbit/s", 2),
            (
                "1 container",
                "64-byte UDP datagrams received",
                "packets/s",
                3,
            ),
            ("1 container, 8 clients", "connection rate", "conn/s", 4),
            (
                "1 container, 8 clients",
                "p99 connection time (lower is better)",
                "µs",
                5,
            ),
        ] {
            rows.push(Row {
                scenario: format!("{name}, {scenario}"),
                metric,
                unit,
                value: values[series],
                baseline: Some(("routed, no NAT".to_owned(), plain[series])),
            });
        }
    }
    // After the ratio rows, which the chart takes in order.
    progress.step("datapath time per packet: one masqueraded TCP upload, kernel BPF statistics on");
    rows.extend(time_per_packet(&masquerade)?);
    let notes = vec![format!(
        "Medians of {ROUNDS} alternating rounds, container → a server in the outside namespace. iperf3 {IPERF_SECONDS} s, one stream; \
         connection rate: {RATE_CLIENTS} clients, connect + 1-byte request/response + close, {} s windows; \
         {CONTAINERS} containers each running iperf3 with {STREAMS} parallel streams at once, summed; \
         64-byte UDP datagrams: one iperf3 client at its highest rate, received per second; \
         {BUSY_CLIENTS} clients: the connection rate with {BUSY_CLIENTS} clients at once, and the 99th percentile of one \
         connection's time under that load (connect to the answer's byte). \
         Baseline \"routed, no NAT\": an identical simulated host with cnibpf chained but ipMasq off, whose outside \
         namespace has a route back to the containers. iptables MASQUERADE: the reference bridge plugin with \
         ipMasq: true and nothing chained; reference nftables: Debian unstable's bridge (1.9) with ipMasqBackend: nftables. \
         nftables backend: cnibpf with backend: nftables.",
        RATE_WINDOW.as_secs()
    )];
    let report = write_report(
        out_dir,
        "masquerade",
        "cnibpf bench: masquerade",
        &rows,
        &notes,
    )?;
    chart::bars(
        &out_dir.join("masquerade.png"),
        "cnibpf masquerade (eBPF and nftables backends)",
        &[BarPanel {
            title: "masquerade / routed without NAT (higher is better); nft = nftables backend, ipt = iptables",
            y_label: "ratio",
            bars: rows
                .iter()
                .filter(|row| row.unit != "µs")
                .zip([
                    "throughput",
                    "conn/s",
                    "8×8 streams",
                    "UDP pkt/s",
                    "8 clients conn/s",
                    "nft throughput",
                    "nft conn/s",
                    "nft 8×8",
                    "nft UDP pkt/s",
                    "nft 8 clients",
                    "ipt throughput",
                    "ipt conn/s",
                    "ipt 8×8",
                    "ipt UDP pkt/s",
                    "ipt 8 clients",
                    "ref nft throughput",
                    "ref nft conn/s",
                    "ref nft 8×8",
                    "ref nft UDP pkt/s",
                    "ref nft 8 clients",
                ])
                .map(|(row, label)| (label.to_owned(), row.ratio().unwrap_or(f64::NAN)))
                .collect(),
            reference: Some(1.0),
        }],
    )?;
    let published = super::publish(out_dir, "masquerade", "./dev bench masquerade")?;
    progress.step(&format!(
        "report: {} and masquerade.png{}",
        report.display(),
        if published {
            ", published to docs/"
        } else {
            ""
        }
    ));
    Ok(())
}

/// The eBPF programs' own time per packet while one container uploads over one masqueraded
/// TCP connection: `from_container` masquerades its segments, `uplink_ingress` translates the
/// ACKs back; then while a host process uploads, `uplink_egress` leaves its segments alone.
fn time_per_packet(setup: &Setup) -> Result<Vec<Row>> {
    let sim = &setup.sim;
    let container = &setup.containers[0];
    let veth = sim.host_interface(container);
    let mut rows = bench::time_per_packet(
        sim,
        "cnibpf masquerade, 1 container, one TCP upload",
        &[
            Measured {
                program: "from_container",
                interface: &veth,
                hook: Hook::Ingress,
                metric: "from_container time per packet (masquerade)",
            },
            Measured {
                program: "uplink_ingress",
                interface: UPLINK,
                hook: Hook::Ingress,
                metric: "uplink_ingress time per packet (replies translated back)",
            },
        ],
        || iperf3_streams(&container.netns, setup.server(5201), IPERF_SECONDS, 1).map(drop),
    )?;
    rows.extend(bench::time_per_packet(
        sim,
        "cnibpf masquerade, a host process's TCP upload",
        &[Measured {
            program: "uplink_egress",
            interface: UPLINK,
            hook: Hook::Egress,
            metric: "uplink_egress time per packet (the host's own, left alone)",
        }],
        || iperf3_streams(&sim.host, setup.server(5201), IPERF_SECONDS, 1).map(drop),
    )?);
    Ok(rows)
}

/// A simulated host with `CONTAINERS` containers and, in its outside namespace, one iperf3
/// server per container and an echo server.
pub(super) struct Setup {
    pub(super) sim: SimHost,
    pub(super) containers: Vec<Container>,
    _iperf: Vec<Iperf3Server>,
    _echo: EchoServer,
}

impl Setup {
    pub(super) fn new(sim: SimHost, route_back: bool) -> Result<Self> {
        if route_back {
            sim.route_outside_to_containers();
        }
        let containers = (0..CONTAINERS)
            .map(|index| sim.container(&format!("c{index}"), Value::Null))
            .collect();
        let iperf = (0..CONTAINERS)
            .map(|index| Iperf3Server::start(&sim.outside, 5201 + index as u16))
            .collect::<Result<_>>()?;
        let echo = EchoServer::start(&sim.outside, Family::V4.any(7000), BUSY_CLIENTS);
        Ok(Self {
            sim,
            containers,
            _iperf: iperf,
            _echo: echo,
        })
    }

    pub(super) fn server(&self, port: u16) -> SocketAddr {
        SocketAddr::new(Family::V4.outside(), port)
    }

    /// One round: single-stream throughput, connection rate, parallel throughput, and the
    /// forwarding-bound loads — 64-byte UDP datagrams as fast as one sender goes, connections
    /// of `BUSY_CLIENTS` clients at once and their 99th percentile time.
    pub(super) fn round(&self) -> Result<[f64; METRICS]> {
        let first = &self.containers[0].netns;
        let single = iperf3_streams(first, self.server(5201), IPERF_SECONDS, 1)?;
        let rate = connection_rate(first, self.server(7000), RATE_CLIENTS, RATE_WINDOW);
        let datagrams = iperf3_udp_rate(first, self.server(5201), IPERF_SECONDS, 64)?;
        let busy = connection_rate(first, self.server(7000), BUSY_CLIENTS, RATE_WINDOW);
        let parallel = thread::scope(|scope| {
            let clients: Vec<_> = self
                .containers
                .iter()
                .enumerate()
                .map(|(index, container)| {
                    let target = self.server(5201 + index as u16);
                    scope.spawn(move || {
                        iperf3_streams(&container.netns, target, IPERF_SECONDS, STREAMS)
                    })
                })
                .collect();
            clients
                .into_iter()
                .map(|client| {
                    client
                        .join()
                        .map_err(|_| anyhow::anyhow!("iperf3 client thread panicked"))?
                        .context("parallel iperf3")
                })
                .sum::<Result<f64>>()
        })?;
        Ok([
            single,
            rate.per_second,
            parallel,
            datagrams,
            busy.per_second,
            busy.latency_p99.as_secs_f64() * 1e6,
        ])
    }
}
