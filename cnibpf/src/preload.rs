//! `cnibpf load`, and `cnibpf install --load`: the datapath made ready ahead of the first pod,
//! as node set-up. Otherwise the first ADD on a host waits for the kernel to verify the eBPF
//! programs (most of a second here); after a load it finds them pinned and only hooks its
//! interfaces. A load changes pinned state as that ADD would, under the instance lock: an older
//! layout is migrated, programs of another build are replaced (their links move atomically).
//! The nftables backend has nothing to load. Run it in the network namespace the plugin runs
//! in (the host's): the socket hooks learn which namespace is the host's from their loader.

use std::path::Path;

use crate::{
    backend,
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
