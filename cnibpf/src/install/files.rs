//! The conf dir's files as libcni reads them, and writing ours so that no reader ever sees\n//! half of one.

use std::{
    fs, io,
    path::{Path, PathBuf},
};

use serde_json::Value;

use super::{InstallError, chain::Form, io_error};
use crate::paths::{OWN_CONFLIST_SUFFIX, PLUGIN_NAME};

/// A network configuration file as a runtime would read it.
pub(super) struct NetworkFile {
    pub(super) path: PathBuf,
    pub(super) value: Value,
    pub(super) form: Form,
}

impl NetworkFile {
    pub(super) fn file_name(&self) -> String {
        self.path
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            // fail-closed: an Option of the path: a conf file always has a name.
            .unwrap_or_default()
    }
}

/// The network configurations of `dir` in the order runtimes consider them (libcni's: file
/// names sorted, `.conf`, `.conflist` and `.json` only), those that do not parse left out as
/// kubelet and CRI-O leave them out.
pub(super) fn networks(dir: &Path) -> Result<Vec<NetworkFile>, InstallError> {
    let mut networks = Vec::new();
    for path in candidates(dir)? {
        if let Some((value, form)) = read_network(&path)? {
            networks.push(NetworkFile { path, value, form });
        }
    }
    Ok(networks)
}

/// The files of `dir` a runtime considers, sorted.
pub(super) fn candidates(dir: &Path) -> Result<Vec<PathBuf>, InstallError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) => return Err(io_error(format!("read {}", dir.display()))(error)),
    };
    let mut paths = Vec::new();
    for entry in entries {
        let path = entry
            .map_err(io_error(format!("read {}", dir.display())))?
            .path();
        let considered = path.extension().is_some_and(|extension| {
            ["conf", "conflist", "json"].contains(&&*extension.to_string_lossy())
        });
        if considered {
            paths.push(path);
        }
    }
    paths.sort();
    Ok(paths)
}

/// The network in the file at `path`; `None` when it is gone or does not parse as one (a
/// runtime skips it too). A file that cannot be read is an error: skipping it would make the
/// next file the primary network.
pub(super) fn read_network(path: &Path) -> Result<Option<(Value, Form)>, InstallError> {
    let bytes = match fs::read(path) {
        Ok(bytes) => bytes,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(io_error(format!("read {}", path.display()))(error)),
    };
    // fail-closed: a file that is not JSON is no network, as runtimes read it.
    let Ok(value) = serde_json::from_slice::<Value>(&bytes) else {
        return Ok(None);
    };
    Ok(Form::of(&value).map(|form| (value, form)))
}

/// Copies `binary` to `<bin_dir>/cnibpf` unless an identical file is there; whether it did.
pub(super) fn install_binary(binary: &Path, bin_dir: &Path) -> Result<bool, InstallError> {
    let target = bin_dir.join(PLUGIN_NAME);
    let content = fs::read(binary).map_err(io_error(format!("read {}", binary.display())))?;
    // fail-closed: one that cannot be read is written anew, which is never wrong.
    if fs::read(&target).is_ok_and(|installed| installed == content) {
        return Ok(false);
    }
    fs::create_dir_all(bin_dir).map_err(io_error(format!("create {}", bin_dir.display())))?;
    replace_file(&target, &content, 0o755)?;
    Ok(true)
}

/// Writes `value` to `path` as indented JSON, atomically.
pub(super) fn write_atomically(path: &Path, value: &Value) -> Result<(), InstallError> {
    let mut text = serde_json::to_vec_pretty(value).map_err(|error| InstallError::Io {
        action: format!("encode {}", path.display()),
        source: error.into(),
    })?;
    text.push(b'\n');
    replace_file(path, &text, 0o644)
}

/// [`crate::atomic_file::replace`], its failure an install error.
pub(super) fn replace_file(path: &Path, content: &[u8], mode: u32) -> Result<(), InstallError> {
    crate::atomic_file::replace(path, content, mode)
        .map_err(io_error(format!("write {}", path.display())))
}

/// Removes the file at `path`; whether there was one.
pub(super) fn remove(path: &Path) -> Result<bool, InstallError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(error) => Err(io_error(format!("remove {}", path.display()))(error)),
    }
}

/// cnibpf's own file for the network of `source` (see [`OWN_CONFLIST_SUFFIX`]).
pub(super) fn own_file_of(source: &Path) -> PathBuf {
    let stem = source
        .file_stem()
        .map(|stem| stem.to_string_lossy().into_owned())
        // fail-closed: an Option of the path: a conf file always has a name.
        .unwrap_or_default();
    source.with_file_name(format!("{stem}{OWN_CONFLIST_SUFFIX}"))
}
