//! `cnibpf monitor`: follows the filter's drop events (the pinned `filter_events` ring buffer)
//! and prints one line — or one JSON object — per dropped packet, until Ctrl-C.

use std::{
    collections::HashMap,
    io::Write as _,
    net::IpAddr,
    path::Path,
    time::{Duration, SystemTime},
};

use cnibpf_common::{
    PROTO_ICMP, PROTO_ICMPV6, PROTO_SCTP, PROTO_TCP, PROTO_UDP, addr,
    filter::DIRECTION_INGRESS,
    filter_event::{FilterEvent, REASON_DEFAULT, REASON_FRAGMENT, REASON_RULE, REASON_SPOOFED},
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

pub fn run(pin_path: &Path, as_json: bool) -> Result<(), MonitorError> {
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
    runtime.block_on(follow(&backend, events, as_json))
}

async fn follow(
    backend: &EbpfBackend,
    events: aya::maps::RingBuf<aya::maps::MapData>,
    as_json: bool,
) -> Result<(), MonitorError> {
    // SAFETY: the ring buffer owns its map descriptor, which stays open and the same until
    // it is dropped with the `AsyncFd`.
    let mut events = unsafe { AsyncFd::register_with_interest(events, Interest::READABLE) }
        .map_err(|error| MonitorError::Io(error.into_parts().1))?;
    // Owners read from `owners` (None: not there, e.g. removed since the drop).
    let mut names: HashMap<u64, Option<AttachmentRecord>> = HashMap::new();
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
                    if !names.contains_key(&event.owner) {
                        names = backend
                            .attachments()?
                            .into_iter()
                            .map(|record| (record.owner, Some(record)))
                            .collect();
                        names.entry(event.owner).or_insert(None);
                    }
                    let attachment = names.get(&event.owner).and_then(Option::as_ref);
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
    let source = addr::from_bytes(event.src_addr, event.family);
    let destination = addr::from_bytes(event.dst_addr, event.family);
    let direction = if event.direction == DIRECTION_INGRESS {
        Direction::Ingress
    } else {
        Direction::Egress
    };
    let rule = (event.reason == REASON_RULE).then_some(event.rule_index);
    let reason = match event.reason {
        REASON_DEFAULT => "default".to_owned(),
        REASON_FRAGMENT => "fragment without its first".to_owned(),
        REASON_SPOOFED => "spoofed source".to_owned(),
        _ => format!("rule {}", event.rule_index),
    };
    // A spoofed-source event of an ARP packet (IPv4 addresses, no IP protocol) or of a frame
    // that is neither IP nor ARP (no family).
    let protocol = match (event.reason, event.family, event.protocol) {
        (REASON_SPOOFED, 0, _) => "non-IP".to_owned(),
        (REASON_SPOOFED, cnibpf_common::FAMILY_IPV4, 0) => "arp".to_owned(),
        (_, _, number) => crate::model::protocol_name(number),
    };
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
            "pod": pod.map(ToString::to_string),
            "direction": direction.as_str(),
            "verdict": Target::Drop.as_str(),
            "reason": match event.reason {
                REASON_DEFAULT => "default",
                REASON_FRAGMENT => "fragment",
                REASON_SPOOFED => "spoofed",
                _ => "rule",
            },
            "rule": rule,
            "protocol": protocol,
            "src": source.to_string(),
            "sport": event.src_port,
            "dst": destination.to_string(),
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
    format!(
        "{time} {network} {container_id} {ifname}{pod} {direction} {} by {reason}: {protocol} {} -> {}",
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
