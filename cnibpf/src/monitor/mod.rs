//! `cnibpf monitor`: follows the datapath's events and prints one line — or one JSON object —
//! each, until Ctrl-C. By default and with `--drops` the dropped packets (the eBPF datapath's
//! pinned `filter_events` ring: the attachments' policy, or every reason; `drops`); with
//! `--matches` the new connections rules with `log` decided (the pinned `filter_matches`
//! ring, or the nftables table's NFLOG group; `matches`), with what the rate limit held back.

mod drops;
mod matches;

use std::{
    io::Write as _,
    net::IpAddr,
    path::Path,
    time::{Duration, Instant, SystemTime},
};

use cnibpf_common::{PROTO_ICMP, PROTO_ICMPV6, PROTO_SCTP, PROTO_TCP, PROTO_UDP};
use nix::time::{ClockId, clock_gettime};
use tokio::io::{Interest, unix::AsyncFd};

use crate::{
    backend::{
        AttachmentRecord, BackendError, Inspect, ebpf::EbpfBackend, nftables::NftablesBackend,
    },
    lock::{InstanceLock, LockError},
    paths::PinLayout,
};

#[derive(Debug, thiserror::Error)]
pub enum MonitorError {
    #[error("no eBPF state under {0}: nothing is filtered there")]
    NoState(String),
    #[error("no state under {0}: no attachment has rules there")]
    NoRules(String),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(
        "another cnibpf monitor follows these events of {0}: each event goes to one reader, stop that one first"
    )]
    Busy(String),
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("could not wait for events")]
    Io(#[from] std::io::Error),
    #[error("could not follow the NFLOG group of table inet cnibpf")]
    Nflog(#[source] std::io::Error),
    #[error("could not write to stdout")]
    Output(#[source] std::io::Error),
}

/// What `cnibpf monitor` shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shown {
    /// What the attachments' policy drops: the filter and the source check.
    Policy,
    /// Every drop, whatever its reason.
    Every,
    /// The connections rules with `log` decided.
    Matches,
}

pub fn run(pin_path: &Path, as_json: bool, shown: Shown) -> Result<(), MonitorError> {
    let pins = PinLayout::new(pin_path);
    let lock = if shown == Shown::Matches {
        pins.match_monitor_lock_file()
    } else {
        pins.monitor_lock_file()
    };
    let _reader = match InstanceLock::acquire(&lock, Duration::ZERO) {
        Err(LockError::Timeout { .. }) => {
            return Err(MonitorError::Busy(pin_path.display().to_string()));
        }
        other => other?,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()?;
    let ebpf = EbpfBackend::open_existing(&pins, crate::backend::Access::ReadOnly)?;
    match (ebpf, shown) {
        (Some(backend), Shown::Matches) => {
            let events = backend.match_events()?;
            runtime.block_on(matches::follow_ring(&backend, events, as_json))
        }
        (Some(backend), _) => {
            let events = backend.drop_events()?;
            runtime.block_on(drops::follow(&backend, events, as_json, shown))
        }
        (None, Shown::Matches) => {
            let backend = NftablesBackend::open_existing(&pins, crate::backend::Access::ReadOnly)?
                .ok_or_else(|| MonitorError::NoRules(pin_path.display().to_string()))?;
            runtime.block_on(matches::follow_nflog(&backend, as_json))
        }
        (None, _) => Err(MonitorError::NoState(pin_path.display().to_string())),
    }
}

/// A pinned ring buffer, waited on by the runtime.
type Ring = AsyncFd<aya::maps::RingBuf<aya::maps::MapData>>;

fn ring(events: aya::maps::RingBuf<aya::maps::MapData>) -> Result<Ring, MonitorError> {
    // SAFETY: the ring buffer owns its map descriptor, which stays open and the same until
    // it is dropped with the `AsyncFd`.
    unsafe { AsyncFd::register_with_interest(events, Interest::READABLE) }
        .map_err(|error| MonitorError::Io(error.into_parts().1))
}

/// The ring's records of at least `size` bytes, read now. Readiness is cleared before the
/// ring is drained, not after: the kernel wakes a reader only when it had caught up, so an
/// event written between the last read and a later clear would wait unseen for the next one.
async fn records(ring: &mut Ring, size: usize) -> Result<Vec<Vec<u8>>, MonitorError> {
    let mut guard = ring.readable_mut().await?;
    guard.clear_ready();
    let ring = guard.get_inner_mut();
    let mut records = Vec::new();
    while let Some(item) = ring.next() {
        if item.len() >= size {
            records.push(item.to_vec());
        }
    }
    Ok(records)
}

/// The attachments as last read from a backend, read again when an event names one that is
/// not among them (it may have been added since) — at most once a second, whatever the rate
/// of such events.
struct Attachments {
    records: Vec<AttachmentRecord>,
    read_at: Instant,
}

impl Attachments {
    fn read(backend: &dyn Inspect) -> Result<Self, MonitorError> {
        Ok(Self {
            records: backend.attachments()?,
            read_at: Instant::now(),
        })
    }

    /// The attachment `of` picks, read again once a second while there is none.
    fn find(
        &mut self,
        backend: &dyn Inspect,
        of: impl Fn(&AttachmentRecord) -> bool,
    ) -> Result<Option<&AttachmentRecord>, MonitorError> {
        if !self.records.iter().any(&of) && self.read_at.elapsed() >= Duration::from_secs(1) {
            *self = Self::read(backend)?;
        }
        Ok(self.records.iter().find(|record| of(record)))
    }
}

/// Writes `lines` to stdout; `false` once the reader went away (a closed stdout ends the
/// monitor like Ctrl-C).
fn print(lines: &[String]) -> Result<bool, MonitorError> {
    let mut out = std::io::stdout().lock();
    for line in lines {
        match writeln!(out, "{line}").and_then(|()| out.flush()) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => return Ok(false),
            Err(error) => return Err(MonitorError::Output(error)),
        }
    }
    Ok(true)
}

/// The (network, container id, ifname) an event is shown with, `?` for an attachment gone.
fn named(attachment: Option<&AttachmentRecord>) -> (&str, &str, &str) {
    // fail-closed: an Option: an event of an attachment gone since shows "?".
    attachment.map_or(("?", "?", "?"), |record| {
        (
            record.attachment.network.as_str(),
            record.attachment.container_id.as_str(),
            record.attachment.ifname.as_str(),
        )
    })
}

/// One end of a packet as a line shows it: `addr:port` (`[addr]:port`), an echo's identifier.
fn endpoint(protocol: u8, addr: IpAddr, port: u16) -> String {
    match (protocol, addr) {
        (PROTO_TCP | PROTO_UDP | PROTO_SCTP, IpAddr::V6(addr)) => format!("[{addr}]:{port}"),
        (PROTO_TCP | PROTO_UDP | PROTO_SCTP, addr) => format!("{addr}:{port}"),
        (PROTO_ICMP | PROTO_ICMPV6, addr) if port != 0 => format!("{addr} (echo id {port})"),
        (_, addr) => addr.to_string(),
    }
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
