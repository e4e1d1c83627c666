//! Whether the eBPF backend can work on this host, asked of the kernel itself, without changing
//! anything: a two-instruction TC program must load (the kernel lets only a process that may
//! administer networking load one, the same permission a tcx link then needs), and the kernel
//! must answer a query for the tcx programs on this namespace's loopback (tcx, kernel 6.6, is
//! how the hooks attach). Nothing is cached: a kernel or sandbox that changes between calls is
//! seen as it is. (Attaching anything would cost a grace period: a tcx link waits out one,
//! and so does tearing down a scratch namespace to attach in — in the kernel's own time, but
//! holding the lock the next attach needs.) bpffs must be writable.

use std::{fs, io, os::fd::OwnedFd, path::Path};

use super::sys::{self, BPF_PROG_LOAD, BPF_PROG_QUERY, BPF_TCX_INGRESS};
use crate::paths::BPFFS_MOUNT_POINT;

/// `BPF_PROG_TYPE_SCHED_CLS` (uapi).
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;

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
    reap_probes_of_gone_processes(root);
    let probe = root.join(probe_name(std::process::id()));
    match fs::create_dir(&probe) {
        // Left by a process that had this PID and was killed between the two steps.
        Err(error) if error.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        made => made,
    }
    .and_then(|()| match fs::remove_dir(&probe) {
        // Made, so bpffs is writable; a process in another PID namespace that took it for
        // a dead one's removed it first.
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
        removed => removed,
    })
    .map_err(|error| {
        Refusal::of(
            &format!("bpffs at {} is not writable", root.display()),
            &error,
        )
    })
}

/// The probe directory's name: the PID with the PID namespace it means something in (bpffs
/// refuses names with a dot). A plugin the runtime runs and a DaemonSet's cnibpf share bpffs
/// but usually not PIDs.
fn probe_name(pid: u32) -> String {
    format!("{PROBE_PREFIX}{}-{pid}", pid_namespace())
}

const PROBE_PREFIX: &str = "cnibpf-probe-";

/// The inode of this process's PID namespace (`pid:[4026531836]` names it), 0 if it cannot be
/// read: then no probe is reaped, since another namespace's PIDs could not be told apart.
fn pid_namespace() -> u64 {
    // fail-closed: 0 matches no namespace, so nothing is reaped.
    let Ok(link) = fs::read_link("/proc/self/ns/pid") else {
        return 0;
    };
    link.to_str()
        .and_then(|link| link.strip_prefix("pid:[")?.strip_suffix(']'))
        // fail-closed: a name the kernel did not write is read as 0, as above.
        .and_then(|inode| inode.parse().ok())
        // fail-closed: as above.
        .unwrap_or(0)
}

/// Removes the probe directories of processes of this PID namespace that are gone — a cnibpf
/// killed between making its probe and removing it —, so that kills do not pile them up under
/// bpffs. A process is gone only when the kernel says so (`ESRCH`); whatever cannot be read or
/// removed stays for a later probe.
fn reap_probes_of_gone_processes(root: &Path) {
    let namespace = pid_namespace();
    if namespace == 0 {
        return;
    }
    let prefix = format!("{PROBE_PREFIX}{namespace}-");
    // fail-closed: an unreadable bpffs root is the probe's own failure to report, just below.
    let Ok(entries) = fs::read_dir(root) else {
        return;
    };
    // fail-closed: an entry that cannot be read is left alone.
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|name| name.strip_prefix(&prefix))
            // fail-closed: a name that is no probe of this namespace is not touched.
            .and_then(|pid| pid.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        if is_gone(pid) {
            // fail-closed: a probe left in place costs an empty directory, nothing else.
            let _ = fs::remove_dir(entry.path());
        }
    }
}

/// Whether the kernel says no process `pid` exists in this PID namespace.
fn is_gone(pid: libc::pid_t) -> bool {
    // SAFETY: signal 0 sends nothing; it only asks whether the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
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
    // SAFETY: no pointers in the attribute.
    unsafe { sys::bpf(BPF_PROG_QUERY, &mut attr) }.map(drop)
}

fn load() -> io::Result<OwnedFd> {
    let license = c"GPL";
    // union bpf_attr, BPF_PROG_LOAD: prog_type, insn_cnt, insns, license.
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&BPF_PROG_TYPE_SCHED_CLS.to_ne_bytes());
    attr[4..8].copy_from_slice(&(PROGRAM.len() as u32).to_ne_bytes());
    attr[8..16].copy_from_slice(&(PROGRAM.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    // SAFETY: a zero-initialised union bpf_attr whose pointers (instructions, license)
    // outlive the call; BPF_PROG_LOAD returns a descriptor.
    unsafe { sys::bpf_fd(BPF_PROG_LOAD, &mut attr) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_probes_of_gone_processes_of_this_pid_namespace_are_reaped() {
        let root = std::env::temp_dir().join(format!("cnibpf-probe-test-{}", std::process::id()));
        fs::create_dir_all(&root).expect("make a scratch directory");
        let mut finished = std::process::Command::new("true")
            .spawn()
            .expect("run true");
        finished.wait().expect("wait for true");
        let gone = probe_name(finished.id());
        let live = probe_name(std::process::id());
        let elsewhere = format!("{PROBE_PREFIX}1-{}", finished.id());
        for name in [&gone, &live, &elsewhere] {
            fs::create_dir(root.join(name)).expect("make a probe directory");
        }
        reap_probes_of_gone_processes(&root);
        let left = |name: &str| root.join(name).exists();
        let outcome = (left(&gone), left(&live), left(&elsewhere));
        fs::remove_dir_all(&root).expect("remove the scratch directory");
        assert_eq!(
            outcome,
            (false, true, true),
            "(gone, live, another namespace's) probe left"
        );
    }

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
