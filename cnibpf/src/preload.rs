//! `cnibpf load`, and `cnibpf install --load`: the datapath made ready ahead of the first pod,
//! as node set-up; `cnibpf unload` takes it off a node no pod uses it on (the last pod's DEL
//! leaves it for the next pod). Otherwise the first ADD on a host waits for the kernel to
//! verify the eBPF programs (most of a second here); after a load it finds them pinned and
//! only hooks its interfaces. A load changes pinned state as that ADD would, under the instance lock: an older
//! layout is migrated, programs of another build are replaced (their links move atomically).
//! The nftables backend has nothing to load. Run it in the network namespace the plugin runs
//! in (the host's): the socket hooks learn which namespace is the host's from their loader.

use std::path::Path;

use crate::{
    backend::{self, purge},
    cni::error::Error,
    lock::{InstanceLock, lock_timeout},
    model::{BackendChoice, Capacity},
    paths::PinLayout,
};

/// Loads what `choice` will use under `pin_path`; what was done, for the operator.
pub fn run(pin_path: &Path, choice: BackendChoice, capacity: &Capacity) -> Result<String, Error> {
    let pins = PinLayout::new(pin_path);
    let _lock = InstanceLock::acquire(&pins.lock_file(), lock_timeout())?;
    Ok(if backend::preload(choice, &pins, capacity)? {
        let memory = backend::ebpf::memory(&pins)?;
        format!(
            "{}: eBPF datapath loaded and pinned ({}; its maps lock {:.1} MiB)",
            pin_path.display(),
            memory.capacity,
            memory.bytes as f64 / 1_048_576.0
        )
    } else {
        format!(
            "{}: the nftables backend will serve, nothing to load ahead",
            pin_path.display()
        )
    })
}

/// Removes the datapath and files of the instance at `pin_path` when no attachment holds them;
/// what was removed, for the operator.
pub fn unload(pin_path: &Path) -> Result<String, Error> {
    let pins = PinLayout::new(pin_path);
    let _lock = InstanceLock::acquire(&pins.lock_file(), lock_timeout())?;
    // fail-closed: what cannot be looked at counts as loaded, and the purge says what it found.
    let loaded = [pins.root().to_owned(), pins.nftables_state_file()]
        .iter()
        .any(|path| path.try_exists().unwrap_or(true));
    let removed = purge::unload(&pins)?;
    Ok(if loaded {
        removed
            .iter()
            .map(|line| format!("removed {line}"))
            .collect::<Vec<_>>()
            .join("\n")
    } else {
        format!("{}: nothing loaded", pin_path.display())
    })
}
