//! The tcx and cgroup hooks of an attachment and of the uplinks: attaching them (or finding
//! them attached), pinning their links, checking them.

use std::{fs, io, os::fd::AsFd as _, path::Path};

use aya::programs::{
    CgroupAttachMode, CgroupSockAddr, SchedClassifier, TcAttachType, links::FdLink,
};

use super::{
    EbpfBackend,
    pins::{FROM_CONTAINER, SOCK_PROGRAMS, TO_CONTAINER, UPLINK_EGRESS, UPLINK_INGRESS},
    sys::{self, BPF_OBJ_GET_INFO_BY_FD},
    unpin::detach_link,
};
use crate::{backend::BackendError, netlink::Link, phases};

/// One tcx hook: the program and where its link is pinned.
pub(super) struct Hook<'a> {
    program: &'static str,
    attach_type: TcAttachType,
    link_pin: &'a Path,
}

/// The tcx hooks of one interface: `[ingress, egress]` programs, with their link pins.
pub(super) fn hook_pair<'a>(
    programs: [&'static str; 2],
    link_pins: &'a [std::path::PathBuf; 2],
) -> [Hook<'a>; 2] {
    [
        Hook {
            program: programs[0],
            attach_type: TcAttachType::Ingress,
            link_pin: &link_pins[0],
        },
        Hook {
            program: programs[1],
            attach_type: TcAttachType::Egress,
            link_pin: &link_pins[1],
        },
    ]
}

impl EbpfBackend {
    /// Attaches the hook's program to `ifindex` and pins the link, unless the pinned link
    /// attaches it there already. That link runs this build's program: a load that replaces
    /// the programs moves every pinned link to them before it stamps the layout.
    pub(super) fn attach(&self, ifindex: u32, hook: &Hook<'_>) -> Result<(), BackendError> {
        if link_pinned(hook.link_pin)? {
            if tcx_link_ifindex(hook.link_pin)? == Some(ifindex) {
                return Ok(());
            }
            // The link outlived its interface (or was made for another one).
            detach_link(hook.link_pin)?;
        }
        // The program's descriptor alone: creating the link needs nothing of its info.
        let program_path = self.pins.program(hook.program);
        let program = sys::obj_get(&program_path).map_err(|source| BackendError::Pin {
            action: format!("could not open pinned program {}", program_path.display()),
            source: Box::new(source),
        })?;
        let link =
            sys::tcx_link_create(program.as_fd(), ifindex, hook.attach_type).map_err(|source| {
                BackendError::Pin {
                    action: format!("could not attach {} to interface {ifindex}", hook.program),
                    source: Box::new(source),
                }
            })?;
        phases::mark("tcx attach");
        sys::obj_pin(link.as_fd(), hook.link_pin).map_err(|source| BackendError::Pin {
            action: format!("could not pin link {}", hook.link_pin.display()),
            source: Box::new(source),
        })?;
        phases::mark("pins");
        Ok(())
    }

    pub(super) fn check_attached(
        &self,
        ifindex: u32,
        ifname: &str,
        hook: &Hook<'_>,
    ) -> Result<(), BackendError> {
        let program = self.pinned_program(hook.program)?;
        if !link_pinned(hook.link_pin)? {
            return Err(BackendError::CheckFailed(format!(
                "link {} of {} on {ifname} is missing",
                hook.link_pin.display(),
                hook.program
            )));
        }
        if !is_attached(&program, ifindex, hook.attach_type)? {
            return Err(BackendError::CheckFailed(format!(
                "{} is not attached to {ifname} (index {ifindex})",
                hook.program
            )));
        }
        Ok(())
    }

    /// Attaches the socket hooks to `cgroup` once per instance; their links are pinned, so
    /// later ADDs find them in place.
    pub(super) fn attach_socket_hooks(&self, cgroup: &Path) -> Result<(), BackendError> {
        let mut cgroup_dir = None;
        for (name, attach_type) in SOCK_PROGRAMS {
            let link_pin = self.pins.cgroup_link(name);
            if link_pinned(&link_pin)? {
                continue;
            }
            let cgroup_dir = match &mut cgroup_dir {
                Some(dir) => dir,
                None => cgroup_dir.insert(fs::File::open(cgroup).map_err(|source| {
                    BackendError::Pin {
                        action: format!("could not open cgroup {}", cgroup.display()),
                        source: Box::new(source),
                    }
                })?),
            };
            let program_path = self.pins.program(name);
            let program_error = |action: String| {
                move |source| BackendError::Program {
                    action,
                    source: Box::new(source),
                }
            };
            let mut program =
                CgroupSockAddr::from_pin(&program_path, attach_type).map_err(program_error(
                    format!("could not open pinned program {}", program_path.display()),
                ))?;
            let link_id = program
                // Links coexist with other programs on the cgroup whatever the mode; the kernel
                // takes no mode flags for link creation.
                .attach(&*cgroup_dir, CgroupAttachMode::Single)
                .map_err(program_error(format!(
                    "could not attach {name} to cgroup {}",
                    cgroup.display()
                )))?;
            let link = program
                .take_link(link_id)
                .map_err(program_error(format!("could not take the link of {name}")))?;
            let link: FdLink = link.try_into().map_err(|source| BackendError::Pin {
                action: format!("link of {name} is not a bpf link"),
                source: Box::new(source),
            })?;
            link.pin(&link_pin).map_err(|source| BackendError::Pin {
                action: format!("could not pin link {}", link_pin.display()),
                source: Box::new(source),
            })?;
        }
        Ok(())
    }

    pub(super) fn pinned_program(&self, name: &str) -> Result<SchedClassifier, BackendError> {
        let path = self.pins.program(name);
        SchedClassifier::from_pin(&path).map_err(|source| BackendError::Program {
            action: format!("could not open pinned program {}", path.display()),
            source: Box::new(source),
        })
    }

    /// Attaches (or finds attached) the hooks of `uplink`. Each pinned link is asked which
    /// interface it attaches: one the kernel no longer attaches (its interface went, even if
    /// another was made under the same name and index) is made again, never believed.
    pub(super) fn hook_uplink(&self, uplink: &Link) -> Result<(), BackendError> {
        let link_pins = self.uplink_link_pins(&uplink.name);
        for hook in Self::uplink_hooks(&link_pins) {
            self.attach(uplink.index, &hook)?;
        }
        Ok(())
    }

    pub(super) fn uplink_link_pins(&self, ifname: &str) -> [std::path::PathBuf; 2] {
        [
            self.pins.uplink_link(ifname, "ingress"),
            self.pins.uplink_link(ifname, "egress"),
        ]
    }

    pub(super) fn uplink_hooks<'a>(link_pins: &'a [std::path::PathBuf; 2]) -> [Hook<'a>; 2] {
        hook_pair([UPLINK_INGRESS, UPLINK_EGRESS], link_pins)
    }

    /// Attaches (or finds attached) the hooks of `owner`'s host-side interface `ifindex`:
    /// `from_container` always, `to_container` only when the container `receives` through
    /// it (see [`receives_through_hook`]); a `to_container` link it no longer needs goes.
    pub(super) fn hook_endpoint(
        &self,
        owner: u64,
        ifindex: u32,
        receives: bool,
    ) -> Result<(), BackendError> {
        let link_pins = self.endpoint_link_pins(owner);
        let [from, to] = Self::endpoint_hooks(&link_pins);
        self.attach(ifindex, &from)?;
        if receives {
            self.attach(ifindex, &to)
        } else {
            detach_link(to.link_pin)
        }
    }

    pub(super) fn endpoint_link_pins(&self, owner: u64) -> [std::path::PathBuf; 2] {
        [
            self.pins.endpoint_link(owner, "from"),
            self.pins.endpoint_link(owner, "to"),
        ]
    }

    /// The hooks of a container's host-side interface: what it sends (tcx ingress) and what
    /// it receives (tcx egress). A tcx attachment waits out an RCU grace period under the
    /// RTNL lock (10-25 ms each here); the price of sharing the interface with other programs
    /// and qdiscs, paid by an ADD for each hook its container needs, and not at all by a
    /// repeated ADD that finds them in place.
    pub(super) fn endpoint_hooks<'a>(link_pins: &'a [std::path::PathBuf; 2]) -> [Hook<'a>; 2] {
        hook_pair([FROM_CONTAINER, TO_CONTAINER], link_pins)
    }
}

/// `BPF_LINK_TYPE_TCX`.
const LINK_TYPE_TCX: u32 = 11;

/// `union bpf_attr` for `BPF_OBJ_GET_INFO_BY_FD`.
#[repr(C)]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// The head of `struct bpf_link_info` with its union as a tcx link fills it.
#[repr(C)]
#[derive(Default)]
struct TcxLinkInfo {
    link_type: u32,
    id: u32,
    program_id: u32,
    _pad: u32,
    ifindex: u32,
    attach_type: u32,
}

/// The interface the tcx link pinned at `path` attaches its program to: `None` when it is no
/// tcx link, or a defunct one (its interface gone: the kernel reports index 0). A pin open and
/// an info read, where asking the interface costs a query, then an open and an info read for
/// each program on it.
pub(super) fn tcx_link_ifindex(path: &Path) -> Result<Option<u32>, BackendError> {
    let error = |source: io::Error| BackendError::Pin {
        action: format!("could not read link {}", path.display()),
        source: Box::new(source),
    };
    let link = sys::obj_get(path).map_err(error)?;
    let mut info = TcxLinkInfo::default();
    let mut attr = InfoAttr {
        bpf_fd: sys::fd_number(link.as_fd()).map_err(error)?,
        // fail-closed: a struct's size, no kernel result.
        info_len: u32::try_from(size_of::<TcxLinkInfo>()).unwrap_or(u32::MAX),
        info: (&raw mut info) as u64,
    };
    // SAFETY: the kernel writes at most `info_len` bytes into `info`, which outlives the call.
    unsafe { sys::bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr) }.map_err(error)?;
    Ok((info.link_type == LINK_TYPE_TCX && info.ifindex != 0).then_some(info.ifindex))
}

/// Whether a link is pinned at `path`.
pub(super) fn link_pinned(path: &Path) -> Result<bool, BackendError> {
    path.try_exists().map_err(|source| BackendError::Pin {
        action: format!("could not look for link {}", path.display()),
        source: Box::new(source),
    })
}

pub(super) fn is_attached(
    program: &SchedClassifier,
    ifindex: u32,
    attach_type: TcAttachType,
) -> Result<bool, BackendError> {
    let program_error = |action: &str| {
        let action = action.to_owned();
        move |source| BackendError::Program {
            action,
            source: Box::new(source),
        }
    };
    let id = program
        .info()
        .map_err(program_error("could not read program info"))?
        .id();
    match SchedClassifier::query_tcx(ifindex, attach_type) {
        Ok((_, attached)) => Ok(attached.iter().any(|info| info.id() == id)),
        // The interface is gone: nothing is attached to it.
        Err(aya::programs::ProgramError::SyscallError(error))
            if error.io_error.raw_os_error() == Some(libc::ENODEV) =>
        {
            Ok(false)
        }
        Err(source) => Err(program_error(&format!(
            "could not query tcx programs of interface {ifindex}"
        ))(source)),
    }
}
