//! The `bpf()` commands cnibpf makes itself, where aya 0.16 has none (batches, link detach,
//! link info) or asks the kernel more than a call needs (opening a pinned program reads its
//! info, which creating a link does not use): one unsafe system call, and the commands on it.

use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd, RawFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

use aya::programs::TcAttachType;

/// Commands from the kernel's `enum bpf_cmd`.
pub(super) const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
pub(super) const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
pub(super) const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
pub(super) const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
pub(super) const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
pub(super) const BPF_PROG_QUERY: libc::c_long = 16;
pub(super) const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
pub(super) const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_LINK_DETACH: libc::c_long = 34;

/// `BPF_TCX_INGRESS`, `BPF_TCX_EGRESS` (`enum bpf_attach_type`).
pub(super) const BPF_TCX_INGRESS: u32 = 46;
const BPF_TCX_EGRESS: u32 = 47;
/// `BPF_F_AFTER`: with no relative program, the link goes last, after whatever an operator or
/// another plugin attached before it (aya's default order).
const BPF_F_AFTER: u32 = 1 << 4;

/// `bpf(command, attr)`: the kernel's non-negative answer (a new descriptor for the commands
/// that make one, else 0) or its error.
///
/// # Safety
///
/// `attr` is laid out as `command`'s member of `union bpf_attr`, and every pointer in it
/// points at a buffer of the size the command implies, which outlives the call.
pub(super) unsafe fn bpf<A>(command: libc::c_long, attr: &mut A) -> io::Result<libc::c_long> {
    // SAFETY: as the caller promised; bpf(2) reads (and for some commands writes back)
    // `size_of::<A>()` bytes of `attr`.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            command,
            core::ptr::from_mut(attr),
            size_of::<A>(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc)
}

/// [`bpf`] for a command that answers with a new descriptor.
///
/// # Safety
///
/// As [`bpf`]'s, and `command` is one that returns a descriptor.
pub(super) unsafe fn bpf_fd<A>(command: libc::c_long, attr: &mut A) -> io::Result<OwnedFd> {
    // SAFETY: as the caller promised.
    let fd = unsafe { bpf(command, attr) }?;
    let fd = RawFd::try_from(fd).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    // SAFETY: the kernel just returned this descriptor to us, nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A descriptor's number as `union bpf_attr` holds it.
pub(super) fn fd_number(fd: BorrowedFd<'_>) -> io::Result<u32> {
    u32::try_from(fd.as_raw_fd()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// `union bpf_attr` for `BPF_OBJ_PIN` and `BPF_OBJ_GET`.
#[repr(C)]
#[derive(Default)]
struct ObjAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// `BPF_OBJ_GET`: a new descriptor of the object pinned at `path`.
pub(super) fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let path = c_path(path)?;
    let mut attr = ObjAttr {
        pathname: path.as_ptr() as u64,
        ..ObjAttr::default()
    };
    // SAFETY: the attribute's path outlives the call; BPF_OBJ_GET returns a descriptor.
    unsafe { bpf_fd(BPF_OBJ_GET, &mut attr) }
}

/// `BPF_OBJ_PIN`: pins the object `fd` at `path`.
pub(super) fn obj_pin(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let path = c_path(path)?;
    let mut attr = ObjAttr {
        pathname: path.as_ptr() as u64,
        bpf_fd: fd_number(fd)?,
        file_flags: 0,
    };
    // SAFETY: the attribute's path outlives the call.
    unsafe { bpf(BPF_OBJ_PIN, &mut attr) }.map(drop)
}

/// `union bpf_attr` for `BPF_LINK_CREATE` of a tcx link.
#[repr(C)]
#[derive(Default)]
struct TcxLinkCreateAttr {
    prog_fd: u32,
    target_ifindex: u32,
    attach_type: u32,
    flags: u32,
    relative_fd: u32,
    _pad: u32,
    expected_revision: u64,
}

/// `BPF_LINK_CREATE`: attaches the program `program` to interface `ifindex` with a tcx link
/// placed after every program already there. The kernel refuses a program that is not a TC
/// classifier.
pub(super) fn tcx_link_create(
    program: BorrowedFd<'_>,
    ifindex: u32,
    attach_type: TcAttachType,
) -> io::Result<OwnedFd> {
    let mut attr = TcxLinkCreateAttr {
        prog_fd: fd_number(program)?,
        target_ifindex: ifindex,
        attach_type: match attach_type {
            TcAttachType::Ingress => BPF_TCX_INGRESS,
            TcAttachType::Egress => BPF_TCX_EGRESS,
        },
        flags: BPF_F_AFTER,
        ..TcxLinkCreateAttr::default()
    };
    // SAFETY: no pointers in the attribute; BPF_LINK_CREATE returns a descriptor.
    unsafe { bpf_fd(BPF_LINK_CREATE, &mut attr) }
}

/// `BPF_LINK_DETACH`: the link's program leaves its hook now; the link lives on, defunct.
pub(super) fn link_detach(link: BorrowedFd<'_>) -> io::Result<()> {
    let mut link_fd = fd_number(link)?;
    // SAFETY: the attribute is the link's descriptor alone, no pointers.
    unsafe { bpf(BPF_LINK_DETACH, &mut link_fd) }.map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_laid_out_as_the_kernels_union() {
        assert_eq!(size_of::<ObjAttr>(), 16);
        // link_create's tcx member: relative_fd at 16, expected_revision at 24.
        assert_eq!(core::mem::offset_of!(TcxLinkCreateAttr, relative_fd), 16);
        assert_eq!(
            core::mem::offset_of!(TcxLinkCreateAttr, expected_revision),
            24
        );
    }
}
