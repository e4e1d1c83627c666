//! `cnibpf gc`: what CNI GC does, for hosts whose runtime never calls it (containerd does
//! not): expired connection state goes, and with `--stale` every attachment whose host
//! interface is gone — its pod's network namespace went without a DEL — is removed, hostPorts,
//! masquerade, filter and flows. An attachment whose interface exists is never touched.

use std::path::Path;

use crate::{
    backend::{self, is_stale, remove_attachment},
    cni::error::Error,
    lock::{InstanceLock, lock_timeout},
    paths::PinLayout,
};

pub fn run(pin_path: &Path, stale: bool) -> Result<(), Error> {
    let pins = PinLayout::new(pin_path);
    let _lock = InstanceLock::acquire(&pins.lock_file(), lock_timeout())?;
    for mut backend in backend::existing(&pins, backend::Access::Changes)? {
        if stale {
            for record in backend.attachments()? {
                if !is_stale(&record) {
                    continue;
                }
                remove_attachment(backend.as_mut(), record.owner)?;
                println!(
                    "reclaimed {} ({}): its interface {} is gone",
                    record.attachment,
                    backend.name(),
                    record.host_ifname
                );
            }
        }
        backend.sweep_expired()?;
        backend.commit()?;
    }
    Ok(())
}
