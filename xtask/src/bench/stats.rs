//! The kernel's per-program run-time statistics (`kernel.bpf_stats_enabled`), and what they
//! themselves cost: the kernel reads a clock before and after every program run it counts, so
//! a program's time per run includes that read. An [`EmptyProgram`] at the same hook, counted
//! over the same packets, measures it, and the benches take it off.

use std::{
    io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::Path,
};

use anyhow::{Context as _, Result, bail};
use cnibpf_tests::{Netns, SimHost};

use super::Row;

/// The kernel's per-program run time statistics, on while this lives (they cost a clock read
/// per run, for every program alike).
#[derive(Debug)]
pub struct BpfStats {
    previous: String,
}

const BPF_STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";

impl BpfStats {
    pub fn enable() -> Result<Self> {
        let previous = std::fs::read_to_string(BPF_STATS)?.trim().to_owned();
        std::fs::write(BPF_STATS, "1")?;
        Ok(Self { previous })
    }

    /// (run time in ns, runs) of `programs` pinned under `pin_path`, summed.
    pub fn programs(&self, pin_path: &Path, programs: &[&str]) -> Result<(u64, u64)> {
        let mut total = (0, 0);
        for program in programs {
            let output = std::process::Command::new("bpftool")
                .args(["-j", "prog", "show", "pinned"])
                .arg(pin_path.join("programs").join(program))
                .output()?;
            let shown: serde_json::Value = serde_json::from_slice(&output.stdout)
                .with_context(|| format!("bpftool prog show {program}"))?;
            // bpftool leaves both out while the program has not run.
            total.0 += shown["run_time_ns"].as_u64().unwrap_or(0);
            total.1 += shown["run_cnt"].as_u64().unwrap_or(0);
        }
        Ok(total)
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        let _ = std::fs::write(BPF_STATS, &self.previous);
    }
}

/// Where a tcx program runs on an interface.
#[derive(Clone, Copy, Debug)]
pub enum Hook {
    Ingress,
    Egress,
}

/// A program that does nothing (`return TCX_NEXT`), attached first on a hook while it lives:
/// its time per run is the statistics' own cost at that hook.
#[derive(Debug)]
pub struct EmptyProgram {
    program: OwnedFd,
    _link: OwnedFd,
}

// From the kernel's UAPI (linux/bpf.h).
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
const BPF_TCX_INGRESS: u32 = 46;
const BPF_TCX_EGRESS: u32 = 47;
const BPF_F_BEFORE: u32 = 1 << 3;
/// `r0 = -1 (TCX_NEXT); exit`.
const INSTRUCTIONS: [u64; 2] = [0xffff_ffff_0000_00b7, 0x95];

/// `union bpf_attr` for `BPF_PROG_LOAD`, as far as it is used.
#[repr(C)]
#[derive(Default)]
struct ProgLoad {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
}

/// `union bpf_attr` for `BPF_LINK_CREATE` of a tcx link (`BPF_F_BEFORE` with no relative
/// program: first).
#[repr(C)]
#[derive(Default)]
struct LinkCreate {
    prog_fd: u32,
    target_ifindex: u32,
    attach_type: u32,
    flags: u32,
    relative_fd: u32,
    _pad: u32,
    expected_revision: u64,
}

/// `union bpf_attr` for `BPF_OBJ_GET_INFO_BY_FD`.
#[repr(C)]
struct GetInfo {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// `struct bpf_prog_info` up to `run_cnt` (`run_time_ns` is at byte 192); the kernel fills
/// what fits.
#[repr(C)]
#[derive(Default)]
struct ProgInfo {
    _before: [u64; 24],
    run_time_ns: u64,
    run_cnt: u64,
}

/// The `bpf(2)` system call with `attr`; its non-negative answer (a file descriptor or 0).
fn bpf<T>(command: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, initialised `union bpf_attr` prefix of the size passed; the
    // kernel zero-extends what it does not receive and writes back only within it.
    let answer = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            command,
            std::ptr::from_mut(attr),
            size_of::<T>(),
        )
    };
    if answer < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(answer)
}

/// A descriptor the kernel just returned, owned from here on.
fn owned(fd: libc::c_long) -> io::Result<OwnedFd> {
    let fd = i32::try_from(fd).map_err(|_| io::Error::other("descriptor out of range"))?;
    // SAFETY: a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl EmptyProgram {
    /// Loads it and attaches it first on `hook` of `ifname` in `netns`.
    pub fn attach(netns: &Netns, ifname: &str, hook: Hook) -> Result<Self> {
        let license = c"GPL";
        let mut name = [0u8; 16];
        name[..11].copy_from_slice(b"stats_empty");
        let mut load = ProgLoad {
            prog_type: BPF_PROG_TYPE_SCHED_CLS,
            insn_cnt: INSTRUCTIONS.len() as u32,
            insns: INSTRUCTIONS.as_ptr() as u64,
            license: license.as_ptr() as u64,
            prog_name: name,
            ..ProgLoad::default()
        };
        let program = owned(bpf(BPF_PROG_LOAD, &mut load).context("load an empty program")?)?;
        let prog_fd = program.as_raw_fd() as u32;
        let ifname = std::ffi::CString::new(ifname)?;
        let attach_type = match hook {
            Hook::Ingress => BPF_TCX_INGRESS,
            Hook::Egress => BPF_TCX_EGRESS,
        };
        let link = netns.run(move || -> io::Result<OwnedFd> {
            // SAFETY: a NUL-terminated name.
            let target_ifindex = unsafe { libc::if_nametoindex(ifname.as_ptr()) };
            if target_ifindex == 0 {
                return Err(io::Error::last_os_error());
            }
            let mut create = LinkCreate {
                prog_fd,
                target_ifindex,
                attach_type,
                flags: BPF_F_BEFORE,
                ..LinkCreate::default()
            };
            owned(bpf(BPF_LINK_CREATE, &mut create)?)
        });
        Ok(Self {
            _link: link.context("attach the empty program")?,
            program,
        })
    }

    /// (run time in ns, runs) so far.
    pub fn counted(&self) -> Result<(u64, u64)> {
        let mut info = ProgInfo::default();
        let mut get = GetInfo {
            bpf_fd: self.program.as_raw_fd() as u32,
            info_len: size_of::<ProgInfo>() as u32,
            info: std::ptr::from_mut(&mut info) as u64,
        };
        bpf(BPF_OBJ_GET_INFO_BY_FD, &mut get).context("read the empty program's statistics")?;
        Ok((info.run_time_ns, info.run_cnt))
    }
}

/// (run time in ns, runs), as the kernel counts them.
type Counted = (u64, u64);

/// A datapath program measured at its hook, and the row it gets.
#[derive(Debug)]
pub struct Measured<'a> {
    /// Its pin name under the instance's `programs/`.
    pub program: &'a str,
    /// The host namespace's interface it runs on.
    pub interface: &'a str,
    pub hook: Hook,
    pub metric: &'static str,
}

/// One row per `measured` program over what `load` sends: its own time per packet — its run
/// time per run as the kernel counts it, less that of an empty program at the same hook over
/// the same packets — beside the figure as counted.
pub fn time_per_packet(
    sim: &SimHost,
    scenario: &str,
    measured: &[Measured<'_>],
    load: impl FnOnce() -> Result<()>,
) -> Result<Vec<Row>> {
    let stats = BpfStats::enable()?;
    let empty = measured
        .iter()
        .map(|program| EmptyProgram::attach(&sim.host, program.interface, program.hook))
        .collect::<Result<Vec<_>>>()?;
    // (the program's, the empty program's) (run time, runs) so far.
    let counts = || -> Result<Vec<(Counted, Counted)>> {
        measured
            .iter()
            .zip(&empty)
            .map(|(program, empty)| {
                Ok((
                    stats.programs(&sim.pin_path, &[program.program])?,
                    empty.counted()?,
                ))
            })
            .collect()
    };
    let before = counts()?;
    load()?;
    let after = counts()?;
    let per_run = |before: Counted, after: Counted| -> Option<f64> {
        let runs = after.1.checked_sub(before.1).filter(|runs| *runs > 0)?;
        Some(after.0.saturating_sub(before.0) as f64 / runs as f64)
    };
    measured
        .iter()
        .zip(before.into_iter().zip(after))
        .map(
            |(program, ((own_before, empty_before), (own_after, empty_after)))| {
                let (Some(counted), Some(empty)) = (
                    per_run(own_before, own_after),
                    per_run(empty_before, empty_after),
                ) else {
                    bail!("{} did not run on {}", program.program, program.interface);
                };
                Ok(Row {
                    scenario: scenario.to_owned(),
                    metric: program.metric,
                    unit: "ns",
                    value: counted - empty,
                    baseline: Some((
                        format!("as counted, with the statistics' own {empty:.0} ns"),
                        counted,
                    )),
                })
            },
        )
        .collect()
}
