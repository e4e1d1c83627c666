//! An instance taken off the node whole: what `cnibpf uninstall --purge` does at once, and
//! what the last DEL in release-only mode does once no pod is left (see `install`).

use std::{
    fs, io,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use super::{Access, BackendError, ebpf, existing};
use crate::{config::ReleaseOnly, paths::PinLayout};

/// Whether a backend holds any attachment of the instance at `pins` (for nftables, of any
/// network: its table is one for the host). A state that cannot be read is an error, never
/// "none".
pub fn holds_attachments(pins: &PinLayout) -> Result<bool, BackendError> {
    Ok(attachment_count(pins)? > 0)
}

/// The attachments every backend of the instance at `pins` holds.
fn attachment_count(pins: &PinLayout) -> Result<usize, BackendError> {
    let mut count = 0;
    for backend in existing(pins, Access::Changes)? {
        count += backend.attachments()?.len();
    }
    Ok(count)
}

/// `cnibpf unload`: the instance's datapath and files off the node when no attachment holds
/// them (refused otherwise: its pods' traffic runs through it). The caller holds the instance
/// lock. What it removed, one line each.
pub fn unload(pins: &PinLayout) -> Result<Vec<String>, BackendError> {
    match attachment_count(pins)? {
        0 => purge(pins),
        count => Err(BackendError::StillServing {
            path: pins.root().to_owned(),
            count,
        }),
    }
}

/// Removes every attachment's state from every backend, then what the instance keeps for all
/// of them — the pinned datapath (programs, maps, links: the hooks detach), the nftables table
/// and its state file (they go with the last attachment), the call statistics and the lock
/// files. The caller
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
            backend.remove(record.owner)?;
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
    let state_file = pins.nftables_state_file();
    let temporaries = crate::atomic_file::reap_temporaries(&state_file).map_err(|source| {
        BackendError::Unpin {
            path: state_file.clone(),
            source,
        }
    })?;
    removed.extend(temporaries.iter().map(|path| path.display().to_string()));
    for file in [
        pins.nftables_state_file(),
        pins.call_stats_file(),
        pins.monitor_lock_file(),
        pins.match_monitor_lock_file(),
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

/// A pod made while cnibpf waited for its last DEL: its runtime may DEL it through cnibpf's
/// binary (the configuration it cached names cnibpf's release-only entry).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PassThrough {
    pub container_id: String,
    pub ifname: String,
    pub netns: Option<PathBuf>,
}

impl PassThrough {
    /// Whether the pod still lives: its network namespace is there (one that cannot be looked
    /// at counts as there; a pod without one is gone).
    pub fn lives(&self) -> bool {
        self.netns
            .as_ref()
            // fail-closed: an error looking counts as there; the binary then stays.
            .is_some_and(|netns| netns.try_exists().unwrap_or(true))
    }
}

/// The instance's release file (`PinLayout::release_file`): written by `cnibpf uninstall` while
/// pods cnibpf set up remain, kept by the plugin's calls in release-only mode, removed with
/// the instance.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Pending {
    /// The conflist and binary the last DEL removes.
    pub release_only: ReleaseOnly,
    /// The pods made in release-only mode that may still DEL through the binary.
    #[serde(default)]
    pub pass_through: Vec<PassThrough>,
    /// The datapath is gone; the binary waits for the pass-through pods' DELs.
    #[serde(default)]
    pub binary_kept: bool,
}

impl Pending {
    pub fn of(release_only: &ReleaseOnly) -> Self {
        Self {
            release_only: release_only.clone(),
            ..Self::default()
        }
    }

    /// The release file of `pins`, `None` when there is none.
    pub fn read(pins: &PinLayout) -> Result<Option<Self>, BackendError> {
        let path = pins.release_file();
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(BackendError::UnreadableState { path, source }),
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|_| BackendError::ForeignReleaseFile { path })
    }

    /// Writes the release file of `pins` whole (a reader meets the old one or this one).
    pub fn write(&self, pins: &PinLayout) -> Result<(), BackendError> {
        let path = pins.release_file();
        let staged = path.with_extension("release-new");
        let error = |source: io::Error| BackendError::Pin {
            action: format!("could not write {}", path.display()),
            source: Box::new(source),
        };
        let text = serde_json::to_vec(self)
            .map_err(|error| error.into())
            .map_err(error)?;
        fs::write(&staged, text).map_err(error)?;
        fs::rename(&staged, &path).map_err(error)
    }
}
