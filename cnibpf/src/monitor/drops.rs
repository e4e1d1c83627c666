//! The dropped packets, from the eBPF datapath's pinned `filter_events` ring: the attachments'
//! policy (filter, source check) by default, every reason with `--drops`.

use cnibpf_common::{
    addr,
    drops::{DropReason, FilterEvent},
    filter::DIRECTION_INGRESS,
};
use serde_json::json;

use super::{Attachments, MonitorError, Shown, endpoint, named, print, records, ring, wall_clock};
use crate::{
    backend::{AttachmentRecord, ebpf::EbpfBackend},
    model::{Direction, Target},
};

/// Whether `reason` is an attachment's policy at work rather than the datapath failing to
/// serve a packet.
fn is_policy(reason: DropReason) -> bool {
    matches!(
        reason,
        DropReason::FilterRule
            | DropReason::FilterReject
            | DropReason::FilterDefault
            | DropReason::FilterFragment
            | DropReason::FilterUnreadable
            | DropReason::SourceCheckAddress
            | DropReason::SourceCheckArp
            | DropReason::SourceCheckNeighbourAdvertisement
            | DropReason::SourceCheckNotIp
    )
}

pub(super) async fn follow(
    backend: &EbpfBackend,
    events: aya::maps::RingBuf<aya::maps::MapData>,
    as_json: bool,
    shown: Shown,
) -> Result<(), MonitorError> {
    let mut events = ring(events)?;
    let mut attachments = Attachments::read(backend)?;
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    loop {
        let records = tokio::select! {
            result = &mut interrupted => return result.map_err(MonitorError::Io),
            records = records(&mut events, size_of::<FilterEvent>()) => records?,
        };
        let mut lines = Vec::new();
        for record in records {
            // SAFETY: the datapath writes whole `FilterEvent`s, checked long enough by
            // `records`; read unaligned as the ring promises only 8-byte alignment.
            let event = unsafe { record.as_ptr().cast::<FilterEvent>().read_unaligned() };
            let reason = DropReason::from_u8(event.reason);
            if shown != Shown::Every && !reason.is_some_and(is_policy) {
                continue;
            }
            // An event names its attachment, or only the interface it was dropped on (a
            // packet whose headers were not read).
            let attachment = attachments.find(backend, |record| {
                if event.owner == 0 {
                    record.host_ifindex == event.ifindex
                } else {
                    record.owner == event.owner
                }
            })?;
            lines.push(render(&event, attachment, as_json));
        }
        if !print(&lines)? {
            return Ok(());
        }
    }
}

fn render(event: &FilterEvent, attachment: Option<&AttachmentRecord>, as_json: bool) -> String {
    let time = humantime::format_rfc3339_micros(wall_clock(event.time_ns)).to_string();
    let source = addr::from_address(event.src_addr, event.family);
    let destination = addr::from_address(event.dst_addr, event.family);
    let direction = if event.direction == DIRECTION_INGRESS {
        Direction::Ingress
    } else {
        Direction::Egress
    };
    let reason = DropReason::from_u8(event.reason);
    let by_rule = matches!(
        reason,
        Some(DropReason::FilterRule | DropReason::FilterReject)
    );
    let rule = by_rule.then_some(event.rule_index);
    let verdict = if reason == Some(DropReason::FilterReject) {
        Target::Reject
    } else {
        Target::Drop
    };
    let reason_text = match reason {
        Some(DropReason::FilterRule | DropReason::FilterReject) => {
            format!("rule {}", event.rule_index)
        }
        Some(DropReason::FilterDefault) => "default".to_owned(),
        Some(DropReason::FilterFragment) => "fragment without its first".to_owned(),
        Some(DropReason::SourceCheckAddress) => "spoofed source".to_owned(),
        Some(DropReason::SourceCheckArp) => "spoofed ARP sender".to_owned(),
        Some(DropReason::SourceCheckNeighbourAdvertisement) => {
            "spoofed neighbour advertisement".to_owned()
        }
        Some(other) => other.name().replace('_', " "),
        None => format!("reason {}", event.reason),
    };
    // fail-closed: an unknown reason (a newer build's) is shown by its number.
    let reason_name = reason.map_or_else(
        || event.reason.to_string(),
        |reason| reason.name().to_owned(),
    );
    // Events of frames that are neither IP nor ARP, or whose headers were not read, carry no
    // family; an ARP packet's carries IPv4 addresses and no IP protocol.
    let protocol = match (reason, event.family, event.protocol) {
        (Some(DropReason::SourceCheckNotIp), 0, _) => "non-IP".to_owned(),
        (_, 0, _) => "unread".to_owned(),
        (Some(DropReason::SourceCheckArp), _, _) => "arp".to_owned(),
        (_, _, number) => crate::model::protocol_name(number),
    };
    let unread = event.family == 0;
    let (network, container_id, ifname) = named(attachment);
    let pod = attachment.and_then(|record| record.pod.as_ref());
    if as_json {
        return json!({
            "time": time,
            "network": network,
            "containerID": container_id,
            "ifname": ifname,
            "ifindex": event.ifindex,
            "pod": pod.map(ToString::to_string),
            "direction": direction.as_str(),
            "verdict": verdict.as_str(),
            "reason": reason_name,
            "rule": rule,
            "protocol": protocol,
            "src": (!unread).then(|| source.to_string()),
            "sport": event.src_port,
            "dst": (!unread).then(|| destination.to_string()),
            "dport": event.dst_port,
        })
        .to_string();
    }
    // fail-closed: an Option: no pod, no pod shown.
    let pod = pod.map(|pod| format!(" pod {pod}")).unwrap_or_default();
    if unread {
        return format!(
            "{time} {network} {container_id} {ifname}{pod} {direction} {verdict} by {reason_text}: {protocol}"
        );
    }
    format!(
        "{time} {network} {container_id} {ifname}{pod} {direction} {verdict} by {reason_text}: {protocol} {} -> {}",
        endpoint(event.protocol, source, event.src_port),
        endpoint(event.protocol, destination, event.dst_port)
    )
}
