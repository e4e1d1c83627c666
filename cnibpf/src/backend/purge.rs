//! An instance taken off the node whole: what `cnibpf uninstall --purge` does at once, and
//! what the last DEL in release-only mode does once no pod is left (see `install`).

use std::{fs, io, path::Path};

use super::{Access, BackendError, ebpf, existing, remove_attachment};
use crate::paths::PinLayout;

/// Whether a backend holds any attachment of the instance at `pins` (for nftables, of any
/// network: its table is one for the host). A state that cannot be read is an error, never
/// "none".
pub fn holds_attachments(pins: &PinLayout) -> Result<bool, BackendError> {
    for backend in existing(pins, Access::Changes)? {
        if !backend.attachments()?.is_empty() {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Removes every attachment's state from every backend, then what the instance keeps for all
/// of them — the pinned datapath (programs, maps, links: the hooks detach), the nftables table
/// (it goes with its last attachment), the call statistics and the lock files. The caller
/// holds the instance lock. What it removed, one line each.
pub fn purge(pins: &PinLayout) -> Result<Vec<String>, BackendError> {
    let mut removed = Vec::new();
    let root = pins.root();
    let pinned = root.try_exists().map_err(|source| BackendError::Unpin {
        path: root.to_owned(),
        source,
    })?;
    for mut backend in existing(pins, Access::Changes)? {
        let records = backend.attachments()?;
        for record in &records {
            remove_attachment(backend.as_mut(), record.owner)?;
        }
        backend.commit()?;
        for record in &records {
            removed.push(format!(
                "{} of the {} backend",
                record.attachment,
                backend.name()
            ));
        }
    }
    let unpinned = ebpf::remove_pinned(pins)?;
    if unpinned.is_empty() && pinned {
        removed.push(format!(
            "eBPF datapath {} (with its last attachment)",
            root.display()
        ));
    }
    removed.extend(unpinned);
    for file in [
        pins.call_stats_file(),
        pins.monitor_lock_file(),
        pins.release_file(),
        pins.lock_file(),
    ] {
        if remove_file(&file)? {
            removed.push(file.display().to_string());
        }
    }
    Ok(removed)
}

/// Removes the file at `path`; whether there was one.
pub fn remove_file(path: &Path) -> Result<bool, BackendError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(source) if source.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(BackendError::Unpin {
            path: path.to_owned(),
            source,
        }),
    }
}
