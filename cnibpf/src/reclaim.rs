//! `cnibpf gc`: what CNI GC does, for hosts whose runtime never calls it (containerd does
//! not): expired connection state goes, and with `--stale` every attachment whose host
//! interface is gone — its pod's network namespace went without a DEL — is removed, hostPorts,
//! masquerade, filter and flows. An attachment whose interface exists is never touched, nor one
//! whose interface the kernel could not be asked about: every such failure is reported, the
//! other attachments and backends are still reclaimed, and the run fails.

use std::path::Path;

use crate::{
    backend::{BackendError, is_stale},
    call_stats,
    cni::error::Error,
    instance::Instance,
    output::log_line,
    paths::PinLayout,
};

pub fn run(pin_path: &Path, stale: bool) -> Result<(), Error> {
    let pins = PinLayout::new(pin_path);
    let collected = Instance::to_change(&pins)?
        .collect(|record| if stale { is_stale(record) } else { Ok(false) });
    let counted =
        call_stats::record_reclaimed(&pins.call_stats_file(), collected.removed.len() as u64);
    if let Err(error) = counted {
        log_line!("cnibpf gc: the reclaimed attachments are not counted: {error}");
    }
    for (backend, record) in &collected.removed {
        report(&format!(
            "reclaimed {} ({backend}): its interface {} is gone",
            record.attachment, record.host_ifname
        ))?;
    }
    Ok(BackendError::collect(collected.failures)?)
}

/// One line of what was done, on stdout; a line that cannot be written fails the run (its
/// caller would not know what it did).
fn report(line: &str) -> Result<(), Error> {
    crate::output::write_line(std::io::stdout(), line).map_err(Error::Output)
}
