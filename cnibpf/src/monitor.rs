//! `cnibpf monitor`: follows the datapath's drop events (the pinned `filter_events` ring
//! buffer) and prints one line — or one JSON object — per dropped packet, until Ctrl-C: the
//! attachments' policy (filter, source check) by default, every reason with `--drops`.

use std::{
    io::Write as _,
    net::IpAddr,
    path::Path,
    time::{Duration, Instant, SystemTime},
};

use cnibpf_common::{
    PROTO_ICMP, PROTO_ICMPV6, PROTO_SCTP, PROTO_TCP, PROTO_UDP, addr,
    drops::{DropReason, FilterEvent},
    filter::DIRECTION_INGRESS,
};
use nix::time::{ClockId, clock_gettime};
use serde_json::json;
use tokio::io::{Interest, unix::AsyncFd};

use crate::{
    backend::{AttachmentRecord, BackendError, Inspect as _, ebpf::EbpfBackend},
    lock::{InstanceLock, LockError},
    model::{Direction, Target},
    paths::PinLayout,
};

#[derive(Debug, thiserror::Error)]
pub enum MonitorError {
    #[error("no eBPF state under {0}: nothing is filtered there")]
    NoState(String),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(
        "another cnibpf monitor follows the drop events of {0}: each event goes to one reader, stop that one first"
    )]
    Busy(String),
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("could not wait for events")]
    Io(#[from] std::io::Error),
    #[error("could not write to stdout")]
    Output(#[source] std::io::Error),
}

/// Which drops `cnibpf monitor` shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shown {
    /// What the attachments' policy drops: the filter and the source check.
    Policy,
    /// Every drop, whatever its reason.
    Every,
}

impl Shown {
    fn includes(self, reason: Option<DropReason>) -> bool {
        self == Self::Every || reason.is_some_and(is_policy)
    }
}

/// Whether `reason` is an attachment's policy at work rather than the datapath failing to
/// serve a packet.
fn is_policy(reason: DropReason) -> bool {
    matches!(
        reason,
        DropReason::FilterRule
            | DropReason::FilterDefault
            | DropReason::FilterFragment
            | DropReason::FilterUnreadable
            | DropReason::SourceCheckAddress
            | DropReason::SourceCheckArp
            | DropReason::SourceCheckNeighbourAdvertisement
            | DropReason::SourceCheckNotIp
    )
}

pub fn run(pin_path: &Path, as_json: bool, shown: Shown) -> Result<(), MonitorError> {
    let pins = PinLayout::new(pin_path);
    let _reader = match InstanceLock::acquire(&pins.monitor_lock_file(), Duration::ZERO) {
        Err(LockError::Timeout { .. }) => {
            return Err(MonitorError::Busy(pin_path.display().to_string()));
        }
        other => other?,
    };
    let backend = EbpfBackend::open_existing(&pins, crate::backend::Access::ReadOnly)?
        .ok_or_else(|| MonitorError::NoState(pin_path.display().to_string()))?;
    let events = backend.drop_events()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    runtime.block_on(follow(&backend, events, as_json, shown))
}

async fn follow(
    backend: &EbpfBackend,
    events: aya::maps::RingBuf<aya::maps::MapData>,
    as_json: bool,
    shown: Shown,
) -> Result<(), MonitorError> {
    // SAFETY: the ring buffer owns its map descriptor, which stays open and the same until
    // it is dropped with the `AsyncFd`.
    let mut events = unsafe { AsyncFd::register_with_interest(events, Interest::READABLE) }
        .map_err(|error| MonitorError::Io(error.into_parts().1))?;
    // The attachments as last read from `owners`, read again when an event names one that is
    // not among them (it may have been added since) — at most once a second, whatever the
    // rate of such events.
    let mut attachments: Vec<AttachmentRecord> = backend.attachments()?;
    let mut read_at = Instant::now();
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    loop {
        tokio::select! {
            result = &mut interrupted => return result.map_err(MonitorError::Io),
            guard = events.readable_mut() => {
                let mut guard = guard?;
                // Readiness is cleared before the ring is drained, not after: the kernel wakes
                // a reader only when it had caught up, so an event written between the last
                // read and a later clear would wait unseen for the next one.
                guard.clear_ready();
                let ring = guard.get_inner_mut();
                let mut lines = Vec::new();
                while let Some(item) = ring.next() {
                    if item.len() < size_of::<FilterEvent>() {
                        continue;
                    }
                    // SAFETY: the datapath writes whole `FilterEvent`s, checked long enough
                    // just above; read unaligned as the ring promises only 8-byte alignment.
                    let event = unsafe { item.as_ptr().cast::<FilterEvent>().read_unaligned() };
                    if !shown.includes(DropReason::from_u8(event.reason)) {
                        continue;
                    }
                    // An event names its attachment, or only the interface it was dropped on
                    // (a packet whose headers were not read).
                    let of_event = |record: &AttachmentRecord| {
                        if event.owner == 0 {
                            record.host_ifindex == event.ifindex
                        } else {
                            record.owner == event.owner
                        }
                    };
                    if !attachments.iter().any(of_event)
                        && read_at.elapsed() >= Duration::from_secs(1)
                    {
                        attachments = backend.attachments()?;
                        read_at = Instant::now();
                    }
                    let attachment = attachments.iter().find(|record| of_event(record));
                    lines.push(render(&event, attachment, as_json));
                }
                let mut out = std::io::stdout().lock();
                for line in lines {
                    match writeln!(out, "{line}").and_then(|()| out.flush()) {
                        Ok(()) => {}
                        // A closed stdout (the reader went away) ends the monitor like Ctrl-C.
                        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => {
                            return Ok(());
                        }
                        Err(error) => return Err(MonitorError::Output(error)),
                    }
                }
            }
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
    let rule = (reason == Some(DropReason::FilterRule)).then_some(event.rule_index);
    let reason_text = match reason {
        Some(DropReason::FilterRule) => format!("rule {}", event.rule_index),
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
    // fail-closed: an Option: an event of an attachment gone since shows "?".
    let (network, container_id, ifname) = attachment.map_or(("?", "?", "?"), |record| {
        (
            record.attachment.network.as_str(),
            record.attachment.container_id.as_str(),
            record.attachment.ifname.as_str(),
        )
    });
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
            "verdict": Target::Drop.as_str(),
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
    let endpoint = |addr: IpAddr, port: u16| match (event.protocol, addr) {
        (PROTO_TCP | PROTO_UDP | PROTO_SCTP, IpAddr::V6(addr)) => format!("[{addr}]:{port}"),
        (PROTO_TCP | PROTO_UDP | PROTO_SCTP, addr) => format!("{addr}:{port}"),
        (PROTO_ICMP | PROTO_ICMPV6, addr) if port != 0 => format!("{addr} (echo id {port})"),
        (_, addr) => addr.to_string(),
    };
    // fail-closed: an Option: no pod, no pod shown.
    let pod = pod.map(|pod| format!(" pod {pod}")).unwrap_or_default();
    if unread {
        return format!(
            "{time} {network} {container_id} {ifname}{pod} {direction} {} by {reason_text}: {protocol}",
            Target::Drop,
        );
    }
    format!(
        "{time} {network} {container_id} {ifname}{pod} {direction} {} by {reason_text}: {protocol} {} -> {}",
        Target::Drop,
        endpoint(source, event.src_port),
        endpoint(destination, event.dst_port)
    )
}

/// The wall-clock time of a datapath timestamp (CLOCK_MONOTONIC).
fn wall_clock(monotonic_ns: u64) -> SystemTime {
    let now = SystemTime::now();
    // fail-closed: a clock that cannot be read dates the event now, for display only.
    let Ok(monotonic) = clock_gettime(ClockId::CLOCK_MONOTONIC) else {
        return now;
    };
    let monotonic_now = Duration::from(monotonic).as_nanos();
    let age = monotonic_now.saturating_sub(u128::from(monotonic_ns));
    // fail-closed: no kernel result; an age beyond u64 nanoseconds is centuries.
    now - Duration::from_nanos(u64::try_from(age).unwrap_or(u64::MAX))
}
