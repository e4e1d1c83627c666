//! The lock file that serialises changes to one instance's pinned state.
//!
//! Held only around the read-modify-write of shared state (conflict check and map updates);
//! parsing, validation and interface lookups run before it, so parallel ADDs of different
//! containers mostly overlap.

use std::{
    fs::{self, File, OpenOptions},
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};

use nix::{
    errno::Errno,
    fcntl::{Flock, FlockArg},
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
const POLL_INTERVAL: Duration = Duration::from_millis(2);

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
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(open_error)?;
        let deadline = Instant::now() + timeout;
        loop {
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(lock) => return Ok(Self { _lock: lock }),
                // Held by another invocation (or interrupted): wait for it, up to the deadline.
                Err((returned, Errno::EWOULDBLOCK | Errno::EINTR)) if Instant::now() < deadline => {
                    file = returned;
                    thread::sleep(POLL_INTERVAL);
                }
                Err((_, Errno::EWOULDBLOCK | Errno::EINTR)) => {
                    return Err(LockError::Timeout {
                        path: path.to_owned(),
                        timeout,
                    });
                }
                Err((_, errno)) => {
                    return Err(LockError::Lock {
                        path: path.to_owned(),
                        source: errno.into(),
                    });
                }
            }
        }
    }
}
