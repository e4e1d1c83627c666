//! Backing out: `uninstall` removes cnibpf's own files and, while pods cnibpf set up run, keeps\n//! it chained in release-only mode so that their DELs still reach it.

use std::path::Path;

use serde_json::{Map, Value};

use super::{
    InstallError,
    chain::chain_out,
    files::{candidates, read_network, remove, write_atomically},
};
use crate::{
    backend::purge,
    config::ReleaseOnly,
    lock::{InstanceLock, lock_timeout},
    output::say,
    paths::{DEFAULT_PIN_PATH, PLUGIN_NAME, PinLayout, is_own_conflist},
};

/// `cnibpf uninstall`: cnibpf out of `conf_dir` and `bin_dir`, and its datapath off the node.
/// Each of cnibpf's own conflists goes with the instance its entry names when no attachment
/// of that instance is left (or with `purge`, which removes the attachments too). While pods
/// cnibpf set up remain, the file becomes the restored network with cnibpf in release-only
/// mode after it, and the binary stays: new pods are the restored network's, the old pods'
/// DELs still reach cnibpf, and the last one removes what is left (see `cni::release`). A
/// network an earlier release chained cnibpf into in place is restored.
pub fn uninstall(conf_dir: &Path, bin_dir: &Path, purge: bool) -> Result<(), InstallError> {
    let binary = bin_dir.join(PLUGIN_NAME);
    let mut binary_needed = false;
    for path in candidates(conf_dir)? {
        if is_own_conflist(&path) {
            binary_needed |= release_or_remove(&path, &binary, purge)?;
            continue;
        }
        let Some((value, _)) = read_network(&path)? else {
            continue;
        };
        let Some((restored, converted_from)) = chain_out(&value) else {
            continue;
        };
        match converted_from {
            Some(file_name) => {
                let single = conf_dir.join(file_name);
                write_atomically(&single, &restored)?;
                remove(&path)?;
                say!(
                    "took cnibpf out of {}: restored {}",
                    path.display(),
                    single.display()
                );
            }
            None => {
                write_atomically(&path, &restored)?;
                say!("took cnibpf out of {}", path.display());
            }
        }
    }
    if !binary_needed && remove(&binary)? {
        say!("removed {}", binary.display());
    }
    Ok(())
}

/// cnibpf's own conflist at `path`: removed, with the instance its entry names, when that
/// instance holds no attachment (or `purge`); else rewritten into release-only mode. Whether
/// the binary must stay for the DELs to come.
pub(super) fn release_or_remove(
    path: &Path,
    binary: &Path,
    purge: bool,
) -> Result<bool, InstallError> {
    let entry = read_network(path)?.and_then(|(value, _)| {
        let entry = value["plugins"]
            .as_array()?
            .iter()
            .find(|plugin| plugin["type"] == PLUGIN_NAME)?
            .clone();
        Some((value, entry))
    });
    let Some((network, entry)) = entry else {
        // Not a chain with cnibpf in it (any more): nothing reaches cnibpf through it.
        if remove(path)? {
            say!("removed {}", path.display());
        }
        return Ok(false);
    };
    let pins = PinLayout::new(
        entry["pinPath"]
            .as_str()
            // fail-closed: a value of the entry: none is the default pinPath.
            .unwrap_or(DEFAULT_PIN_PATH),
    );
    let _lock = InstanceLock::acquire(&pins.lock_file(), lock_timeout())?;
    if !purge && purge::holds_attachments(&pins)? {
        // For the runtimes that DEL with the configuration cached at ADD, which still names
        // cnibpf's entry as it was.
        purge::Pending::of(&ReleaseOnly {
            file: Some(path.to_owned()),
            binary: Some(binary.to_owned()),
        })
        .write(&pins)?;
        let released = release_only(&network, &entry, path, binary);
        if released != network {
            write_atomically(path, &released)?;
            say!(
                "{}: cnibpf in release-only mode: new pods are made by the network as it was; the DELs of the pods cnibpf set up still reach it, and the last one removes cnibpf's datapath, this file and {} (cnibpf uninstall --purge removes them now)",
                path.display(),
                binary.display()
            );
        }
        return Ok(true);
    }
    for removed in purge::purge(&pins)? {
        say!("removed {removed}");
    }
    if remove(path)? {
        say!("removed {}", path.display());
    }
    Ok(false)
}

/// `network` (cnibpf's own file) as the network it was made from, with cnibpf's entry after
/// it in release-only mode: the keys a DEL reads, and the files the last one removes.
pub(super) fn release_only(network: &Value, entry: &Value, path: &Path, binary: &Path) -> Value {
    let (mut restored, _) = chain_out(network)
        // fail-closed: an Option of the JSON: a network holding no cnibpf stays as it is.
        .unwrap_or_else(|| (network.clone(), None));
    let mut release = Map::new();
    release.insert("type".to_owned(), Value::from(PLUGIN_NAME));
    for key in ["pinPath", "logFile", "logMaxSizeMB", "logMaxFiles"] {
        if let Some(value) = entry.get(key) {
            release.insert(key.to_owned(), value.clone());
        }
    }
    release.insert(
        "releaseOnly".to_owned(),
        serde_json::json!({
            "file": path.display().to_string(),
            "binary": binary.display().to_string(),
        }),
    );
    if let Some(plugins) = restored["plugins"].as_array_mut() {
        plugins.push(Value::Object(release));
    }
    restored
}
