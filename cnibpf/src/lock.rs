//! The lock file that serialises changes to one instance's pinned state.
//!
//! Held only around the read-modify-write of shared state (conflict check and map updates);
//! parsing, validation and interface lookups run before it, so parallel ADDs of different
//! containers mostly overlap.

use std::{
    fs::{self, File, OpenOptions},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use nix::{
    errno::Errno,
    fcntl::{Flock, FlockArg},
    sys::{
        signal::{
            SaFlags, SigAction, SigEvent, SigHandler, SigSet, SigevNotify, Signal, sigaction,
        },
        time::TimeSpec,
        timer::{Expiration, Timer, TimerSetTimeFlags},
    },
    time::ClockId,
};

/// How long an invocation waits for the lock before answering "try again" (code 11), unless
/// `CNIBPF_LOCK_TIMEOUT_MS` says otherwise (runtimes with tighter deadlines of their own).
const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(30);
pub const LOCK_TIMEOUT_ENV: &str = "CNIBPF_LOCK_TIMEOUT_MS";

pub fn lock_timeout() -> Duration {
    std::env::var(LOCK_TIMEOUT_ENV)
        // fail-closed: a setting that is not there, or not a number, leaves the default.
        .ok()
        // fail-closed: as above.
        .and_then(|value| value.parse().ok())
        // fail-closed: as above.
        .map_or(DEFAULT_LOCK_TIMEOUT, Duration::from_millis)
}
/// How often the timer signals again after the deadline (see `wait_for`).
const RESIGNAL: Duration = Duration::from_millis(5);

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("could not open lock file {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("timed out after {timeout:?} waiting for lock {path}")]
    Timeout { path: PathBuf, timeout: Duration },
    #[error("could not lock {path}")]
    Lock {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// An exclusive `flock` on the instance's lock file, released on drop.
#[derive(Debug)]
pub struct InstanceLock {
    _lock: Flock<File>,
}

impl InstanceLock {
    pub fn acquire(path: &Path, timeout: Duration) -> Result<Self, LockError> {
        let open_error = |source| LockError::Open {
            path: path.to_owned(),
            source,
        };
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(open_error)?;
        }
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(open_error)?;
        if timeout.is_zero() {
            return match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(lock) => Ok(Self { _lock: lock }),
                Err((_, Errno::EWOULDBLOCK | Errno::EINTR)) => Err(LockError::Timeout {
                    path: path.to_owned(),
                    timeout,
                }),
                Err((_, errno)) => Err(LockError::Lock {
                    path: path.to_owned(),
                    source: errno.into(),
                }),
            };
        }
        wait_for(file, timeout)
            .map(|lock| Self { _lock: lock })
            .map_err(|errno| match errno {
                Errno::EINTR => LockError::Timeout {
                    path: path.to_owned(),
                    timeout,
                },
                errno => LockError::Lock {
                    path: path.to_owned(),
                    source: errno.into(),
                },
            })
    }
}

/// Waits for the lock in the kernel's queue — no polling, so a hundred waiting ADDs cost the
/// one holding it no CPU — until `timeout`, when a timer signals this very thread and the
/// blocked `flock` returns EINTR (then again every few milliseconds, so that a signal landing
/// between two calls is not missed). EINTR after the deadline is the timeout.
fn wait_for(mut file: File, timeout: Duration) -> Result<Flock<File>, Errno> {
    extern "C" fn interrupt(_: libc::c_int) {}
    // SAFETY: the handler does nothing (async-signal-safe); without SA_RESTART a blocked
    // flock returns EINTR when it runs. SIGALRM is not used otherwise in this program.
    unsafe {
        sigaction(
            Signal::SIGALRM,
            &SigAction::new(
                SigHandler::Handler(interrupt),
                SaFlags::empty(),
                SigSet::empty(),
            ),
        )
    }?;
    let mut timer = Timer::new(
        ClockId::CLOCK_MONOTONIC,
        SigEvent::new(SigevNotify::SigevThreadId {
            signal: Signal::SIGALRM,
            thread_id: nix::unistd::gettid().as_raw(),
            si_value: 0,
        }),
    )?;
    timer.set(
        Expiration::IntervalDelayed(TimeSpec::from(timeout), TimeSpec::from(RESIGNAL)),
        TimerSetTimeFlags::empty(),
    )?;
    let deadline = Instant::now() + timeout;
    loop {
        match Flock::lock(file, FlockArg::LockExclusive) {
            Ok(lock) => return Ok(lock),
            // Another signal: wait on.
            Err((returned, Errno::EINTR)) if Instant::now() < deadline => file = returned,
            Err((_, errno)) => return Err(errno),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lock_path(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("cnibpf-lock-{name}-{}", std::process::id()))
    }

    #[test]
    fn a_held_lock_times_out_and_a_released_one_is_taken_at_once() {
        let path = lock_path("held");
        let held = InstanceLock::acquire(&path, Duration::from_secs(1)).expect("first");
        let started = Instant::now();
        let waited = InstanceLock::acquire(&path, Duration::from_millis(150));
        assert!(
            matches!(waited, Err(LockError::Timeout { .. })),
            "{waited:?}"
        );
        let elapsed = started.elapsed();
        assert!(
            elapsed >= Duration::from_millis(150) && elapsed < Duration::from_secs(2),
            "{elapsed:?}"
        );
        assert!(matches!(
            InstanceLock::acquire(&path, Duration::ZERO),
            Err(LockError::Timeout { .. })
        ));
        let releasing = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(held);
        });
        let started = Instant::now();
        InstanceLock::acquire(&path, Duration::from_secs(5)).expect("taken once released");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        releasing.join().expect("released");
        fs::remove_file(&path).expect("cleaned up");
    }
}
