//! `cnibpf inspect --json`: one document.

use serde_json::{Map, Value, json};

use super::{Shown, Snapshot, notes};
use crate::{backend::FilterRecord, model::masquerade::ReasonText, paths::PinLayout};

pub fn document(pins: &PinLayout, snapshot: &Snapshot) -> Value {
    let uplinks: Vec<Value> = snapshot
        .uplinks
        .iter()
        .map(|(backend, uplink)| {
            json!({
                "backend": backend,
                "ifindex": uplink.ifindex,
                "ifname": uplink.ifname,
                "masqueradeV4": uplink.v4.map(|addr| addr.to_string()),
                "masqueradeV6": uplink.v6.map(|addr| addr.to_string()),
            })
        })
        .collect();
    json!({
        "pinPath": pins.root(),
        "lockFile": pins.lock_file(),
        "callStatsFile": pins.call_stats_file(),
        "attachments": snapshot.attachments.iter().map(attachment).collect::<Vec<_>>(),
        "uplinks": uplinks,
        "networks": snapshot.networks.iter().map(|(backend, network)| json!({
            "backend": backend,
            "network": network.network,
            "members": network.members.iter().map(|(addr, owner)| json!({
                "address": addr.to_string(),
                "owner": format!("{owner:016x}"),
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "ebpfNamespace": snapshot.namespace,
        "counters": by_backend(&snapshot.counters, |values| {
            Value::Object(values.iter().map(|(name, value)| ((*name).to_owned(), json!(value))).collect())
        }),
        "drops": by_backend(&snapshot.drops, |counted| json!(counted.as_ref().map(|counted| {
            counted
                .iter()
                .map(|(reason, count)| {
                    (reason.name().to_owned(), json!({ "packets": count.packets, "bytes": count.bytes }))
                })
                .collect::<Map<_, _>>()
        }))),
        "flowTables": by_backend(&snapshot.flow_tables, |tables| json!(tables.iter().map(|table| json!({
            "table": table.name,
            "entries": table.entries,
            "capacity": table.capacity,
        })).collect::<Vec<_>>())),
        "ebpfMaps": snapshot.memory.as_ref().map(|memory| {
            let mut sizes: Map<String, Value> = memory
                .capacity
                .keys()
                .map(|(key, size)| (key.to_owned(), json!(size)))
                .collect();
            sizes.insert("maps".to_owned(), json!(memory.maps));
            sizes.insert("memlockBytes".to_owned(), json!(memory.bytes));
            sizes
        }),
        "bypassedHostChains": snapshot.bypassed.iter().map(|chain| json!({
            "family": chain.family,
            "table": chain.table,
            "chain": chain.name,
            "hook": chain.hook,
            "rules": chain.rules,
        })).collect::<Vec<_>>(),
    })
}

/// An object keyed by backend, each value made by `value`.
fn by_backend<T>(list: &[(&'static str, T)], value: impl Fn(&T) -> Value) -> Map<String, Value> {
    list.iter()
        .map(|(backend, item)| ((*backend).to_owned(), value(item)))
        .collect()
}

fn attachment(shown: &Shown) -> Value {
    let Shown {
        backend,
        record,
        mappings,
        masquerade,
        filter,
        source_check,
    } = shown;
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
        "filter": filter.as_ref().map(filter_document),
        "sourceCheck": source_check.as_ref().map(|record| json!({
            "addresses": record.check.addresses.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "droppedPackets": record.dropped.0,
            "droppedBytes": record.dropped.1,
        })),
        "notes": notes(backend, mappings),
    })
}

fn filter_document(record: &FilterRecord) -> Value {
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
