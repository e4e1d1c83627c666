//! A DEL handed to the reference portmap that `cnibpf install --replace-portmap` put cnibpf in
//! the place of. A pod made while portmap was chained has its hostPorts in portmap's iptables
//! chains; its DEL now comes through cnibpf's entry, and nothing else would remove them. The
//! plugin is run as libcni runs a chained plugin: found in `CNI_PATH`, the call's environment
//! inherited, its configuration on stdin.

use std::{
    io::{self, Write as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use serde::Deserialize;

use crate::code;

#[derive(Debug, thiserror::Error)]
pub enum DelegateError {
    #[error(
        "the portmap plugin cnibpf replaced is in no directory of CNI_PATH ({0}): its rules of this container cannot be removed"
    )]
    NotFound(String),
    #[error("could not run the replaced portmap ({path})")]
    Run {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the replaced portmap's DEL failed: {msg}")]
    Failed { code: u32, msg: String },
}

impl DelegateError {
    /// The delegate's own code when it answered with one, as libcni passes it on.
    pub fn code(&self) -> u32 {
        match self {
            Self::Failed { code, .. } => *code,
            Self::NotFound(_) | Self::Run { .. } => code::DELEGATE,
        }
    }
}

/// An error as a plugin prints it on stdout.
#[derive(Deserialize)]
struct PluginError {
    code: Option<u32>,
    msg: Option<String>,
    details: Option<String>,
}

/// Runs portmap's DEL with `config` on stdin, the environment of this call inherited.
pub fn portmap_del(config: &[u8]) -> Result<(), DelegateError> {
    // fail-closed: a variable that is not set or not text finds no plugin, reported as such.
    let search = std::env::var("CNI_PATH").unwrap_or_default();
    let binary = find_plugin(&search, "portmap")?;
    let mut child = Command::new(&binary)
        .env("CNI_COMMAND", "DEL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|source| DelegateError::Run {
            path: binary.clone(),
            source,
        })?;
    let written = child
        .stdin
        .take()
        // fail-closed: an Option of the spawn (stdin is always piped), not a result.
        .map_or(Ok(()), |mut stdin| stdin.write_all(config));
    let output = child
        .wait_with_output()
        .map_err(|source| DelegateError::Run {
            path: binary.clone(),
            source,
        })?;
    written.map_err(|source| DelegateError::Run {
        path: binary.clone(),
        source,
    })?;
    if output.status.success() {
        return Ok(());
    }
    let (code, msg) = match serde_json::from_slice::<PluginError>(&output.stdout) {
        Ok(error) => (
            // fail-closed: an answer without a code still failed; it gets cnibpf's.
            error.code.unwrap_or(code::DELEGATE),
            match (error.msg, error.details) {
                (Some(msg), Some(details)) if !details.is_empty() => format!("{msg}: {details}"),
                (Some(msg), _) => msg,
                (None, _) => format!("exited with {}", output.status),
            },
        ),
        // fail-closed: an answer that is not an error object is reported as the exit status.
        Err(_) => (code::DELEGATE, format!("exited with {}", output.status)),
    };
    Err(DelegateError::Failed { code, msg })
}

/// The plugin `name` in the first directory of `search` (a `CNI_PATH`) that holds it.
fn find_plugin(search: &str, name: &str) -> Result<PathBuf, DelegateError> {
    for directory in search.split(':').filter(|directory| !directory.is_empty()) {
        let candidate = Path::new(directory).join(name);
        // fail-closed: a directory that cannot be looked into is passed over, as libcni's
        // FindInPath does; none found is reported with the whole search path.
        if candidate.try_exists().unwrap_or(false) {
            return Ok(candidate);
        }
    }
    Err(DelegateError::NotFound(search.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_directory_holding_the_plugin_wins() {
        let root = std::env::temp_dir().join(format!("cnibpf-delegate-{}", std::process::id()));
        let (first, second) = (root.join("a"), root.join("b"));
        std::fs::create_dir_all(&first).expect("dir");
        std::fs::create_dir_all(&second).expect("dir");
        std::fs::write(second.join("portmap"), b"").expect("plugin");
        let search = format!(
            "{}::{}:{}",
            root.join("none").display(),
            first.display(),
            second.display()
        );
        assert_eq!(
            find_plugin(&search, "portmap").expect("found"),
            second.join("portmap")
        );
        assert!(matches!(
            find_plugin(&first.display().to_string(), "portmap"),
            Err(DelegateError::NotFound(_))
        ));
        std::fs::remove_dir_all(&root).expect("clean up");
    }
}
