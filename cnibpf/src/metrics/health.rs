//! `/healthz`: the exporter runs and can read the datapath's state. `/readyz`: the node is
//! served by this build — the binary in the CNI bin dir is this one, cnibpf is chained into the
//! network the runtime uses, and the datapath is loaded at this build's layout. The DaemonSet's
//! probes stop a rollout whose `install --load` did not leave a node so.

use std::{
    fs,
    io::{self, Read as _},
    os::unix::fs::MetadataExt as _,
    path::Path,
};

use sha2::{Digest as _, Sha256};

use super::Exporter;
use crate::{
    backend::{BackendError, ebpf::EbpfBackend, nftables},
    install,
    model::BackendChoice,
    paths::PLUGIN_NAME,
};

/// One readiness check and its outcome.
#[derive(Debug)]
pub struct Check {
    pub name: &'static str,
    pub outcome: Result<(), String>,
}

/// The installed binary last found to be this build, by what identifies the file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BinaryCheck {
    found: Option<(u64, u64, u64, i64, i64)>,
}

/// Healthy when the state of both backends can be read, whatever it holds (what it holds is
/// readiness).
pub fn healthy(exporter: &Exporter) -> Result<(), String> {
    EbpfBackend::loaded_by_this_build(&exporter.pins)
        .map(drop)
        .map_err(|error| format!("the eBPF state cannot be read: {error}"))?;
    nftables::table_at_this_layout()
        .map(drop)
        .map_err(|error| format!("table inet cnibpf cannot be read: {error}"))
}

pub fn readiness(exporter: &Exporter) -> Vec<Check> {
    vec![
        Check {
            name: "binary",
            outcome: installed_binary(exporter),
        },
        Check {
            name: "chained",
            outcome: install::chained(&exporter.conf_dir, exporter.network.as_deref())
                // fail-closed: a check that cannot be made is not ready, with its cause.
                .unwrap_or_else(|error| Err(error.to_string())),
        },
        Check {
            name: "datapath",
            // fail-closed: as above.
            outcome: datapath(exporter).unwrap_or_else(|error| Err(error.to_string())),
        },
    ]
}

/// Whether `<bin dir>/cnibpf` is this very build.
fn installed_binary(exporter: &Exporter) -> Result<(), String> {
    let installed = exporter.bin_dir.join(PLUGIN_NAME);
    let metadata = match fs::metadata(&installed) {
        Ok(metadata) => metadata,
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            return Err(format!("{} is not there", installed.display()));
        }
        Err(error) => return Err(format!("{}: {error}", installed.display())),
    };
    let identity = (
        metadata.dev(),
        metadata.ino(),
        metadata.len(),
        metadata.mtime(),
        metadata.mtime_nsec(),
    );
    // fail-closed: a lock poisoned by a panic still holds the last check.
    let mut check = exporter
        .binary_check
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if check.found == Some(identity) {
        return Ok(());
    }
    let this =
        std::env::current_exe().map_err(|error| format!("this program's binary: {error}"))?;
    let same = digest(&installed)
        .and_then(|installed| Ok(installed == digest(&this)?))
        .map_err(|error| format!("could not compare {}: {error}", installed.display()))?;
    if !same {
        return Err(format!(
            "{} is another build than this one (`cnibpf install` puts this one there)",
            installed.display()
        ));
    }
    check.found = Some(identity);
    Ok(())
}

fn digest(path: &Path) -> io::Result<[u8; 32]> {
    let mut file = fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0; 1 << 16];
    loop {
        let read = file.read(&mut buffer)?;
        if read == 0 {
            return Ok(hasher.finalize().into());
        }
        hasher.update(&buffer[..read]);
    }
}

/// Whether the datapath the entry's backend picks is this build's, at this layout.
fn datapath(exporter: &Exporter) -> Result<Result<(), String>, BackendError> {
    let ebpf = match exporter.backend {
        BackendChoice::Ebpf => true,
        BackendChoice::Nftables => false,
        BackendChoice::Auto => match EbpfBackend::probe() {
            Ok(()) => true,
            Err(BackendError::Unavailable { .. }) => false,
            Err(error) => return Err(error),
        },
    };
    if ebpf {
        EbpfBackend::loaded_by_this_build(&exporter.pins)
    } else {
        nftables::table_at_this_layout()
    }
}
