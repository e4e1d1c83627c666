//! `--matches`: the new connections rules with `log` decided, one line (or JSON object) each —
//! from the eBPF datapath's pinned `filter_matches` ring, or from the NFLOG group the nftables
//! backend's `log` rules send to — and, once a second, how many the rate limit held back since
//! the last such line, when any did.

use std::time::Duration;

use cnibpf_common::{addr, filter::DIRECTION_INGRESS, filter::MatchEvent};
use serde_json::json;

use super::{Attachments, MonitorError, endpoint, named, print, records, ring, wall_clock};
use crate::{
    backend::{
        AttachmentRecord, Inspect, MATCH_EVENTS_SUPPRESSED,
        ebpf::EbpfBackend,
        nftables::{NftablesBackend, nflog},
    },
    model::{Direction, RuleMatch, Target},
};

/// One new connection a rule with `log` decided, with what only one backend tells: the
/// interface the eBPF datapath saw it on, the time it was decided (nftables: when read).
pub(super) struct Match {
    pub decided: RuleMatch,
    pub ifindex: u32,
    pub time: std::time::SystemTime,
}

impl Match {
    fn of_event(event: &MatchEvent) -> Self {
        let decided = RuleMatch {
            owner: event.owner,
            rule: event.rule_index,
            target: match event.target {
                cnibpf_common::filter::TARGET_DROP => Target::Drop,
                cnibpf_common::filter::TARGET_REJECT => Target::Reject,
                _ => Target::Allow,
            },
            direction: if event.direction == DIRECTION_INGRESS {
                Direction::Ingress
            } else {
                Direction::Egress
            },
            protocol: event.protocol,
            source: addr::from_address(event.src_addr, event.family),
            source_port: event.src_port,
            destination: addr::from_address(event.dst_addr, event.family),
            destination_port: event.dst_port,
        };
        Self {
            decided,
            ifindex: event.ifindex,
            time: wall_clock(event.time_ns),
        }
    }
}

pub(super) async fn follow_ring(
    backend: &EbpfBackend,
    events: aya::maps::RingBuf<aya::maps::MapData>,
    as_json: bool,
) -> Result<(), MonitorError> {
    let mut events = ring(events)?;
    follow(backend, as_json, async || {
        let mut matches = Vec::new();
        for record in records(&mut events, size_of::<MatchEvent>()).await? {
            // SAFETY: the datapath writes whole `MatchEvent`s, checked long enough by
            // `records`; read unaligned as the ring promises only 8-byte alignment.
            let event = unsafe { record.as_ptr().cast::<MatchEvent>().read_unaligned() };
            matches.push(Match::of_event(&event));
        }
        Ok(matches)
    })
    .await
}

pub(super) async fn follow_nflog(
    backend: &NftablesBackend,
    as_json: bool,
) -> Result<(), MonitorError> {
    let mut group = nflog::Group::bind(backend.log_group()?).map_err(MonitorError::Nflog)?;
    follow(backend, as_json, async || {
        let logged = group.next().await.map_err(MonitorError::Nflog)?;
        Ok(logged
            .into_iter()
            .map(|decided| Match {
                decided,
                ifindex: 0,
                time: std::time::SystemTime::now(),
            })
            .collect())
    })
    .await
}

/// Prints what `next` reads, until Ctrl-C; once a second, what the rate limit held back.
async fn follow(
    backend: &dyn Inspect,
    as_json: bool,
    mut next: impl AsyncFnMut() -> Result<Vec<Match>, MonitorError>,
) -> Result<(), MonitorError> {
    let mut attachments = Attachments::read(backend)?;
    let mut suppressed = suppressed_count(backend)?;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    loop {
        let lines = tokio::select! {
            result = &mut interrupted => return result.map_err(MonitorError::Io),
            _ = tick.tick() => {
                let now = suppressed_count(backend)?;
                let held_back = now.saturating_sub(suppressed);
                suppressed = now;
                if held_back == 0 {
                    continue;
                }
                vec![if as_json {
                    json!({ "suppressed": held_back }).to_string()
                } else {
                    format!("{held_back} match events suppressed by the rate limit")
                }]
            }
            matches = next() => {
                let mut lines = Vec::new();
                for found in matches? {
                    let attachment =
                        attachments.find(backend, |record| record.owner == found.decided.owner)?;
                    lines.push(render(&found, attachment, as_json));
                }
                lines
            }
        };
        if !print(&lines)? {
            return Ok(());
        }
    }
}

/// What the rate limit held back so far, as the backend counts it.
fn suppressed_count(backend: &dyn Inspect) -> Result<u64, MonitorError> {
    Ok(backend
        .counters()?
        .into_iter()
        .find(|(name, _)| *name == MATCH_EVENTS_SUPPRESSED)
        // fail-closed: an Option of a search; a backend that counts none suppressed none.
        .map_or(0, |(_, count)| count))
}

fn render(found: &Match, attachment: Option<&AttachmentRecord>, as_json: bool) -> String {
    let time = humantime::format_rfc3339_micros(found.time).to_string();
    let (network, container_id, ifname) = named(attachment);
    let pod = attachment.and_then(|record| record.pod.as_ref());
    let decided = &found.decided;
    let protocol = crate::model::protocol_name(decided.protocol);
    if as_json {
        return json!({
            "time": time,
            "event": "match",
            "network": network,
            "containerID": container_id,
            "ifname": ifname,
            // fail-closed: an Option: an event of no attachment shows its own interface.
            "ifindex": attachment.map_or(found.ifindex, |record| record.host_ifindex),
            "pod": pod.map(ToString::to_string),
            "direction": decided.direction.as_str(),
            "verdict": decided.target.as_str(),
            "rule": decided.rule,
            "protocol": protocol,
            "src": decided.source.to_string(),
            "sport": decided.source_port,
            "dst": decided.destination.to_string(),
            "dport": decided.destination_port,
        })
        .to_string();
    }
    // fail-closed: an Option: no pod, no pod shown.
    let pod = pod.map(|pod| format!(" pod {pod}")).unwrap_or_default();
    format!(
        "{time} {network} {container_id} {ifname}{pod} {} {} by rule {} (log): {protocol} {} -> {}",
        decided.direction,
        decided.target,
        decided.rule,
        endpoint(decided.protocol, decided.source, decided.source_port),
        endpoint(
            decided.protocol,
            decided.destination,
            decided.destination_port
        )
    )
}
