//! `cargo xtask bench nftables`: cnibpf's nftables backend against the reference plugins' own
//! nftables backends (Debian unstable's `portmap` with `"backend": "nftables"`, its `bridge`
//! with `"ipMasqBackend": "nftables"`), head to head in one run, on the pod users run — three
//! hostPorts and masquerade, as README's conflist — and beside it a pod that masquerades
//! without hostPorts: each figure of the hostPort (DNAT) and masquerade (SNAT) paths as a ratio
//! to the same traffic without NAT.

use std::{net::SocketAddr, path::Path};

use anyhow::{Result, bail};
use cnibpf_tests::{
    Netns, SimHost,
    topology::{Family, ReferencePlugins},
    traffic::{EchoServer, connection_rate},
};
use serde_json::json;

use super::{
    BUSY_CLIENTS, IPERF_SECONDS, Iperf3Server, Progress, RATE_CLIENTS, RATE_WINDOW, Row,
    chart::{self, BarPanel},
    in_turn, iperf3_streams, iperf3_udp_rate, masquerade, median,
    portmap::HostPortSetup,
    write_report,
};

/// Even, so that each side goes first in as many rounds as the other.
const ROUNDS: usize = 6;

/// The figures of a pod, (path, metric, unit), in the order of [`Pod::nat_round`]: through
/// its hostPort (DNAT), then its own traffic out (SNAT); each against the same traffic on a
/// host without NAT ([`Pod::routed_round`]).
const POD_FIGURES: [(&str, &str, &str); 6] = [
    ("DNAT (hostPort)", "TCP throughput", "Gbit/s"),
    ("DNAT (hostPort)", "connection rate", "conn/s"),
    (
        "DNAT (hostPort)",
        "64-byte UDP datagrams received",
        "packets/s",
    ),
    ("SNAT (masquerade)", "TCP throughput", "Gbit/s"),
    ("SNAT (masquerade)", "connection rate", "conn/s"),
    (
        "SNAT (masquerade)",
        "64-byte UDP datagrams received",
        "packets/s",
    ),
];
/// The shapes measured, as the rows name them.
const POD: &str = "pod with hostPorts and masquerade";
const MASQUERADE_ONLY: &str = "pod with masquerade, no hostPorts";
const SIDES: [&str; 2] = ["cnibpf nftables", "reference nftables"];

/// A pod with three hostPorts (`HostPortSetup`'s) on a host that masquerades it, with an
/// iperf3 and an echo server outside for its own traffic out; on a host without NAT, the
/// baseline of every figure.
struct Pod {
    ports: HostPortSetup,
    _iperf: Iperf3Server,
    _echo: EchoServer,
}

impl Pod {
    fn new(sim: SimHost) -> Result<Self> {
        let iperf = Iperf3Server::start(&sim.outside, 5201)?;
        let echo = EchoServer::start(&sim.outside, Family::V4.any(7000), BUSY_CLIENTS);
        Ok(Self {
            ports: HostPortSetup::new(sim)?,
            _iperf: iperf,
            _echo: echo,
        })
    }

    /// One round of the figures of [`POD_FIGURES`], from outside through the hostPorts.
    fn nat_round(&self) -> Result<[f64; 6]> {
        let sim = &self.ports.sim;
        self.round(sim.uplink_target(8080), sim.uplink_target(8081))
    }

    /// The same traffic routed: from outside to the container's own address, and out.
    fn routed_round(&self) -> Result<[f64; 6]> {
        let target = self.ports.target();
        self.round(target.socket(5201), target.socket(7000))
    }

    fn round(&self, iperf: SocketAddr, echo: SocketAddr) -> Result<[f64; 6]> {
        let outside = &self.ports.sim.outside;
        let [snat_tcp, snat_rate, snat_datagrams] = snat_round(&self.ports.target().netns)?;
        Ok([
            iperf3_streams(outside, iperf, IPERF_SECONDS, 1)?,
            connection_rate(outside, echo, RATE_CLIENTS, RATE_WINDOW).per_second,
            iperf3_udp_rate(outside, iperf, IPERF_SECONDS, 64)?,
            snat_tcp,
            snat_rate,
            snat_datagrams,
        ])
    }
}

/// A container's traffic to the outside servers at 5201 (iperf3) and 7000 (echo): one TCP
/// stream's throughput, the connection rate, 64-byte UDP datagrams received per second.
fn snat_round(client: &Netns) -> Result<[f64; 3]> {
    let server = |port| SocketAddr::new(Family::V4.outside(), port);
    Ok([
        iperf3_streams(client, server(5201), IPERF_SECONDS, 1)?,
        connection_rate(client, server(7000), RATE_CLIENTS, RATE_WINDOW).per_second,
        iperf3_udp_rate(client, server(5201), IPERF_SECONDS, 64)?,
    ])
}

pub fn run(out_dir: &Path) -> Result<()> {
    let progress = Progress::new();
    progress.step(
        "pods with hostPorts and masquerade: cnibpf nftables, reference portmap and bridge nftables; pods with masquerade alone: the same; routed",
    );
    let pods = [
        Pod::new(SimHost::new(
            "bench-nfp",
            json!({ "backend": "nftables", "ipMasq": true }),
        ))?,
        Pod::new(SimHost::with_reference_portmap_and_masquerade_on(
            ReferencePlugins::Nftables,
            "bench-nrp",
        ))?,
    ];
    let masquerading = [
        masquerade::Setup::new(
            SimHost::new(
                "bench-nfm",
                json!({ "ipMasq": true, "backend": "nftables" }),
            ),
            false,
        )?,
        masquerade::Setup::new(
            SimHost::with_reference_masquerade_on(ReferencePlugins::Nftables, "bench-nrm"),
            false,
        )?,
    ];
    // Bridge and host-local alone: nothing translates, nothing else hooks.
    let routed = Pod::new(SimHost::with_chain("bench-nrt", Vec::new()))?;
    let mut pod_rounds: [Vec<[f64; 6]>; 2] = Default::default();
    let mut masquerade_rounds: [Vec<[f64; 3]>; 2] = Default::default();
    let mut routed_rounds = Vec::new();
    // Both sides alternate within each round, so that drift on this noisy machine falls on
    // both alike, and go first in turn.
    for round in 1..=ROUNDS {
        for side in in_turn(round, SIDES.len()) {
            let name = SIDES[side];
            progress.step(&format!("round {round}/{ROUNDS}: {name}, {POD}"));
            pod_rounds[side].push(pods[side].nat_round()?);
            progress.step(&format!(
                "round {round}/{ROUNDS}: {name}, {MASQUERADE_ONLY}"
            ));
            masquerade_rounds[side].push(snat_round(&masquerading[side].containers[0].netns)?);
        }
        progress.step(&format!("round {round}/{ROUNDS}: routed, no NAT"));
        routed_rounds.push(routed.routed_round()?);
    }
    let mut rows = figure_rows(&pod_rounds, &masquerade_rounds, &routed_rounds);
    if rows.iter().any(|row| row.value == 0.0) {
        bail!("no traffic passed a translation");
    }
    let comparison = comparison_rows(&rows);
    rows.extend(comparison);
    progress.step("the price of each hook cnibpf's nftables backend adds to the pod's paths");
    rows.extend(hook_prices(&progress, &pods[0])?);
    let notes = vec![format!(
        "Medians of {ROUNDS} alternating rounds, each side first in every other one. The pod: one container with hostPorts 8080/tcp, 8080/udp and 8081/tcp \
         on a host that masquerades it; DNAT: an outside client through its hostPort; SNAT: the container's own \
         traffic masqueraded to an outside server. The pod without hostPorts: SNAT alone. Every figure against the \
         same traffic on a host of bridge and host-local alone (no NAT: the outside has a route to the container, and \
         back), in the same rounds. Reference: Debian unstable's plugins (1.9) with their own nftables backends, \
         portmap and the bridge's ipMasq in one conflist. The comparison rows put cnibpf's ratio over the \
         reference's; the last rows take one hook at a time out of the pod's host's ruleset, in \
         rounds of their own, as many as there are variants, each variant first in one."
    )];
    let report = write_report(
        out_dir,
        "nftables",
        "cnibpf bench: nftables backend against the reference's nftables",
        &rows,
        &notes,
    )?;
    chart_against_reference(out_dir, &rows)?;
    let published = super::publish(out_dir, "nftables", "./dev bench nftables")?;
    progress.step(&format!(
        "report: {} and nftables.png{}",
        report.display(),
        if published {
            ", published to docs/"
        } else {
            ""
        }
    ));
    Ok(())
}

/// The measured figures, medians over the rounds: each side's pod (six), then each side's
/// pod without hostPorts (three, SNAT), each against the host without NAT.
fn figure_rows(
    pods: &[Vec<[f64; 6]>; 2],
    masquerading: &[Vec<[f64; 3]>; 2],
    routed: &[[f64; 6]],
) -> Vec<Row> {
    let column = |rounds: &[[f64; 6]], index: usize| {
        median(rounds.iter().map(|round| round[index]).collect())
    };
    let row = |scenario: String, figure: usize, value: f64| {
        let (path, metric, unit) = POD_FIGURES[figure];
        Row {
            scenario: format!("{scenario}, {path}"),
            metric,
            unit,
            value,
            baseline: Some(("no NAT".to_owned(), column(routed, figure))),
        }
    };
    let mut rows = Vec::new();
    for (side, name) in SIDES.iter().enumerate() {
        for figure in 0..6 {
            rows.push(row(
                format!("{name}, {POD}"),
                figure,
                column(&pods[side], figure),
            ));
        }
    }
    for (side, name) in SIDES.iter().enumerate() {
        for index in 0..3 {
            let value = median(
                masquerading[side]
                    .iter()
                    .map(|round| round[index])
                    .collect(),
            );
            rows.push(row(format!("{name}, {MASQUERADE_ONLY}"), index + 3, value));
        }
    }
    rows
}

/// cnibpf's ratio over the reference's for each figure of [`figure_rows`].
fn comparison_rows(rows: &[Row]) -> Vec<Row> {
    let pairs = rows[..6]
        .iter()
        .zip(&rows[6..12])
        .chain(rows[12..15].iter().zip(&rows[15..18]));
    pairs
        .map(|(cnibpf, reference)| Row {
            scenario: format!(
                "cnibpf against reference nftables, {}",
                cnibpf.scenario.trim_start_matches("cnibpf nftables, ")
            ),
            metric: cnibpf.metric,
            unit: "× baseline",
            value: cnibpf.ratio().unwrap_or(f64::NAN),
            baseline: Some((
                "reference".to_owned(),
                reference.ratio().unwrap_or(f64::NAN),
            )),
        })
        .collect()
}

/// Each figure's bar beside the reference's.
fn chart_against_reference(out_dir: &Path, rows: &[Row]) -> Result<()> {
    let labels = [
        "DNAT tput",
        "DNAT conn",
        "DNAT UDP",
        "SNAT tput",
        "SNAT conn",
        "SNAT UDP",
        "bare SNAT tput",
        "bare conn",
        "bare UDP",
    ];
    let cnibpf = rows[..6].iter().chain(&rows[12..15]);
    let reference = rows[6..12].iter().chain(&rows[15..18]);
    let bars = labels
        .iter()
        .zip(cnibpf.zip(reference))
        .flat_map(|(label, (cnibpf, reference))| {
            [
                ((*label).to_owned(), cnibpf.ratio()),
                ("ref".to_owned(), reference.ratio()),
            ]
        })
        .map(|(label, ratio)| (label, ratio.unwrap_or(f64::NAN)))
        .collect();
    chart::bars(
        &out_dir.join("nftables.png"),
        "cnibpf nftables backend against the reference's nftables",
        &[BarPanel {
            title: "NAT / without NAT (higher is better); each figure, then the reference plugins' nftables",
            y_label: "ratio",
            bars,
            reference: Some(1.0),
        }],
    )
}

/// The hooks cnibpf's nftables backend may register on a masqueraded container's path
/// beyond NAT: the name, the table (family) its chains are in, the starts of their names in
/// the order `nft` deletes them (a chain jumped to after those that jump to it).
const HOOKS: [(&str, &str, &[&str]); 3] = [
    ("source check (netdev ingress)", "netdev", &["s_"]),
    (
        "localnet guard (first packets, input)",
        "inet",
        &["localnet_new", "localnet_local", "localnet_guard"],
    ),
    ("masquerade guard (uplink egress)", "netdev", &["guard_"]),
];

/// The `nft` commands that take out the chains of table `cnibpf` of `family` in `ruleset`
/// (`nft list ruleset`) whose names start with one of `starts`, in their order.
fn deletions(ruleset: &str, family: &str, starts: &[&str]) -> Vec<String> {
    let mut in_table = false;
    let mut chains = Vec::new();
    for line in ruleset.lines() {
        if let Some(table) = line.strip_prefix("table ") {
            in_table = table.trim_end_matches(" {") == format!("{family} cnibpf");
        } else if let Some(chain) = line.trim().strip_prefix("chain ")
            && in_table
        {
            chains.push(chain.trim_end_matches(" {").to_owned());
        }
    }
    starts
        .iter()
        .flat_map(|start| chains.iter().filter(move |chain| chain.starts_with(start)))
        .map(|chain| format!("delete chain {family} cnibpf {chain}"))
        .collect()
}

/// 64-byte datagrams the pod gets out (SNAT) and in through its hostPort (DNAT) per second
/// with the whole ruleset and with each of the [`HOOKS`] the ruleset has taken out, then all
/// of them, alternating within each round, each first in one round; the ruleset is put back
/// whole after each.
fn hook_prices(progress: &Progress, pod: &Pod) -> Result<Vec<Row>> {
    let host = &pod.ports.sim.host;
    let ruleset = host.exec(&["nft", "list", "ruleset"]);
    let saved = std::env::temp_dir().join(format!("cnibpf-bench-{}.nft", std::process::id()));
    std::fs::write(&saved, &ruleset)?;
    let saved_path = saved.to_string_lossy().into_owned();
    let mut variants: Vec<(String, Vec<String>)> = HOOKS
        .iter()
        .map(|(name, family, starts)| ((*name).to_owned(), deletions(&ruleset, family, starts)))
        .filter(|(_, commands)| !commands.is_empty())
        .collect();
    variants.push((
        "all of them".to_owned(),
        variants
            .iter()
            .flat_map(|(_, commands)| commands.clone())
            .collect(),
    ));
    let outside_server = SocketAddr::new(Family::V4.outside(), 5201);
    let host_port = pod.ports.sim.uplink_target(8080);
    let rates = || -> Result<[f64; 2]> {
        Ok([
            iperf3_udp_rate(&pod.ports.target().netns, outside_server, IPERF_SECONDS, 64)?,
            iperf3_udp_rate(&pod.ports.sim.outside, host_port, IPERF_SECONDS, 64)?,
        ])
    };
    let mut whole = Vec::new();
    let mut without = vec![Vec::new(); variants.len()];
    // The whole ruleset (0) and each variant (from 1) go first in turn, one round each.
    let rounds = variants.len() + 1;
    for round in 1..=rounds {
        progress.step(&format!(
            "round {round}/{rounds}: the whole ruleset and without each hook, in turn"
        ));
        for series in in_turn(round, rounds) {
            let Some(variant) = series.checked_sub(1) else {
                whole.push(rates()?);
                continue;
            };
            for command in &variants[variant].1 {
                host.exec(&["nft", command.as_str()]);
            }
            let rates = rates();
            host.exec(&["nft", "flush", "ruleset"]);
            host.exec(&["nft", "-f", &saved_path]);
            without[variant].push(rates?);
        }
    }
    std::fs::remove_file(&saved)?;
    let path_median =
        |rounds: &[[f64; 2]], path: usize| median(rounds.iter().map(|round| round[path]).collect());
    let mut rows = Vec::new();
    for (path, name) in ["SNAT (masquerade)", "DNAT (hostPort)"]
        .into_iter()
        .enumerate()
    {
        for ((hook, _), measured) in variants.iter().zip(&without) {
            rows.push(Row {
                scenario: format!("cnibpf nftables, {POD}, {name}, without {hook}"),
                metric: "64-byte UDP datagrams received",
                unit: "packets/s",
                value: path_median(measured, path),
                baseline: Some(("the whole ruleset".to_owned(), path_median(&whole, path))),
            });
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hook_is_taken_out_by_its_chains_in_its_table_in_order() {
        let ruleset = "table inet cnibpf {\n\tchain localnet_guard {\n\t}\n\tchain localnet_new {\n\t}\n\tchain guard_x {\n\t}\n}\ntable netdev cnibpf {\n\tchain s_01 {\n\t}\n\tchain guard_eth0 {\n\t}\n\tchain g_01 {\n\t}\n}\n";
        assert_eq!(
            deletions(ruleset, "inet", HOOKS[1].2),
            [
                "delete chain inet cnibpf localnet_new",
                "delete chain inet cnibpf localnet_guard"
            ]
        );
        assert_eq!(
            deletions(ruleset, "netdev", HOOKS[2].2),
            ["delete chain netdev cnibpf guard_eth0"]
        );
        assert_eq!(
            deletions(ruleset, "netdev", HOOKS[0].2),
            ["delete chain netdev cnibpf s_01"]
        );
    }
}
