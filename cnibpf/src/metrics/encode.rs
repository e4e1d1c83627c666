//! A [`Snapshot`] in Prometheus' text exposition, through the Prometheus project's client: one
//! collector that encodes every family from the values read at scrape time.

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, MetricEncoder},
    metrics::MetricType,
    registry::Registry,
};

use cnibpf_common::drops::DropReason;

use super::collect::{BackendSnapshot, Snapshot};
use crate::{backend::nftables, call_stats};

/// The snapshot as exposition text: OpenMetrics, or with `classic` Prometheus' own text
/// format (0.0.4), for clients that do not ask for OpenMetrics (curl, `promtool check
/// metrics`).
pub fn text(snapshot: Snapshot, classic: bool) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Encoded(snapshot)));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry)?;
    Ok(if classic { to_classic(&text) } else { text })
}

/// OpenMetrics text as Prometheus' text format 0.0.4 says the same: a counter family is named
/// by its samples (`x_total`, where OpenMetrics names it `x`), and there is no `# EOF`.
fn to_classic(openmetrics: &str) -> String {
    let mut counters = std::collections::BTreeSet::new();
    for line in openmetrics.lines() {
        if let Some(name) = line
            .strip_prefix("# TYPE ")
            .and_then(|rest| rest.strip_suffix(" counter"))
        {
            counters.insert(name.to_owned());
        }
    }
    let mut classic = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{prefix}{name}_total {tail}"))
        });
        // fail-closed: an Option: a line that names no counter stays as it is.
        classic.push_str(renamed.as_deref().unwrap_or(line));
        classic.push('\n');
    }
    classic
}

#[derive(Debug)]
struct Encoded(Snapshot);

type Labels = Vec<(&'static str, String)>;

/// Encodes one family: its descriptor, then a sample per label set.
fn family<V>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric_type: MetricType,
    samples: impl IntoIterator<Item = (Labels, V)>,
    mut sample: impl FnMut(&mut MetricEncoder, &V) -> Result<(), std::fmt::Error>,
) -> Result<(), std::fmt::Error> {
    let samples: Vec<(Labels, V)> = samples.into_iter().collect();
    if samples.is_empty() {
        return Ok(());
    }
    let mut metric = encoder.encode_descriptor(name, help, None, metric_type)?;
    for (labels, value) in &samples {
        if labels.is_empty() {
            sample(&mut metric, value)?;
        } else {
            let mut labelled = metric.encode_family(labels)?;
            sample(&mut labelled, value)?;
        }
    }
    Ok(())
}

fn gauges(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (Labels, u64)>,
) -> Result<(), std::fmt::Error> {
    family(
        encoder,
        name,
        help,
        MetricType::Gauge,
        samples,
        // fail-closed: a count beyond i64 shows as the largest gauge.
        |metric, value| metric.encode_gauge(&i64::try_from(*value).unwrap_or(i64::MAX)),
    )
}

fn counters(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (Labels, u64)>,
) -> Result<(), std::fmt::Error> {
    family(
        encoder,
        name,
        help,
        MetricType::Counter,
        samples,
        |metric, value| metric.encode_counter::<Labels, u64, u64>(value, None),
    )
}

fn label(key: &'static str, value: impl Into<String>) -> (&'static str, String) {
    (key, value.into())
}

impl Collector for Encoded {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let snapshot = &self.0;
        let encoder = &mut encoder;
        encode_build(encoder)?;
        gauges(
            encoder,
            "cnibpf_datapath_readable",
            "Whether the backend's state could be read (0: its figures are missing from this scrape; the exporter's stderr says why)",
            snapshot
                .backends
                .iter()
                .map(|(name, read)| (vec![label("backend", *name)], u64::from(read.is_some()))),
        )?;
        encode_state(encoder, snapshot)?;
        encode_drops(encoder, snapshot)?;
        encode_filter_rules(encoder, snapshot)?;
        gauges(
            encoder,
            "cnibpf_call_statistics_readable",
            "Whether the plugin's call statistics file could be read (0: the plugin_* and reclaimed figures are missing; stderr says why)",
            [(Vec::new(), u64::from(snapshot.calls_readable))],
        )?;
        if let Some(calls) = &snapshot.calls {
            encode_calls(encoder, calls)?;
        }
        family(
            encoder,
            "cnibpf_scrape_duration_seconds",
            "How long reading the state for this scrape took",
            MetricType::Gauge,
            [(Vec::new(), snapshot.seconds)],
            |metric, seconds| metric.encode_gauge(seconds),
        )
    }
}

/// The backends whose state this scrape read, by name.
/// The value of datapath counter `counter` (`Inspect::counters`) of each backend read.
fn named<'a>(
    snapshot: &'a Snapshot,
    counter: &'static str,
) -> impl Iterator<Item = (&'static str, u64)> + 'a {
    read(snapshot).flat_map(move |(name, backend)| {
        backend
            .counters
            .iter()
            .filter(move |(held, _)| *held == counter)
            .map(move |(_, value)| (name, *value))
    })
}

fn read(snapshot: &Snapshot) -> impl Iterator<Item = (&'static str, &BackendSnapshot)> {
    snapshot
        .backends
        .iter()
        .filter_map(|(name, read)| read.as_ref().map(|read| (*name, read)))
}

fn encode_build(encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    gauges(
        encoder,
        "cnibpf_build_info",
        "The build serving these metrics: its version, commit, and the eBPF layout and nftables table layout it writes",
        [(
            vec![
                label("version", env!("CARGO_PKG_VERSION")),
                label("commit", env!("CNIBPF_COMMIT")),
                label(
                    "layout",
                    cnibpf_common::datapath::layout::stamped().to_string(),
                ),
                label("nftables_layout", nftables::TABLE_LAYOUT),
            ],
            1,
        )],
    )
}

/// What the backends hold: attachments, hostPorts, connection-tracking tables.
fn encode_state(
    encoder: &mut DescriptorEncoder,
    snapshot: &Snapshot,
) -> Result<(), std::fmt::Error> {
    gauges(
        encoder,
        "cnibpf_attachments",
        "Attachments the backend holds state for",
        read(snapshot).map(|(name, backend)| (vec![label("backend", name)], backend.attachments)),
    )?;
    gauges(
        encoder,
        "cnibpf_host_ports",
        "hostPorts installed, by protocol",
        read(snapshot).flat_map(|(name, backend)| {
            backend.host_ports.iter().map(move |(protocol, count)| {
                (
                    vec![label("backend", name), label("protocol", *protocol)],
                    *count,
                )
            })
        }),
    )?;
    let tables = || read(snapshot).flat_map(|(_, backend)| backend.flow_tables.iter());
    gauges(
        encoder,
        "cnibpf_flows",
        "Entries of each connection-tracking table the datapath relies on (expired ones included until swept)",
        tables().map(|table| (vec![label("table", table.name)], table.entries)),
    )?;
    gauges(
        encoder,
        "cnibpf_flows_max",
        "Capacity of each connection-tracking table (an eBPF table evicts its oldest entries when full; conntrack drops new connections)",
        tables().map(|table| (vec![label("table", table.name)], table.capacity)),
    )
}

/// The datapath's drops, by reason, and what they say of masquerade and the monitor.
fn encode_drops(
    encoder: &mut DescriptorEncoder,
    snapshot: &Snapshot,
) -> Result<(), std::fmt::Error> {
    let drops = || {
        read(snapshot).flat_map(|(name, backend)| {
            backend
                .drops
                .iter()
                .flatten()
                .map(move |(reason, count)| (name, *reason, *count))
        })
    };
    let by_reason = |name: &'static str, reason: DropReason| {
        vec![label("backend", name), label("reason", reason.name())]
    };
    counters(
        encoder,
        "cnibpf_packets_dropped",
        "Packets the datapath dropped, by reason",
        drops().map(|(name, reason, count)| (by_reason(name, reason), count.packets)),
    )?;
    counters(
        encoder,
        "cnibpf_bytes_dropped",
        "Bytes of the packets the datapath dropped, by reason",
        drops().map(|(name, reason, count)| (by_reason(name, reason), count.bytes)),
    )?;
    counters(
        encoder,
        "cnibpf_masquerade_port_allocation_failures",
        "Packets of new masqueraded flows for which no free source port was found (eBPF; the nftables backend's are the kernel's NAT)",
        drops()
            .filter(|(_, reason, _)| *reason == DropReason::MasqueradePortsExhausted)
            .map(|(name, _, count)| (vec![label("backend", name)], count.packets)),
    )?;
    counters(
        encoder,
        "cnibpf_masquerade_host_flow_clashes",
        "Connections of the host's own moved to another source port because a container's masqueraded connection held theirs towards the same remote (eBPF; on nftables, the kernel's NAT moves them)",
        read(snapshot).flat_map(|(name, backend)| {
            backend
                .counters
                .iter()
                .filter(|(counter, _)| *counter == crate::backend::HOST_FLOWS_MOVED)
                .map(move |(_, value)| (vec![label("backend", name)], *value))
        }),
    )?;
    counters(
        encoder,
        "cnibpf_drop_events_suppressed",
        "Drop events not written to the monitor's ring by the per-CPU rate limit (the drops themselves are all counted)",
        read(snapshot).flat_map(|(name, backend)| {
            backend
                .counters
                .iter()
                .filter(|(counter, _)| counter.starts_with("drop events suppressed"))
                .map(move |(_, value)| (vec![label("backend", name)], *value))
        }),
    )?;
    counters(
        encoder,
        "cnibpf_filter_reject_answers",
        "Answers (resets, ICMP errors) to packets REJECT rules refused: sent, and held back by the attachment's rate limit",
        named(snapshot, crate::backend::REJECT_ANSWERS_SENT)
            .map(|(name, value)| {
                (
                    vec![label("backend", name), label("outcome", "sent")],
                    value,
                )
            })
            .chain(
                named(snapshot, crate::backend::REJECT_ANSWERS_SUPPRESSED).map(|(name, value)| {
                    (
                        vec![label("backend", name), label("outcome", "suppressed")],
                        value,
                    )
                }),
            ),
    )?;
    counters(
        encoder,
        "cnibpf_filter_match_events_suppressed",
        "New connections rules with log decided that the rate limit kept from cnibpf monitor --matches",
        named(snapshot, crate::backend::MATCH_EVENTS_SUPPRESSED)
            .map(|(name, value)| (vec![label("backend", name)], value)),
    )
}

fn encode_filter_rules(
    encoder: &mut DescriptorEncoder,
    snapshot: &Snapshot,
) -> Result<(), std::fmt::Error> {
    counters(
        encoder,
        "cnibpf_filter_rule_packets",
        "Packets each filter rule (index \"default\": the default verdict) of each attachment decided",
        read(snapshot).flat_map(|(_, backend)| {
            backend.rules.iter().map(|rule| {
                (
                    vec![
                        label("pod_namespace", rule.pod_namespace.clone()),
                        label("pod", rule.pod.clone()),
                        label("container_id", rule.container_id.clone()),
                        label("ifname", rule.ifname.clone()),
                        label("index", rule.index.clone()),
                        label("target", rule.target),
                    ],
                    rule.packets,
                )
            })
        }),
    )
}

fn encode_calls(
    encoder: &mut DescriptorEncoder,
    calls: &call_stats::CallStats,
) -> Result<(), std::fmt::Error> {
    counters(
        encoder,
        "cnibpf_plugin_operations",
        "CNI calls of the plugin, by verb and result (\"ok\" or the CNI error code)",
        call_stats::VERBS
            .iter()
            .zip(&calls.verbs)
            .flat_map(|(verb, stats)| {
                stats
                    .results
                    .iter()
                    .enumerate()
                    .filter(|(_, count)| **count > 0)
                    .map(move |(slot, count)| {
                        let result = match slot {
                            0 => "ok".to_owned(),
                            slot if slot == call_stats::RESULT_SLOTS - 1 => "other".to_owned(),
                            code => code.to_string(),
                        };
                        (vec![label("verb", *verb), label("result", result)], *count)
                    })
            }),
    )?;
    let histograms: Vec<(Labels, &call_stats::VerbStats)> = call_stats::VERBS
        .iter()
        .zip(&calls.verbs)
        .filter(|(_, stats)| stats.count > 0)
        .map(|(verb, stats)| (vec![label("verb", *verb)], stats))
        .collect();
    family(
        encoder,
        "cnibpf_plugin_operation_duration_seconds",
        "Time the plugin's CNI calls took, from its start to its answer (the process's own start and exit aside)",
        MetricType::Histogram,
        histograms,
        |metric, stats| {
            let buckets: Vec<(f64, u64)> = call_stats::BUCKETS
                .iter()
                .copied()
                .chain([f64::MAX])
                .zip(stats.buckets.iter().copied())
                .collect();
            metric.encode_histogram::<Labels>(
                stats.sum_ns as f64 / 1e9,
                stats.count,
                &buckets,
                None,
            )
        },
    )?;
    counters(
        encoder,
        "cnibpf_reclaimed_attachments",
        "Attachments whose interface was gone, removed to free what they held (by an ADD needing a hostPort, or gc --stale)",
        [(Vec::new(), calls.reclaimed_attachments)],
    )
}

#[cfg(test)]
mod tests {
    use super::to_classic;

    #[test]
    fn counters_are_named_by_their_samples_in_the_classic_format() {
        let openmetrics = "# HELP a_dropped Packets.\n# TYPE a_dropped counter\na_dropped_total{r=\"x\"} 3\n# HELP b Up.\n# TYPE b gauge\nb 1\n# EOF\n";
        assert_eq!(
            to_classic(openmetrics),
            "# HELP a_dropped_total Packets.\n# TYPE a_dropped_total counter\na_dropped_total{r=\"x\"} 3\n# HELP b Up.\n# TYPE b gauge\nb 1\n"
        );
    }
}
