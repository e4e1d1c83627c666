//! `cnibpf install --watch`: cnibpf's conflist rendered again as the primary CNI rewrites or
//! replaces its file (inotify on the directory, so a file renamed over the old one is seen
//! too), attachments whose DEL never came reclaimed on a period, until SIGTERM or SIGINT.

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

use super::{InstallError, io_error};
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

pub fn run(
    conf_dir: &Path,
    reclaim: Option<(Duration, PathBuf)>,
    mut ensure: impl FnMut(),
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
    say!("watching {}", conf_dir.display());
    ensure();
    let mut next_reclaim = reclaim.as_ref().map(|(period, _)| Instant::now() + *period);
    loop {
        let timeout = match next_reclaim {
            Some(at) => PollTimeout::try_from(at.saturating_duration_since(Instant::now()))
                // fail-closed: no kernel result; a wait too long for poll waits as long as it can.
                .unwrap_or(PollTimeout::MAX),
            None => PollTimeout::NONE,
        };
        let mut fds = [
            PollFd::new(inotify.as_fd(), PollFlags::POLLIN),
            PollFd::new(signal_fd.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, timeout) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(error) => return Err(io_error("wait for changes")(error.into())),
        }
        let ready = |fd: &PollFd| fd.revents().is_some_and(|events| !events.is_empty());
        if ready(&fds[1]) {
            say!("stopping: cnibpf's conflist stays (cnibpf uninstall takes it out)");
            return Ok(());
        }
        if ready(&fds[0]) {
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
