//! `--matches`: the new connections rules with `log` decided, one line (or JSON object) each —
//! from the eBPF datapath's pinned `filter_matches` ring, or from the NFLOG group the nftables
//! backend's `log` rules send to — and, once a second, how many the rate limit held back since
//! the last such line, when any did.

use std::{net::IpAddr, time::Duration};

use cnibpf_common::{addr, filter::DIRECTION_INGRESS, filter::MatchEvent};
use serde_json::json;

use super::{Attachments, MonitorError, endpoint, named, print, records, ring, wall_clock};
use crate::{
    backend::{
        AttachmentRecord, Inspect, MATCH_EVENTS_SUPPRESSED,
        ebpf::EbpfBackend,
        nftables::{NftablesBackend, nflog},
    },
    model::{Direction, Target},
};

/// One new connection a rule with `log` decided, as either backend reports it.
pub(super) struct Match {
    pub owner: u64,
    pub ifindex: u32,
    pub rule: u32,
    pub target: Target,
    pub direction: Direction,
    pub protocol: u8,
    pub source: IpAddr,
    pub source_port: u16,
    pub destination: IpAddr,
    pub destination_port: u16,
    pub time: std::time::SystemTime,
}

impl Match {
    fn of_event(event: &MatchEvent) -> Self {
        Self {
            owner: event.owner,
            ifindex: event.ifindex,
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
            .map(|logged| Match {
                owner: logged.owner,
                ifindex: 0,
                rule: logged.rule,
                target: logged.target,
                direction: logged.direction,
                protocol: logged.protocol,
                source: logged.source,
                source_port: logged.source_port,
                destination: logged.destination,
                destination_port: logged.destination_port,
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
                        attachments.find(backend, |record| record.owner == found.owner)?;
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
    let protocol = crate::model::protocol_name(found.protocol);
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
            "direction": found.direction.as_str(),
            "verdict": found.target.as_str(),
            "rule": found.rule,
            "protocol": protocol,
            "src": found.source.to_string(),
            "sport": found.source_port,
            "dst": found.destination.to_string(),
            "dport": found.destination_port,
        })
        .to_string();
    }
    // fail-closed: an Option: no pod, no pod shown.
    let pod = pod.map(|pod| format!(" pod {pod}")).unwrap_or_default();
    format!(
        "{time} {network} {container_id} {ifname}{pod} {} {} by rule {} (log): {protocol} {} -> {}",
        found.direction,
        found.target,
        found.rule,
        endpoint(found.protocol, found.source, found.source_port),
        endpoint(found.protocol, found.destination, found.destination_port)
    )
}
