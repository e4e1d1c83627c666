//! Whether the eBPF backend can work on this host, asked of the kernel itself, without changing
//! anything: a two-instruction TC program must load (the kernel lets only a process that may
//! administer networking load one, the same permission a tcx link then needs), and the kernel
//! must answer a query for the tcx programs on this namespace's loopback (tcx, kernel 6.6, is
//! how the hooks attach). Nothing is cached: a kernel or sandbox that changes between calls is
//! seen as it is. (Attaching anything would cost a grace period: a tcx link waits out one,
//! and so does tearing down a scratch namespace to attach in — in the kernel's own time, but
//! holding the lock the next attach needs.) bpffs must be writable.

use std::{
    fs, io,
    os::fd::{FromRawFd as _, OwnedFd},
    path::Path,
};

use crate::paths::BPFFS_MOUNT_POINT;

/// `BPF_PROG_LOAD`, `BPF_PROG_TYPE_SCHED_CLS` (uapi).
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
/// `BPF_PROG_QUERY`, `BPF_TCX_INGRESS` (uapi).
const BPF_PROG_QUERY: libc::c_long = 16;
const BPF_TCX_INGRESS: u32 = 46;

/// `r0 = 0 (TC_ACT_OK); exit`.
const PROGRAM: [u64; 2] = [0x0000_0000_0000_00b7, 0x0000_0000_0000_0095];

/// Why the probe failed: the host refuses BPF (for good: `auto` serves with nftables), or it
/// could not ask (a transient failure: fd limit, memory, an interrupted call), which says
/// nothing about BPF and must not switch the backend.
#[derive(Debug)]
pub struct Refusal {
    pub reason: String,
    pub transient: bool,
}

impl Refusal {
    fn of(what: &str, error: &io::Error) -> Self {
        Self {
            reason: format!("{what}: {error}"),
            transient: !is_refusal(error),
        }
    }
}

/// Whether the kernel's answer means "no BPF here" — not built in, not permitted, not this
/// kind of program or hook — rather than "could not now".
fn is_refusal(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(
            libc::EPERM
                | libc::EACCES
                | libc::ENOSYS
                | libc::EINVAL
                | libc::EOPNOTSUPP
                | libc::EROFS
        )
    )
}

/// bpffs, where the datapath pins everything, must take new entries: a directory is made and
/// removed. (Where none is mounted yet, loading mounts one and says so if it cannot.)
pub fn bpffs_writable() -> Result<(), Refusal> {
    let root = Path::new(BPFFS_MOUNT_POINT);
    let mounted = super::pins::is_bpffs(root).map_err(|error| Refusal {
        reason: format!(
            "could not tell whether {} is bpffs: {error}",
            root.display()
        ),
        transient: true,
    })?;
    if !mounted {
        return Ok(());
    }
    // bpffs refuses names with a dot.
    let probe = root.join(format!("cnibpf-probe-{}", std::process::id()));
    fs::create_dir(&probe)
        .and_then(|()| fs::remove_dir(&probe))
        .map_err(|error| {
            Refusal::of(
                &format!("bpffs at {} is not writable", root.display()),
                &error,
            )
        })
}

/// The loopback, index 1 in every network namespace.
const LOOPBACK_IFINDEX: u32 = 1;

/// Loads the probe program and asks for the loopback's tcx programs; the error says which
/// step the kernel refused.
pub fn load_and_query() -> Result<(), Refusal> {
    load().map_err(|error| Refusal::of("loading a TC program failed", &error))?;
    query_tcx(LOOPBACK_IFINDEX).map_err(|error| {
        Refusal::of(
            "asking for the loopback's tcx programs failed (tcx needs Linux 6.6)",
            &error,
        )
    })
}

/// `BPF_PROG_QUERY` of the tcx ingress programs of interface `ifindex`.
fn query_tcx(ifindex: u32) -> io::Result<()> {
    // union bpf_attr, BPF_PROG_QUERY: target_ifindex, attach_type, query_flags, attach_flags,
    // prog_ids, count (no ids asked for).
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&ifindex.to_ne_bytes());
    attr[4..8].copy_from_slice(&BPF_TCX_INGRESS.to_ne_bytes());
    // SAFETY: as in `bpf`, with no pointers in the attribute.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_QUERY, attr.as_ptr(), attr.len()) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn load() -> io::Result<OwnedFd> {
    let license = c"GPL";
    // union bpf_attr, BPF_PROG_LOAD: prog_type, insn_cnt, insns, license.
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&BPF_PROG_TYPE_SCHED_CLS.to_ne_bytes());
    attr[4..8].copy_from_slice(&(PROGRAM.len() as u32).to_ne_bytes());
    attr[8..16].copy_from_slice(&(PROGRAM.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    bpf(BPF_PROG_LOAD, &attr)
}

fn bpf(command: libc::c_long, attr: &[u8; 128]) -> io::Result<OwnedFd> {
    // SAFETY: bpf(2) reads `size` bytes of `attr`, a zero-initialised union bpf_attr whose
    // pointers (instructions, license) outlive the call; it returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, command, attr.as_ptr(), attr.len()) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us, nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_is_told_from_a_failure_to_ask() {
        for errno in [libc::EPERM, libc::ENOSYS, libc::EINVAL, libc::EACCES] {
            let refusal = Refusal::of("load", &io::Error::from_raw_os_error(errno));
            assert!(!refusal.transient, "errno {errno} means no BPF here");
        }
        for errno in [libc::EMFILE, libc::ENOMEM, libc::EINTR, libc::EAGAIN] {
            let refusal = Refusal::of("load", &io::Error::from_raw_os_error(errno));
            assert!(refusal.transient, "errno {errno} says nothing about BPF");
        }
    }
}
