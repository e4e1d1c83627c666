//! `cargo xtask bench nftables`: cnibpf's nftables backend against the reference plugins' own
//! nftables backends (Debian unstable's `portmap` with `"backend": "nftables"`, its `bridge`
//! with `"ipMasqBackend": "nftables"`), head to head in one run: the six figures of the hostPort
//! (DNAT) and masquerade (SNAT) paths, each as a ratio to the same traffic without NAT.

use std::path::Path;

use anyhow::{Result, bail};
use cnibpf_tests::{SimHost, topology::ReferencePlugins};
use serde_json::json;

use super::{
    IPERF_SECONDS, Progress, Row,
    chart::{self, BarPanel},
    iperf3_udp_rate, masquerade, median,
    portmap::HostPortSetup,
    write_report,
};

const ROUNDS: usize = 5;

/// What a figure is and where its rounds put it: (path, metric, unit, index of the NAT value
/// in a round, index of its baseline). A DNAT round is a hostPort round then a forwarding one
/// (`HostPortSetup`), a SNAT round a masquerade one (`masquerade::Setup`).
const DNAT: [(&str, &str, &str, usize, usize); 3] = [
    ("DNAT (hostPort)", "TCP throughput", "Gbit/s", 1, 0),
    ("DNAT (hostPort)", "connection rate", "conn/s", 3, 2),
    (
        "DNAT (hostPort)",
        "64-byte UDP datagrams received",
        "packets/s",
        5,
        4,
    ),
];
const SNAT: [(&str, &str, &str, usize); 3] = [
    ("SNAT (masquerade)", "TCP throughput", "Gbit/s", 0),
    ("SNAT (masquerade)", "connection rate", "conn/s", 1),
    (
        "SNAT (masquerade)",
        "64-byte UDP datagrams received",
        "packets/s",
        3,
    ),
];

pub fn run(out_dir: &Path) -> Result<()> {
    let progress = Progress::new();
    progress.step(
        "hostPort hosts: cnibpf nftables, reference portmap nftables; masquerade hosts: cnibpf nftables, reference bridge nftables, routed",
    );
    let dnat = [
        HostPortSetup::new(SimHost::new("bench-nfp", json!({ "backend": "nftables" })))?,
        HostPortSetup::new(SimHost::with_reference_portmap_on(
            ReferencePlugins::Nftables,
            "bench-nrp",
        ))?,
    ];
    let snat = [
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
    let routed = masquerade::Setup::new(SimHost::new("bench-nrt", json!({})), true)?;
    let names = ["cnibpf nftables", "reference nftables"];
    let mut dnat_rounds: [Vec<Vec<f64>>; 2] = Default::default();
    let mut snat_rounds: [Vec<Vec<f64>>; 2] = Default::default();
    let mut routed_rounds = Vec::new();
    // Both sides alternate within each round, so that drift on this noisy machine falls on
    // both alike.
    for round in 1..=ROUNDS {
        for (side, name) in names.iter().enumerate() {
            progress.step(&format!("round {round}/{ROUNDS}: {name}, hostPort"));
            let mut values = dnat[side].round()?.to_vec();
            values.extend(dnat[side].forwarding_round()?);
            dnat_rounds[side].push(values);
            progress.step(&format!("round {round}/{ROUNDS}: {name}, masquerade"));
            snat_rounds[side].push(snat[side].round()?.to_vec());
        }
        progress.step(&format!("round {round}/{ROUNDS}: routed, no NAT"));
        routed_rounds.push(routed.round()?.to_vec());
    }
    let medians = |rounds: &[Vec<f64>], index: usize| {
        median(rounds.iter().map(|round| round[index]).collect())
    };
    let mut rows = Vec::new();
    for (side, name) in names.iter().enumerate() {
        for (path, metric, unit, value, baseline) in DNAT {
            rows.push(Row {
                scenario: format!("{name}, {path}"),
                metric,
                unit,
                value: medians(&dnat_rounds[side], value),
                baseline: Some(("routed".to_owned(), medians(&dnat_rounds[side], baseline))),
            });
        }
        for (path, metric, unit, index) in SNAT {
            rows.push(Row {
                scenario: format!("{name}, {path}"),
                metric,
                unit,
                value: medians(&snat_rounds[side], index),
                baseline: Some(("routed, no NAT".to_owned(), medians(&routed_rounds, index))),
            });
        }
    }
    if rows.iter().any(|row| row.value == 0.0) {
        bail!("no traffic passed a translation");
    }
    let mut comparison: Vec<Row> = rows[..6]
        .iter()
        .zip(&rows[6..])
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
        .collect();
    rows.append(&mut comparison);
    progress.step("the price of each hook cnibpf's nftables backend adds on the masquerade path");
    rows.extend(hook_prices(&progress, &snat[0])?);
    let notes = vec![format!(
        "Medians of {ROUNDS} alternating rounds. DNAT: an outside client through a hostPort of one container against the same \
         traffic routed to the container's address, on each host (as `./dev bench portmap`); SNAT: a container's traffic \
         masqueraded to an outside server against an identical host without NAT whose outside has a route back (as `./dev \
         bench masquerade`). Reference: Debian unstable's plugins (1.9) with their own nftables backends. The last six rows \
         put cnibpf's ratio over the reference's."
    )];
    let report = write_report(
        out_dir,
        "nftables",
        "cnibpf bench: nftables backend against the reference's nftables",
        &rows,
        &notes,
    )?;
    let labels = [
        "DNAT tput",
        "DNAT conn",
        "DNAT UDP",
        "SNAT tput",
        "SNAT conn",
        "SNAT UDP",
    ];
    // Each figure's bar beside the reference's.
    let bars = labels
        .iter()
        .enumerate()
        .flat_map(|(index, label)| {
            [
                ((*label).to_owned(), rows[index].ratio()),
                ("ref".to_owned(), rows[index + 6].ratio()),
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
    )?;
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

/// The hooks cnibpf's nftables backend may register on a masqueraded container's path
/// beyond NAT: the name, what `nft list ruleset` shows of it, the `nft` command that takes it
/// out.
const HOOKS: [(&str, &str, &str); 3] = [
    (
        "source check (netdev ingress)",
        "table netdev cnibpf",
        "delete table netdev cnibpf",
    ),
    (
        "localnet guard (prerouting)",
        "chain localnet_guard",
        "delete chain inet cnibpf localnet_guard",
    ),
    (
        "masquerade guard (postrouting)",
        "chain masquerade_guard",
        "delete chain inet cnibpf masquerade_guard",
    ),
];

/// 64-byte datagrams a masqueraded container gets out per second with the whole ruleset and
/// with each of the [`HOOKS`] the ruleset has taken out, then all of them, alternating within
/// each round; the ruleset is put back whole after each.
fn hook_prices(progress: &Progress, setup: &masquerade::Setup) -> Result<Vec<Row>> {
    let host = &setup.sim.host;
    let ruleset = host.exec(&["nft", "list", "ruleset"]);
    let saved = std::env::temp_dir().join(format!("cnibpf-bench-{}.nft", std::process::id()));
    std::fs::write(&saved, &ruleset)?;
    let saved_path = saved.to_string_lossy().into_owned();
    let present: Vec<(&str, &str)> = HOOKS
        .iter()
        .filter(|(_, shown, _)| ruleset.contains(shown))
        .map(|(name, _, command)| (*name, *command))
        .collect();
    let mut variants: Vec<(String, Vec<&str>)> = present
        .iter()
        .map(|(name, command)| ((*name).to_owned(), vec![*command]))
        .collect();
    variants.push((
        "all of them".to_owned(),
        present.iter().map(|(_, command)| *command).collect(),
    ));
    let rate = || {
        iperf3_udp_rate(
            &setup.containers[0].netns,
            setup.server(5201),
            IPERF_SECONDS,
            64,
        )
    };
    let mut whole = Vec::new();
    let mut without = vec![Vec::new(); variants.len()];
    for round in 1..=ROUNDS {
        progress.step(&format!(
            "round {round}/{ROUNDS}: the whole ruleset, then without each hook"
        ));
        whole.push(rate()?);
        for ((_, commands), rates) in variants.iter().zip(&mut without) {
            for command in commands {
                host.exec(&["sh", "-c", &format!("nft {command}")]);
            }
            let measured = rate();
            host.exec(&["nft", "flush", "ruleset"]);
            host.exec(&["nft", "-f", &saved_path]);
            rates.push(measured?);
        }
    }
    std::fs::remove_file(&saved)?;
    let whole = median(whole);
    Ok(variants
        .into_iter()
        .zip(without)
        .map(|((hook, _), rates)| Row {
            scenario: format!("cnibpf nftables, SNAT (masquerade), without {hook}"),
            metric: "64-byte UDP datagrams received",
            unit: "packets/s",
            value: median(rates),
            baseline: Some(("the whole ruleset".to_owned(), whole)),
        })
        .collect())
}
