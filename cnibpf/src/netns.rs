//! Entering a network namespace for the current thread, always switching back.

use std::{
    fs::File,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
};

use crate::output::log_line;
use nix::sched::{CloneFlags, setns};

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("could not open network namespace {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("could not enter network namespace {path}")]
    Enter {
        path: PathBuf,
        #[source]
        source: nix::Error,
    },
}

/// While alive, the current thread is in another network namespace; dropping it returns the
/// thread to the namespace it was in. Only this thread moves: do not spawn threads inside.
#[derive(Debug)]
pub struct NetnsGuard {
    original: File,
}

impl NetnsGuard {
    pub fn enter(path: &Path) -> Result<Self, NetnsError> {
        let open = |path: &Path| {
            File::open(path).map_err(|source| NetnsError::Open {
                path: path.to_owned(),
                source,
            })
        };
        let original = open(Path::new("/proc/thread-self/ns/net"))?;
        let target = open(path)?;
        setns(target.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|source| NetnsError::Enter {
            path: path.to_owned(),
            source,
        })?;
        Ok(Self { original })
    }
}

impl Drop for NetnsGuard {
    fn drop(&mut self) {
        // Failing to return would leave every later netlink call in the container's
        // namespace; there is no safe way to continue, so stop the process.
        if let Err(error) = setns(self.original.as_fd(), CloneFlags::CLONE_NEWNET) {
            log_line!("cnibpf: cannot return to the original network namespace: {error}");
            std::process::abort();
        }
    }
}

/// The cookie of the current thread's network namespace (`SO_NETNS_COOKIE`), the identity the
/// socket hooks compare with `bpf_get_netns_cookie`.
pub fn current_cookie() -> std::io::Result<u64> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    // SAFETY: socket(2) with constant arguments; the descriptor is owned right away.
    let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: raw is a fresh descriptor nobody else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(raw) };
    let mut cookie: u64 = 0;
    let mut length = size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt(2) writes at most `length` bytes into `cookie`.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &raw mut length,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cookie)
}
