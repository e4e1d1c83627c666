//! Removing pins: a map's or a program's, a link's (its hook detached first), a directory of
//! them. The kernel frees what a pin held once nothing else holds it.

use std::{
    ffi::CString,
    fs, io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd},
        unix::ffi::OsStrExt,
    },
    path::Path,
};

use crate::{backend::BackendError, paths::PinLayout};

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_DETACH: libc::c_long = 34;

pub(super) fn remove_pin(path: &Path) -> Result<(), BackendError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(BackendError::Pin {
            action: format!("could not remove pin {}", path.display()),
            source: Box::new(source),
        }),
    }
}

/// Detaches the link pinned at `path` and removes its pin; a pin already gone is fine.
/// Removing the pin alone would detach the hook only once the kernel has freed the pin's
/// inode (after an RCU grace period) and put the link from a work queue: until then the
/// program still sees packets, beside any program attached in its place, and a query still
/// lists it. A link the kernel cannot detach by command (a tracepoint's) goes with its pin.
pub(super) fn detach_link(path: &Path) -> Result<(), BackendError> {
    let error = |action: &str| {
        let action = format!("could not {action} link {}", path.display());
        move |source| BackendError::Pin {
            action,
            source: Box::new(source),
        }
    };
    let link = match pinned_object(path) {
        Ok(link) => link,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => return Err(error("open")(source)),
    };
    match detach(link.as_fd()) {
        Ok(()) => {}
        Err(source) if source.raw_os_error() == Some(libc::EOPNOTSUPP) => {}
        Err(source) => return Err(error("detach")(source)),
    }
    remove_pin(path)
}

/// Detaches every link of the instance and removes its pin (see [`detach_link`]).
pub(super) fn detach_links(pins: &PinLayout) -> Result<(), BackendError> {
    let links = pins.links_dir();
    let list_error = |source: io::Error| BackendError::Pin {
        action: format!("could not list {}", links.display()),
        source: Box::new(source),
    };
    let entries = match fs::read_dir(&links) {
        Ok(entries) => entries,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(list_error(error)),
    };
    for entry in entries {
        detach_link(&entry.map_err(list_error)?.path())?;
    }
    Ok(())
}

/// `BPF_OBJ_GET`: a new descriptor of the object pinned at `path`.
pub(super) fn pinned_object(path: &Path) -> io::Result<OwnedFd> {
    let path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // union bpf_attr, BPF_OBJ_GET: pathname, bpf_fd, file_flags.
    let mut attr = [0u8; 16];
    attr[0..8].copy_from_slice(&(path.as_ptr() as u64).to_ne_bytes());
    // SAFETY: bpf(2) reads the attribute, whose path outlives the call, and returns a new
    // descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_GET, attr.as_ptr(), attr.len()) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us, nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// `BPF_LINK_DETACH`: the link's program leaves its hook now; the link lives on, defunct.
fn detach(link: BorrowedFd<'_>) -> io::Result<()> {
    // union bpf_attr, BPF_LINK_DETACH: link_fd.
    let attr = (link.as_raw_fd() as u32).to_ne_bytes();
    // SAFETY: bpf(2) reads the four bytes of the attribute; no pointers in it.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_LINK_DETACH, attr.as_ptr(), attr.len()) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Removes a directory of pins with all it holds (the instance's whole state, a migration's
/// leftovers); one already gone is fine.
pub(super) fn remove_tree(root: &Path) -> Result<(), BackendError> {
    match fs::remove_dir_all(root) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(BackendError::Pin {
            action: format!("could not remove {}", root.display()),
            source: Box::new(source),
        }),
    }
}
