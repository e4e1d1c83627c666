//! `cnibpf inspect`: the table people read.

use std::{net::IpAddr, path::Path};

use super::{Shown, Snapshot, notes};
use crate::{
    backend::{FilterRecord, MasqueradeRecord, SourceCheckRecord},
    model::masquerade::ReasonText,
};

pub fn lines(pin_path: &Path, snapshot: &Snapshot) -> Vec<String> {
    let mut lines = Vec::new();
    if snapshot.attachments.is_empty() {
        lines.push(format!("no attachments under {}", pin_path.display()));
    } else {
        lines.push(format!(
            "{:<16} {:<20} {:<8} {:<16} {:<7} {:<16}",
            "NETWORK", "CONTAINER", "IFNAME", "HOST-IF", "BACKEND", "OWNER"
        ));
    }
    for shown in &snapshot.attachments {
        attachment(&mut lines, shown);
    }
    for (backend, uplink) in &snapshot.uplinks {
        let addresses: Vec<String> = [uplink.v4.map(IpAddr::V4), uplink.v6.map(IpAddr::V6)]
            .into_iter()
            .flatten()
            .map(|addr| addr.to_string())
            .collect();
        lines.push(format!(
            "uplink {} (index {}, {backend}) masquerades to {}",
            // fail-closed: an Option the backend filled; no name is an uplink no hook attaches.
            uplink
                .ifname
                .as_deref()
                .unwrap_or("? (no hook attaches it: its interface is gone)"),
            uplink.ifindex,
            if addresses.is_empty() {
                "nothing (no address)".to_owned()
            } else {
                addresses.join(", ")
            }
        ));
    }
    for (backend, network) in &snapshot.networks {
        let members: Vec<String> = network
            .members
            .iter()
            .map(|(addr, _)| addr.to_string())
            .collect();
        lines.push(format!(
            "network {} ({backend}) has {}",
            network.network,
            members.join(", ")
        ));
    }
    datapath(&mut lines, snapshot);
    lines
}

/// An attachment's line and what it holds, indented below.
fn attachment(lines: &mut Vec<String>, shown: &Shown) {
    let Shown {
        backend,
        record,
        mappings,
        masquerade,
        filter,
        source_check,
    } = shown;
    let container: String = record.attachment.container_id.chars().take(20).collect();
    lines.push(format!(
        "{:<16} {:<20} {:<8} {:<16} {:<7} {:016x}",
        record.attachment.network,
        container,
        record.attachment.ifname,
        record.host_ifname,
        backend,
        record.owner
    ));
    if let Some(pod) = &record.pod {
        lines.push(format!("    pod {pod}"));
    }
    for mapping in mappings {
        lines.push(format!("    portmap {mapping}"));
    }
    for note in notes(backend, mappings) {
        lines.push(format!("    note: {note}"));
    }
    if let Some(record) = masquerade {
        lines.push(masquerade_line(record));
    }
    lines.push(source_check_line(source_check.as_ref()));
    if let Some(filter) = filter {
        filter_lines(lines, filter);
    }
}

fn masquerade_line(record: &MasqueradeRecord) -> String {
    let sources: Vec<String> = record
        .masquerade
        .sources
        .iter()
        .map(ToString::to_string)
        .collect();
    let excludes: Vec<String> = record
        .masquerade
        .excludes
        .iter()
        .map(|(net, reason)| format!("{net} ({})", ReasonText(*reason)))
        .collect();
    format!(
        "    masquerade {} except to {}; {} tracked flows",
        sources.join(", "),
        excludes.join(", "),
        record.flows
    )
}

fn source_check_line(record: Option<&SourceCheckRecord>) -> String {
    match record {
        Some(record) => {
            let (packets, bytes) = record.dropped;
            format!(
                "    sources {}; spoofed: {packets} packets, {bytes} bytes dropped",
                record.check
            )
        }
        None => "    sources not checked".to_owned(),
    }
}

/// The filter's summary and each rule with its counters.
fn filter_lines(lines: &mut Vec<String>, filter: &FilterRecord) {
    let (packets, bytes) = filter.default_hits;
    let count = filter.filter.rules.len();
    lines.push(format!(
        "    filter: {count} rule{}, default {} ({packets} packets, {bytes} bytes); {} tracked connections",
        if count == 1 { "" } else { "s" },
        filter.filter.default.as_str(),
        filter.flows
    ));
    for (rule, (packets, bytes)) in filter.filter.rules.iter().zip(&filter.hits) {
        lines.push(format!(
            "      {:>10} {:<5} {:<60} {packets:>10} packets {bytes:>12} bytes",
            rule.index,
            rule.target.as_str(),
            rule.to_string()
        ));
    }
}

/// What the datapath keeps as a whole: counters, drops, flow tables, memory, and the host's
/// chains it passes by.
fn datapath(lines: &mut Vec<String>, snapshot: &Snapshot) {
    lines.extend(snapshot.namespace.clone());
    for (backend, values) in &snapshot.counters {
        lines.push(format!("{backend} counters:"));
        for (name, value) in values {
            lines.push(format!("    {name:<36} {value}"));
        }
    }
    for (backend, counted) in &snapshot.drops {
        let Some(counted) = counted else {
            lines.push(format!(
                "{backend} drops: not counted by the datapath loaded (an older build's; the next ADD replaces it)"
            ));
            continue;
        };
        lines.push(format!("{backend} drops:"));
        for (reason, count) in counted {
            lines.push(format!(
                "    {:<36} {:>10} packets {:>12} bytes",
                reason.name(),
                count.packets,
                count.bytes
            ));
        }
    }
    for (backend, tables) in &snapshot.flow_tables {
        lines.push(format!("{backend} flow tables:"));
        for table in tables {
            lines.push(format!(
                "    {:<36} {:>10} of {:>10} entries",
                table.name, table.entries, table.capacity
            ));
        }
    }
    if let Some(memory) = &snapshot.memory {
        lines.push(format!(
            "ebpf maps: {} locking {:.1} MiB, sized {}",
            memory.maps,
            memory.bytes as f64 / 1_048_576.0,
            memory.capacity
        ));
    }
    if !snapshot.bypassed.is_empty() {
        let chains: Vec<String> = snapshot
            .bypassed
            .iter()
            .map(|chain| {
                let plural = if chain.rules == 1 { "" } else { "s" };
                format!(
                    "{} {} {} ({} rule{plural})",
                    chain.family, chain.table, chain.name, chain.rules
                )
            })
            .collect();
        lines.push(format!(
            "note: the host's firewall chains {} do not see what the eBPF datapath forwards (hostPort traffic from outside, replies, masquerade, hairpin) for attachments without hostFirewall: true; cnibpf's filter rules do, and the nftables backend keeps that traffic in the stack",
            chains.join(", ")
        ));
    }
}
