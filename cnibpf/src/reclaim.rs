//! `cnibpf gc`: what CNI GC does, for hosts whose runtime never calls it (containerd does
//! not): expired connection state goes, and with `--stale` every attachment whose host
//! interface is gone — its pod's network namespace went without a DEL — is removed, hostPorts,
//! masquerade, filter and flows. An attachment whose interface exists is never touched, nor one
//! whose interface the kernel could not be asked about: every such failure is reported, the
//! other attachments and backends are still reclaimed, and the run fails.

use std::path::Path;

use crate::{
    backend::{self, AttachmentRecord, Backend, BackendError, is_stale, remove_attachment},
    call_stats,
    cni::error::Error,
    lock::{InstanceLock, lock_timeout},
    output::log_line,
    paths::PinLayout,
};

pub fn run(pin_path: &Path, stale: bool) -> Result<(), Error> {
    let pins = PinLayout::new(pin_path);
    let _lock = InstanceLock::acquire(&pins.lock_file(), lock_timeout())?;
    let mut failures: Vec<(&'static str, BackendError)> = Vec::new();
    for mut backend in backend::existing(&pins, backend::Access::Changes)? {
        let mut reclaimed = Vec::new();
        if stale {
            match reclaim_stale(backend.as_mut(), &mut failures) {
                Ok(records) => reclaimed = records,
                Err(error) => failures.push((backend.name(), error)),
            }
        }
        let swept = backend.sweep_expired();
        // What the nftables backend removed is in once its transaction is.
        match backend.commit() {
            Ok(()) => {
                let counted =
                    call_stats::record_reclaimed(&pins.call_stats_file(), reclaimed.len() as u64);
                if let Err(error) = counted {
                    log_line!("cnibpf gc: the reclaimed attachments are not counted: {error}");
                }
                for record in reclaimed {
                    report(&format!(
                        "reclaimed {} ({}): its interface {} is gone",
                        record.attachment,
                        backend.name(),
                        record.host_ifname
                    ))?;
                }
            }
            Err(error) => failures.push((backend.name(), error)),
        }
        failures.extend(swept.err().map(|error| (backend.name(), error)));
    }
    Ok(BackendError::collect(failures)?)
}

/// Removes the attachments of `backend` whose interface is gone; what failed for one (the
/// question or the removal) goes to `failures` and the others go on.
fn reclaim_stale(
    backend: &mut dyn Backend,
    failures: &mut Vec<(&'static str, BackendError)>,
) -> Result<Vec<AttachmentRecord>, BackendError> {
    let mut reclaimed = Vec::new();
    for record in backend.attachments()? {
        let outcome = is_stale(&record).and_then(|gone| {
            if gone {
                remove_attachment(backend, record.owner)?;
            }
            Ok(gone)
        });
        match outcome {
            Ok(false) => {}
            Ok(true) => reclaimed.push(record),
            Err(error) => failures.push((backend.name(), error)),
        }
    }
    Ok(reclaimed)
}

/// One line of what was done, on stdout; a line that cannot be written fails the run (its
/// caller would not know what it did).
fn report(line: &str) -> Result<(), Error> {
    crate::output::write_line(std::io::stdout(), line).map_err(Error::Output)
}
