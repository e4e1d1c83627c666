//! What a call without a configuration of its own leaves at cnibpf's default paths: a bare
//! `VERSION` (as runtimes send it, and as the chain executor asks every plugin) is logged to
//! the default call log and counted in the default instance's call statistics. Those files
//! belong to the node; the tests remove them only where no file was there before the first of
//! their hosts was made, once the last host of the process is gone.

use std::{path::Path, sync::Mutex};

/// The default call log (`logFile`'s default) with its rotation lock, and the call
/// statistics of the default instance (`pinPath` /sys/fs/bpf/cnibpf).
const FILES: [&str; 3] = [
    "/var/log/cnibpf/cnibpf.log",
    "/var/log/cnibpf/cnibpf.log.lock",
    "/run/cnibpf/_sys_fs_bpf_cnibpf.calls",
];
/// The directories they live in.
const DIRS: [&str; 2] = ["/var/log/cnibpf", "/run/cnibpf"];

struct Hosts {
    live: usize,
    /// Which of `FILES` and `DIRS` existed when `live` last left zero.
    files_existed: [bool; FILES.len()],
    dirs_existed: [bool; DIRS.len()],
}

static HOSTS: Mutex<Hosts> = Mutex::new(Hosts {
    live: 0,
    files_existed: [true; FILES.len()],
    dirs_existed: [true; DIRS.len()],
});

fn exists(path: &str) -> bool {
    Path::new(path)
        .try_exists()
        .unwrap_or_else(|error| panic!("look for {path}: {error}"))
}

/// A simulated host is made.
pub(super) fn host_made() {
    let mut hosts = HOSTS.lock().unwrap_or_else(|poison| poison.into_inner());
    if hosts.live == 0 {
        hosts.files_existed = FILES.map(exists);
        hosts.dirs_existed = DIRS.map(exists);
    }
    hosts.live += 1;
}

/// A simulated host is gone: the last one removes what the tests' calls created.
pub(super) fn host_gone() {
    let mut hosts = HOSTS.lock().unwrap_or_else(|poison| poison.into_inner());
    hosts.live -= 1;
    if hosts.live > 0 {
        return;
    }
    for (path, existed) in FILES.iter().zip(hosts.files_existed) {
        if !existed {
            match std::fs::remove_file(path) {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => eprintln!("could not remove {path}: {error}"),
            }
        }
    }
    for (path, existed) in DIRS.iter().zip(hosts.dirs_existed) {
        if !existed {
            // Only when empty: another instance's lock or log may live there.
            let _ = std::fs::remove_dir(path);
        }
    }
}

/// Counts as a simulated host for the cleanup above while it lives: for tests whose cnibpf
/// calls need no host (a node's CNI dirs alone), which may create the same directories.
#[derive(Debug)]
pub struct DefaultPaths(());

impl DefaultPaths {
    pub fn watched() -> Self {
        host_made();
        Self(())
    }
}

impl Drop for DefaultPaths {
    fn drop(&mut self) {
        host_gone();
    }
}
