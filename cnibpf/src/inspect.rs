//! `cnibpf inspect`: the state of an instance, for people (a table) or scripts (`--json`).

use std::{io::Write as _, net::IpAddr, path::Path};

use serde_json::json;

use crate::{
    backend::{
        self, AttachmentRecord, BackendError, FilterRecord, MasqueradeRecord, SourceCheckRecord,
        nftables,
    },
    cni::error::Error,
    instance::Instance,
    model::{ResolvedMapping, masquerade::ReasonText},
    paths::PinLayout,
};

pub fn run(pin_path: &Path, as_json: bool) -> Result<(), Error> {
    let pins = PinLayout::new(pin_path);
    let mut attachments = Vec::new();
    let mut counters = Vec::new();
    let mut drops = Vec::new();
    let mut flow_tables = Vec::new();
    let mut uplinks = Vec::new();
    let instance = Instance::to_read(&pins)?;
    for backend in instance.backends() {
        let mappings = backend.port_mappings()?;
        let masquerades = backend.masquerades()?;
        let filters = backend.filters()?;
        let source_checks = backend.source_checks()?;
        for record in backend.attachments()? {
            let mut own: Vec<_> = mappings
                .iter()
                .filter(|(owner, _)| *owner == record.owner)
                .map(|(_, mapping)| *mapping)
                .collect();
            own.sort_by_key(|mapping| (mapping.protocol, mapping.host_port, mapping.host_addr));
            let masquerade = masquerades
                .iter()
                .find(|(owner, _)| *owner == record.owner)
                .map(|(_, masquerade)| masquerade.clone())
                .filter(|masquerade| !masquerade.masquerade.sources.is_empty());
            let filter = filters
                .iter()
                .find(|(owner, _)| *owner == record.owner)
                .map(|(_, filter)| filter.clone());
            let source_check = source_checks
                .iter()
                .find(|(owner, _)| *owner == record.owner)
                .map(|(_, check)| check.clone());
            attachments.push(Shown {
                backend: backend.name(),
                record,
                mappings: own,
                masquerade,
                filter,
                source_check,
            });
        }
        counters.push((backend.name(), backend.counters()?));
        drops.push((backend.name(), backend.drops()?));
        flow_tables.push((backend.name(), backend.flow_tables()?));
        for uplink in backend.uplink_addresses()? {
            uplinks.push((backend.name(), uplink));
        }
    }
    let memory = if flow_tables.iter().any(|(backend, _)| *backend == "ebpf") {
        Some(backend::ebpf::memory(&pins)?)
    } else {
        None
    };
    attachments.sort_by(|a, b| {
        let key = |shown: &Shown| {
            let attachment = &shown.record.attachment;
            (
                attachment.network.clone(),
                attachment.container_id.clone(),
                attachment.ifname.clone(),
            )
        };
        key(a).cmp(&key(b))
    });
    // The eBPF datapath hands what it translates past the host's own chains (docs/datapath.md:
    // the host's firewall); a user whose rules would judge that traffic should know.
    let bypassed = if attachments.iter().any(|shown| shown.backend == "ebpf") {
        nftables::firewall_chains().map_err(BackendError::from)?
    } else {
        Vec::new()
    };
    let mut lines = Vec::new();
    if as_json {
        let list: Vec<_> = attachments
            .iter()
            .map(|Shown { backend, record, mappings, masquerade, filter, source_check }| {
                json!({
                    "network": record.attachment.network,
                    "containerID": record.attachment.container_id,
                    "ifname": record.attachment.ifname,
                    "pod": record.pod.as_ref().map(ToString::to_string),
                    "owner": format!("{:016x}", record.owner),
                    "backend": backend,
                    "hostInterface": record.host_ifname,
                    "hostIfindex": record.host_ifindex,
                    "portMappings": mappings.iter().map(|mapping| json!({
                        "protocol": mapping.protocol.as_str(),
                        "hostIP": mapping.host_addr.map(|addr| addr.to_string()),
                        "hostPort": mapping.host_port,
                        "containerIP": mapping.container_addr.to_string(),
                        "containerPort": mapping.container_port,
                    })).collect::<Vec<_>>(),
                    "masquerade": masquerade.as_ref().map(|record| json!({
                        "sources": record.masquerade.sources.iter().map(ToString::to_string).collect::<Vec<_>>(),
                        "excludes": record.masquerade.excludes.iter().map(|(net, reason)| json!({
                            "destination": net.to_string(),
                            "reason": ReasonText(*reason).to_string(),
                        })).collect::<Vec<_>>(),
                        "flows": record.flows,
                    })),
                    "filter": filter.as_ref().map(filter_json),
                    "sourceCheck": source_check.as_ref().map(|record| json!({
                        "addresses": record.check.addresses.iter().map(ToString::to_string).collect::<Vec<_>>(),
                        "droppedPackets": record.dropped.0,
                        "droppedBytes": record.dropped.1,
                    })),
                    "notes": notes(backend, mappings),
                })
            })
            .collect();
        let counters: serde_json::Map<String, serde_json::Value> = counters
            .iter()
            .map(|(backend, values)| {
                let values: serde_json::Map<String, serde_json::Value> = values
                    .iter()
                    .map(|(name, value)| ((*name).to_owned(), json!(value)))
                    .collect();
                ((*backend).to_owned(), serde_json::Value::Object(values))
            })
            .collect();
        let uplinks = uplinks
            .iter()
            .map(|(backend, uplink)| {
                Ok(json!({
                    "backend": backend,
                    "ifindex": uplink.ifindex,
                    "ifname": interface_name(uplink.ifindex)?,
                    "masqueradeV4": uplink.v4.map(|addr| addr.to_string()),
                    "masqueradeV6": uplink.v6.map(|addr| addr.to_string()),
                }))
            })
            .collect::<Result<Vec<_>, Error>>()?;
        let drops: serde_json::Map<String, serde_json::Value> = drops
            .iter()
            .map(|(backend, counted)| {
                let counted = counted.as_ref().map(|counted| {
                    counted
                        .iter()
                        .map(|(reason, count)| {
                            (
                                reason.name().to_owned(),
                                json!({ "packets": count.packets, "bytes": count.bytes }),
                            )
                        })
                        .collect::<serde_json::Map<_, _>>()
                });
                ((*backend).to_owned(), json!(counted))
            })
            .collect();
        let flow_tables: serde_json::Map<String, serde_json::Value> = flow_tables
            .iter()
            .map(|(backend, tables)| {
                let tables: Vec<_> = tables
                    .iter()
                    .map(|table| {
                        json!({
                            "table": table.name,
                            "entries": table.entries,
                            "capacity": table.capacity,
                        })
                    })
                    .collect();
                ((*backend).to_owned(), json!(tables))
            })
            .collect();
        let document = json!({
            "pinPath": pin_path,
            "lockFile": pins.lock_file(),
            "callStatsFile": pins.call_stats_file(),
            "attachments": list,
            "uplinks": uplinks,
            "counters": counters,
            "drops": drops,
            "flowTables": flow_tables,
            "ebpfMaps": memory.as_ref().map(|memory| {
                let mut sizes: serde_json::Map<String, serde_json::Value> = memory
                    .capacity
                    .keys()
                    .map(|(key, size)| (key.to_owned(), json!(size)))
                    .collect();
                sizes.insert("maps".to_owned(), json!(memory.maps));
                sizes.insert("memlockBytes".to_owned(), json!(memory.bytes));
                sizes
            }),
            "bypassedHostChains": bypassed.iter().map(|chain| json!({
                "family": chain.family,
                "table": chain.table,
                "chain": chain.name,
                "hook": chain.hook,
                "rules": chain.rules,
            })).collect::<Vec<_>>(),
        });
        lines.push(format!("{document:#}"));
        return print(&lines);
    }
    if attachments.is_empty() {
        lines.push(format!("no attachments under {}", pin_path.display()));
    } else {
        lines.push(format!(
            "{:<16} {:<20} {:<8} {:<16} {:<7} {:<16}",
            "NETWORK", "CONTAINER", "IFNAME", "HOST-IF", "BACKEND", "OWNER"
        ));
    }
    for Shown {
        backend,
        record,
        mappings,
        masquerade,
        filter,
        source_check,
    } in &attachments
    {
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
            lines.push(format!("    portmap {}", mapping));
        }
        for note in notes(backend, mappings) {
            lines.push(format!("    note: {note}"));
        }
        if let Some(record) = masquerade {
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
            lines.push(format!(
                "    masquerade {} except to {}; {} tracked flows",
                sources.join(", "),
                excludes.join(", "),
                record.flows
            ));
        }
        match source_check {
            Some(record) => {
                let (packets, bytes) = record.dropped;
                lines.push(format!(
                    "    sources {}; spoofed: {packets} packets, {bytes} bytes dropped",
                    record.check
                ));
            }
            None => {
                lines.push("    sources not checked".to_owned());
            }
        }
        if let Some(filter) = filter {
            let (packets, bytes) = filter.default_hits;
            lines.push(format!(
                "    filter: {} rule{}, default {} ({packets} packets, {bytes} bytes); {} tracked connections",
                filter.filter.rules.len(),
                if filter.filter.rules.len() == 1 {
                    ""
                } else {
                    "s"
                },
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
    }
    for (backend, uplink) in &uplinks {
        let addresses: Vec<String> = [uplink.v4.map(IpAddr::V4), uplink.v6.map(IpAddr::V6)]
            .into_iter()
            .flatten()
            .map(|addr| addr.to_string())
            .collect();
        lines.push(format!(
            "uplink {} (index {}, {backend}) masquerades to {}",
            // fail-closed: `interface_name` kept the errors; a gone uplink is shown as "?".
            interface_name(uplink.ifindex)?.unwrap_or_else(|| "?".to_owned()),
            uplink.ifindex,
            if addresses.is_empty() {
                "nothing (no address)".to_owned()
            } else {
                addresses.join(", ")
            }
        ));
    }
    for (backend, values) in &counters {
        lines.push(format!("{backend} counters:"));
        for (name, value) in values {
            lines.push(format!("    {name:<36} {value}"));
        }
    }
    for (backend, counted) in &drops {
        match counted {
            Some(counted) => {
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
            None => lines.push(format!(
                "{backend} drops: not counted by the datapath loaded (an older build's; the next ADD replaces it)"
            )),
        }
    }
    for (backend, tables) in &flow_tables {
        lines.push(format!("{backend} flow tables:"));
        for table in tables {
            lines.push(format!(
                "    {:<36} {:>10} of {:>10} entries",
                table.name, table.entries, table.capacity
            ));
        }
    }
    if let Some(memory) = &memory {
        lines.push(format!(
            "ebpf maps: {} locking {:.1} MiB, sized {}",
            memory.maps,
            memory.bytes as f64 / 1_048_576.0,
            memory.capacity
        ));
    }
    if !bypassed.is_empty() {
        let chains: Vec<String> = bypassed
            .iter()
            .map(|chain| {
                format!(
                    "{} {} {} ({} rule{})",
                    chain.family,
                    chain.table,
                    chain.name,
                    chain.rules,
                    if chain.rules == 1 { "" } else { "s" }
                )
            })
            .collect();
        lines.push(format!(
            "note: the host's firewall chains {} do not see what the eBPF datapath forwards (hostPort traffic from outside, replies, masquerade, hairpin) for attachments without hostFirewall: true; cnibpf's filter rules do, and the nftables backend keeps that traffic in the stack",
            chains.join(", ")
        ));
    }
    print(&lines)
}

/// One attachment as inspect shows it.
struct Shown {
    backend: &'static str,
    record: AttachmentRecord,
    mappings: Vec<ResolvedMapping>,
    masquerade: Option<MasqueradeRecord>,
    filter: Option<FilterRecord>,
    source_check: Option<SourceCheckRecord>,
}

fn filter_json(record: &FilterRecord) -> serde_json::Value {
    let (packets, bytes) = record.default_hits;
    json!({
        "default": record.filter.default.as_str(),
        "defaultHits": { "packets": packets, "bytes": bytes },
        "flows": record.flows,
        "rules": record.filter.rules.iter().zip(&record.hits).map(|(rule, (packets, bytes))| json!({
            "index": rule.index,
            "target": rule.target.as_str(),
            "src": rule.src.map(|net| net.to_string()),
            "dst": rule.dst.map(|net| net.to_string()),
            "proto": rule.protocol.as_str(),
            "sport": rule.sport.map(|range| range.to_string()),
            "dport": rule.dport.map(|range| range.to_string()),
            "connstate": rule.connstate.as_str(),
            "direction": rule.direction.as_str(),
            "packets": packets,
            "bytes": bytes,
        })).collect::<Vec<_>>(),
    })
}

/// What an attachment's user should know that its state does not show.
fn notes(backend: &str, mappings: &[ResolvedMapping]) -> Vec<String> {
    let loopback_v6: Vec<String> = mappings
        .iter()
        .filter(|mapping| {
            !mapping.is_ipv4() && mapping.host_addr.is_none_or(|addr| addr.is_loopback())
        })
        .map(|mapping| format!("{}/{}", mapping.host_port, mapping.protocol))
        .collect();
    if backend != "nftables" || loopback_v6.is_empty() {
        return Vec::new();
    }
    vec![format!(
        "host processes cannot reach [::1]:{} through the nftables backend (IPv6 has no route_localnet); they can by 127.0.0.1 and the host's addresses",
        loopback_v6.join(", [::1]:")
    )]
}

/// The interface's current name, `None` when the kernel says it is gone.
fn interface_name(ifindex: u32) -> Result<Option<String>, Error> {
    Ok(crate::netlink::link_if_there(ifindex)?.map(|link| link.name))
}

/// Writes the report; one that cannot be written is the command's failure.
fn print(lines: &[String]) -> Result<(), Error> {
    let mut out = std::io::stdout().lock();
    for line in lines {
        writeln!(out, "{line}").map_err(Error::Output)?;
    }
    out.flush().map_err(Error::Output)
}
