//! Removing pins: a map's or a program's, a link's (its hook detached first), a directory of
//! them. The kernel frees what a pin held once nothing else holds it.

use std::{fs, io, os::fd::AsFd as _, path::Path};

use super::sys;
use crate::{backend::BackendError, paths::PinLayout};

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
    let link = match sys::obj_get(path) {
        Ok(link) => link,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => return Err(error("open")(source)),
    };
    match sys::link_detach(link.as_fd()) {
        Ok(()) => {}
        Err(source) if source.raw_os_error() == Some(libc::EOPNOTSUPP) => {}
        Err(source) => return Err(error("detach")(source)),
    }
    remove_pin(path)
}

/// Detaches every link of the instance and removes its pin (see [`detach_link`]).
pub(super) fn detach_links(pins: &PinLayout) -> Result<(), BackendError> {
    for link in pinned_links(pins)? {
        detach_link(&link)?;
    }
    Ok(())
}

/// The pins of the instance's links (none when it has no links directory).
pub(super) fn pinned_links(pins: &PinLayout) -> Result<Vec<std::path::PathBuf>, BackendError> {
    let links = pins.links_dir();
    let list_error = |source: io::Error| BackendError::Pin {
        action: format!("could not list {}", links.display()),
        source: Box::new(source),
    };
    let entries = match fs::read_dir(&links) {
        Ok(entries) => entries,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) => return Err(list_error(error)),
    };
    entries
        .map(|entry| entry.map(|entry| entry.path()).map_err(list_error))
        .collect()
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
