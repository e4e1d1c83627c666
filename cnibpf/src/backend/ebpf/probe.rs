//! Whether the eBPF backend can work on this host, asked of the kernel itself: a two-instruction
//! TC program is loaded and attached as a clsact filter to the loopback of a scratch network
//! namespace (which disappears with the probe), and the kernel must answer a query for tcx
//! programs there (tcx, kernel 6.6, is how the hooks attach). Nothing is cached: a kernel or
//! sandbox that changes between calls is seen as it is. (Attaching a tcx link itself would
//! wait out an RCU grace period — 10-25 ms on every ADD.) bpffs must be writable.

use std::{
    fs, io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::Path,
};

use nix::sched::{CloneFlags, unshare};

use crate::{
    netlink::{self, TcFilterSlot},
    paths::BPFFS_MOUNT_POINT,
};

/// `BPF_PROG_LOAD`, `BPF_PROG_TYPE_SCHED_CLS` (uapi).
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
/// `BPF_PROG_QUERY`, `BPF_TCX_INGRESS` (uapi).
const BPF_PROG_QUERY: libc::c_long = 16;
const BPF_TCX_INGRESS: u32 = 46;

/// `r0 = 0 (TC_ACT_OK); exit`.
const PROGRAM: [u64; 2] = [0x0000_0000_0000_00b7, 0x0000_0000_0000_0095];

/// bpffs, where the datapath pins everything, must take new entries: a directory is made and
/// removed. (Where none is mounted yet, loading mounts one and says so if it cannot.)
pub fn bpffs_writable() -> Result<(), String> {
    let root = Path::new(BPFFS_MOUNT_POINT);
    if !super::pins::is_bpffs(root) {
        return Ok(());
    }
    // bpffs refuses names with a dot.
    let probe = root.join(format!("cnibpf-probe-{}", std::process::id()));
    fs::create_dir(&probe)
        .and_then(|()| fs::remove_dir(&probe))
        .map_err(|error| format!("bpffs at {} is not writable: {error}", root.display()))
}

/// Loads and attaches the probe program; the error says which step the kernel refused.
pub fn load_and_attach() -> Result<(), String> {
    let program = load().map_err(|error| format!("loading a TC program failed: {error}"))?;
    // The scratch namespace belongs to a thread of its own, which ends with the probe.
    std::thread::spawn(move || {
        unshare(CloneFlags::CLONE_NEWNET)
            .map_err(|error| format!("could not create a scratch network namespace: {error}"))?;
        // The loopback of a new namespace always has index 1.
        let slot = TcFilterSlot {
            priority: 1,
            handle: 1,
        };
        netlink::add_clsact(1)
            .and_then(|()| netlink::replace_bpf_filter(1, slot, program.as_raw_fd(), "probe"))
            .map_err(|error| format!("attaching a TC filter failed: {error}"))?;
        query_tcx(1).map_err(|error| format!("the kernel has no tcx (needs Linux 6.6): {error}"))
    })
    .join()
    .unwrap_or_else(|_| Err("the probe thread panicked".to_owned()))
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
