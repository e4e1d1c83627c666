//! Someone else's programs on cnibpf's interfaces, loaded and attached with plain `bpf(2)` calls
//! (no object file), as an operator's or another plugin's would be: a tcx program that drops
//! IPv4 ICMP, and one that does nothing, whose run time is what the kernel's statistics
//! themselves cost at a hook (the benches take it off the datapath's). Detached when dropped.

use std::os::fd::{AsRawFd as _, OwnedFd};

use crate::{
    Netns,
    raw_bpf::{bpf, instruction, load_classifier, owned},
};

const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_CREATE: libc::c_long = 28;
/// `BPF_LINK_CREATE` flag: before the relative program, which none names: first on the hook.
const BPF_F_BEFORE: u32 = 1 << 3;
const BPF_TCX_INGRESS: u32 = 46;
const BPF_TCX_EGRESS: u32 = 47;

/// Drops IPv4 ICMP (`TC_ACT_SHOT`), hands everything else on (`TCX_NEXT`).
const DROP_ICMP: [u64; 13] = [
    instruction(0x61, 2, 1, 76, 0),   // r2 = skb->data
    instruction(0x61, 3, 1, 80, 0),   // r3 = skb->data_end
    instruction(0xbf, 4, 2, 0, 0),    // r4 = r2
    instruction(0x07, 4, 0, 0, 24),   // r4 += 24 (Ethernet + the IPv4 protocol byte)
    instruction(0x2d, 4, 3, 6, 0),    // if r4 > r3 goto pass
    instruction(0x69, 5, 2, 12, 0),   // r5 = ethertype
    instruction(0x55, 5, 0, 4, 0x08), // if r5 != htons(0x0800) goto pass
    instruction(0x71, 5, 2, 23, 0),   // r5 = IPv4 protocol
    instruction(0x55, 5, 0, 2, 1),    // if r5 != ICMP goto pass
    instruction(0xb7, 0, 0, 0, 2),    // r0 = TC_ACT_SHOT
    instruction(0x95, 0, 0, 0, 0),    // exit
    instruction(0xb7, 0, 0, 0, -1),   // pass: r0 = TCX_NEXT
    instruction(0x95, 0, 0, 0, 0),    // exit
];

/// Does nothing: `TCX_NEXT`.
const NOTHING: [u64; 2] = [
    instruction(0xb7, 0, 0, 0, -1), // r0 = TCX_NEXT
    instruction(0x95, 0, 0, 0, 0),  // exit
];

/// Which tcx hook of an interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hook {
    Ingress,
    Egress,
}

/// A tcx program of `instructions` attached to `hook` of `ifname` in `netns`: first, or after
/// whatever is there.
#[derive(Debug)]
struct TcxProgram {
    program: OwnedFd,
    _link: OwnedFd,
}

impl TcxProgram {
    fn attach(
        netns: &Netns,
        ifname: &str,
        hook: Hook,
        instructions: &'static [u64],
        first: bool,
    ) -> Self {
        let ifname = ifname.to_owned();
        let (program, link) = netns.run(move || {
            let ifindex = nix::net::if_::if_nametoindex(ifname.as_str())
                .unwrap_or_else(|error| panic!("no interface {ifname}: {error}"));
            let program = load_classifier(instructions)
                .unwrap_or_else(|error| panic!("load a program: {error}"));
            let attach_type = match hook {
                Hook::Ingress => BPF_TCX_INGRESS,
                Hook::Egress => BPF_TCX_EGRESS,
            };
            let flags = if first { BPF_F_BEFORE } else { 0 };
            // union bpf_attr, BPF_LINK_CREATE: prog_fd, target_ifindex, attach_type, flags.
            let mut attr = [0u8; 128];
            attr[0..4].copy_from_slice(&(program.as_raw_fd() as u32).to_ne_bytes());
            attr[4..8].copy_from_slice(&ifindex.to_ne_bytes());
            attr[8..12].copy_from_slice(&attach_type.to_ne_bytes());
            attr[12..16].copy_from_slice(&flags.to_ne_bytes());
            let link = bpf(BPF_LINK_CREATE, &mut attr)
                .and_then(owned)
                .unwrap_or_else(|error| panic!("attach a program to {ifname}: {error}"));
            (program, link)
        });
        Self {
            program,
            _link: link,
        }
    }
}

/// A foreign tcx program dropping IPv4 ICMP, attached after whatever is there.
#[derive(Debug)]
pub struct IcmpDropper {
    _program: TcxProgram,
}

impl IcmpDropper {
    pub fn attach(netns: &Netns, ifname: &str, hook: Hook) -> Self {
        Self {
            _program: TcxProgram::attach(netns, ifname, hook, &DROP_ICMP, false),
        }
    }
}

/// A tcx program that does nothing, attached first on a hook. With `kernel.bpf_stats_enabled`
/// the kernel reads a clock before and after every program run it counts; this one's time per
/// run is that cost alone, over the same packets as the programs after it.
#[derive(Debug)]
pub struct EmptyProgram {
    program: TcxProgram,
}

impl EmptyProgram {
    pub fn attach(netns: &Netns, ifname: &str, hook: Hook) -> Self {
        Self {
            program: TcxProgram::attach(netns, ifname, hook, &NOTHING, true),
        }
    }

    /// (run time in ns, runs) as the kernel's statistics count them.
    pub fn counted(&self) -> (u64, u64) {
        // struct bpf_prog_info up to run_time_ns (byte 192) and run_cnt (200); the kernel
        // fills what fits.
        let mut info = [0u64; 26];
        // union bpf_attr, BPF_OBJ_GET_INFO_BY_FD: bpf_fd, info_len, info.
        let mut attr = [0u8; 128];
        attr[0..4].copy_from_slice(&(self.program.program.as_raw_fd() as u32).to_ne_bytes());
        attr[4..8].copy_from_slice(&(size_of_val(&info) as u32).to_ne_bytes());
        attr[8..16].copy_from_slice(&(info.as_mut_ptr() as u64).to_ne_bytes());
        bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)
            .unwrap_or_else(|error| panic!("read an empty program's statistics: {error}"));
        (info[24], info[25])
    }
}

/// The same program pinned in bpffs, for `tc filter add … bpf da pinned <path>`: an operator's
/// classic cls_bpf filter. Unpinned when dropped.
#[derive(Debug)]
pub struct PinnedIcmpDropper {
    pub path: std::path::PathBuf,
}

impl PinnedIcmpDropper {
    pub fn pin(path: &std::path::Path) -> Self {
        let program =
            load_classifier(&DROP_ICMP).unwrap_or_else(|error| panic!("load the dropper: {error}"));
        let path_text = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
            .expect("pin path without NUL");
        // union bpf_attr, BPF_OBJ_PIN: pathname, bpf_fd.
        let mut attr = [0u8; 128];
        attr[0..8].copy_from_slice(&(path_text.as_ptr() as u64).to_ne_bytes());
        attr[8..12].copy_from_slice(&(program.as_raw_fd() as u32).to_ne_bytes());
        bpf(BPF_OBJ_PIN, &mut attr)
            .unwrap_or_else(|error| panic!("pin the dropper at {}: {error}", path.display()));
        Self {
            path: path.to_owned(),
        }
    }
}

impl Drop for PinnedIcmpDropper {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
