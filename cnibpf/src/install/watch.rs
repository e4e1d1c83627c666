//! `cnibpf install --watch`: cnibpf's conflist rendered again as the primary CNI rewrites or
//! replaces its file (inotify on the directory, so a file renamed over the old one is seen
//! too), the instance's view of the host followed as it changes (the node's addresses, the
//! nftables tables a firewall reload deleted: `events`), attachments whose DEL never came
//! reclaimed on a period, until SIGTERM or SIGINT.

use std::{
    os::fd::AsFd as _,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use nix::{
    poll::{PollFd, PollFlags, PollTimeout, poll},
    sys::{
        inotify::{AddWatchFlags, InitFlags, Inotify},
        signal::{SigSet, Signal},
        signalfd::{SfdFlags, SignalFd},
    },
};

use super::{InstallError, events::HostEvents, io_error};
use crate::output::{log_line, say};

/// Calls `ensure` now and after every change in `conf_dir` (its own writes included: it must
/// be idempotent), and reclaims stale attachments of `reclaim`'s pin path on its period.
/// Blocks SIGTERM and SIGINT in this thread (and the threads it starts after), for the watch
/// loop to read them from a signalfd.
pub fn block_signals() -> Result<SigSet, InstallError> {
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGTERM);
    signals.add(Signal::SIGINT);
    signals
        .thread_block()
        .map_err(|error| io_error("block SIGTERM and SIGINT")(error.into()))?;
    Ok(signals)
}

/// How long a burst of host events (an address flapping, a ruleset reloaded in several
/// transactions) is let settle before the instance is looked at once for all of it.
const SETTLE: Duration = Duration::from_millis(100);

pub fn run(
    conf_dir: &Path,
    reclaim: Option<(Duration, PathBuf)>,
    mut ensure: impl FnMut(),
    mut follow: Option<&mut dyn FnMut()>,
) -> Result<(), InstallError> {
    let signals = block_signals()?;
    let signal_fd = SignalFd::with_flags(&signals, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .map_err(|error| io_error("wait for signals")(error.into()))?;
    let inotify = Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK)
        .map_err(|error| io_error("watch the CNI configuration directory")(error.into()))?;
    inotify
        .add_watch(
            conf_dir,
            AddWatchFlags::IN_CLOSE_WRITE
                | AddWatchFlags::IN_MOVED_TO
                | AddWatchFlags::IN_MOVED_FROM
                | AddWatchFlags::IN_CREATE
                | AddWatchFlags::IN_DELETE,
        )
        .map_err(|error| io_error(format!("watch {}", conf_dir.display()))(error.into()))?;
    let mut events =
        match follow {
            Some(_) => Some(HostEvents::subscribe().map_err(|error| {
                io_error("follow the host's addresses and nftables tables")(error)
            })?),
            None => None,
        };
    say!("watching {}", conf_dir.display());
    ensure();
    if let Some(follow) = follow.as_mut() {
        follow();
    }
    let mut next_reclaim = reclaim.as_ref().map(|(period, _)| Instant::now() + *period);
    loop {
        let ready = wait(&inotify, &signal_fd, events.as_ref(), next_reclaim)?;
        if ready.signal {
            say!("stopping: cnibpf's conflist stays (cnibpf uninstall takes it out)");
            return Ok(());
        }
        if ready.conf_dir {
            // Every event says "look again"; which file changed does not matter. The queue is
            // drained until the kernel says it is empty (EAGAIN); any other error ends the watch.
            loop {
                match inotify.read_events() {
                    Ok(events) if !events.is_empty() => {}
                    Ok(_) | Err(nix::errno::Errno::EAGAIN) => break,
                    Err(nix::errno::Errno::EINTR) => {}
                    Err(error) => return Err(io_error("read inotify events")(error.into())),
                }
            }
            ensure();
        }
        if ready.host
            && let (Some(events), Some(follow)) = (events.as_mut(), follow.as_mut())
            && settled(events)?
        {
            follow();
        }
        if let (Some(at), Some((period, pin_path))) = (next_reclaim, &reclaim)
            && Instant::now() >= at
        {
            if let Err(error) = crate::reclaim::run(pin_path, true) {
                log_line!("cnibpf install: reclaiming stale attachments: {error}");
            }
            next_reclaim = Some(Instant::now() + *period);
        }
    }
}

/// What a wait found ready.
struct Ready {
    signal: bool,
    conf_dir: bool,
    host: bool,
}

/// Waits for a signal, a change in the conf dir or of the host, or the next reclaim.
fn wait(
    inotify: &Inotify,
    signal_fd: &SignalFd,
    events: Option<&HostEvents>,
    next_reclaim: Option<Instant>,
) -> Result<Ready, InstallError> {
    let timeout = match next_reclaim {
        Some(at) => PollTimeout::try_from(at.saturating_duration_since(Instant::now()))
            // fail-closed: no kernel result; a wait too long for poll waits as long as it can.
            .unwrap_or(PollTimeout::MAX),
        None => PollTimeout::NONE,
    };
    let mut fds = vec![
        PollFd::new(inotify.as_fd(), PollFlags::POLLIN),
        PollFd::new(signal_fd.as_fd(), PollFlags::POLLIN),
    ];
    fds.extend(
        events
            .into_iter()
            .flat_map(HostEvents::fds)
            .map(|fd| PollFd::new(fd, PollFlags::POLLIN)),
    );
    match poll(&mut fds, timeout) {
        Ok(_) | Err(nix::errno::Errno::EINTR) => {}
        Err(error) => return Err(io_error("wait for changes")(error.into())),
    }
    let ready = |fd: &PollFd| fd.revents().is_some_and(|events| !events.is_empty());
    Ok(Ready {
        signal: ready(&fds[1]),
        conf_dir: ready(&fds[0]),
        host: fds[2..].iter().any(ready),
    })
}

/// Reads the host's events until none came for [`SETTLE`]: whether any of them calls for a
/// look at the instance.
fn settled(events: &mut HostEvents) -> Result<bool, InstallError> {
    let read = |events: &mut HostEvents| {
        events
            .drain()
            .map_err(|error| io_error("read the host's address and nftables events")(error))
    };
    let mut look = read(events)?;
    loop {
        let mut fds = events.fds().map(|fd| PollFd::new(fd, PollFlags::POLLIN));
        let waited = PollTimeout::try_from(SETTLE)
            // fail-closed: no kernel result; SETTLE fits poll's timeout.
            .unwrap_or(PollTimeout::MAX);
        match poll(&mut fds, waited) {
            Ok(0) => return Ok(look),
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(error) => return Err(io_error("wait for host events")(error.into())),
        }
        look |= read(events)?;
    }
}
