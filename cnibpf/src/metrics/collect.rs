//! What a scrape reads: every backend's state under the instance's pinPath and the instance's
//! call statistics, as plain values. A backend whose state cannot be read is reported as such
//! (`cnibpf_datapath_readable 0`, the reason on stderr), never as empty.

use std::{collections::BTreeMap, time::Instant};

use cnibpf_common::drops::{DropCount, DropReason};

use super::Exporter;
use crate::{
    backend::{
        Access, Backend, BackendError, FlowTable, ebpf::EbpfBackend, nftables::NftablesBackend,
    },
    call_stats::{self, CallStats},
    output::log_line,
};

/// One scrape's values.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// Backends with state, and those whose state could not be read (`None`).
    pub backends: Vec<(&'static str, Option<BackendSnapshot>)>,
    /// `None`: no call recorded yet (or the file could not be read, said on stderr).
    pub calls: Option<CallStats>,
    pub calls_readable: bool,
    pub seconds: f64,
}

#[derive(Debug, Default)]
pub struct BackendSnapshot {
    pub attachments: u64,
    /// hostPorts by protocol name.
    pub host_ports: BTreeMap<&'static str, u64>,
    pub flow_tables: Vec<FlowTable>,
    /// `None`: the datapath loaded does not count drops (an older build's).
    pub drops: Option<Vec<(DropReason, DropCount)>>,
    pub rules: Vec<RulePackets>,
    /// Datapath counters by name (`inspect`'s).
    pub counters: Vec<(&'static str, u64)>,
}

/// The packets one filter rule (or the default verdict) of one attachment decided.
#[derive(Debug)]
pub struct RulePackets {
    pub pod_namespace: String,
    pub pod: String,
    pub container_id: String,
    pub ifname: String,
    /// The rule's `index`, or `default`.
    pub index: String,
    pub target: &'static str,
    pub packets: u64,
}

pub fn snapshot(exporter: &Exporter) -> Snapshot {
    let started = Instant::now();
    let mut snapshot = Snapshot::default();
    let ebpf = EbpfBackend::open_existing(&exporter.pins, Access::ReadOnly)
        .and_then(|backend| backend.map(|backend| read(&backend)).transpose());
    let nftables = NftablesBackend::open_existing(&exporter.pins, Access::ReadOnly)
        .and_then(|backend| backend.map(|backend| read_nftables(&backend)).transpose());
    for (name, read) in [("ebpf", ebpf), ("nftables", nftables)] {
        match read {
            Ok(Some(backend)) => snapshot.backends.push((name, Some(backend))),
            Ok(None) => {}
            Err(error) => {
                log_line!("cnibpf metrics: could not read the {name} backend's state: {error}");
                snapshot.backends.push((name, None));
            }
        }
    }
    match call_stats::read(&exporter.pins.call_stats_file()) {
        Ok(calls) => {
            snapshot.calls = calls;
            snapshot.calls_readable = true;
        }
        Err(error) => log_line!("cnibpf metrics: {error}"),
    }
    snapshot.seconds = started.elapsed().as_secs_f64();
    snapshot
}

/// The nftables datapath as its scrape reads it (netlink dumps, no `nft`).
fn read_nftables(backend: &NftablesBackend) -> Result<BackendSnapshot, BackendError> {
    let scraped = backend.scrape()?;
    let mut rules = Vec::new();
    for rule in &scraped.rules {
        let Some((_, attachment, pod)) = scraped
            .attachments
            .iter()
            .find(|(owner, _, _)| *owner == rule.owner)
        else {
            continue;
        };
        let (pod_namespace, pod) = pod
            .as_ref()
            .map(|pod| (pod.namespace.clone(), pod.name.clone()))
            // fail-closed: an Option: an attachment without a pod (podman, libcni) has none.
            .unwrap_or_default();
        rules.push(RulePackets {
            pod_namespace,
            pod,
            container_id: attachment.container_id.clone(),
            ifname: attachment.ifname.clone(),
            index: match rule.index {
                Some(index) => index.to_string(),
                None => "default".to_owned(),
            },
            target: rule.target.as_str(),
            packets: rule.packets,
        });
    }
    Ok(BackendSnapshot {
        attachments: scraped.attachments.len() as u64,
        host_ports: scraped.host_ports,
        flow_tables: scraped.flow_tables,
        drops: Some(scraped.drops),
        rules,
        counters: scraped.counters,
    })
}

fn read(backend: &dyn Backend) -> Result<BackendSnapshot, BackendError> {
    let attachments = backend.attachments()?;
    let mut host_ports: BTreeMap<&'static str, u64> = BTreeMap::new();
    for (_, mapping) in backend.port_mappings()? {
        *host_ports.entry(mapping.protocol.as_str()).or_default() += 1;
    }
    let mut rules = Vec::new();
    for (owner, record) in backend.filters()? {
        let Some(attachment) = attachments.iter().find(|held| held.owner == owner) else {
            continue;
        };
        let (pod_namespace, pod) = attachment
            .pod
            .as_ref()
            .map(|pod| (pod.namespace.clone(), pod.name.clone()))
            // fail-closed: an Option: an attachment without a pod (podman, libcni) has none.
            .unwrap_or_default();
        let labels = |index: String, target: &'static str, packets: u64| RulePackets {
            pod_namespace: pod_namespace.clone(),
            pod: pod.clone(),
            container_id: attachment.attachment.container_id.clone(),
            ifname: attachment.attachment.ifname.clone(),
            index,
            target,
            packets,
        };
        for (rule, (packets, _)) in record.filter.rules.iter().zip(&record.hits) {
            rules.push(labels(
                rule.index.to_string(),
                rule.target.as_str(),
                *packets,
            ));
        }
        rules.push(labels(
            "default".to_owned(),
            record.filter.default.as_str(),
            record.default_hits.0,
        ));
    }
    Ok(BackendSnapshot {
        attachments: attachments.len() as u64,
        host_ports,
        flow_tables: backend.flow_tables()?,
        drops: backend.drops()?,
        rules,
        counters: backend.counters()?,
    })
}
