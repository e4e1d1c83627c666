//! `cnibpf install` and `cnibpf uninstall`: the plugin onto a node the way CNI add-ons get
//! there from a DaemonSet — its binary into the host's CNI bin dir, its entry into the network
//! the runtime uses — and off again, leaving everything else as it was.
//!
//! Runtimes read these directories while we write them (containerd reloads on every inotify
//! event), and run the binary while it is replaced. So nothing is written in place: each file
//! is written whole under a name runtimes ignore (a dot file with a `.tmp` extension), synced,
//! and renamed over the old one, which a running process keeps as it was.

mod chain;
mod watch;

use std::{
    fs,
    io::{self, Write as _},
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    time::Duration,
};

use serde_json::{Map, Value};

use self::chain::{Form, chain_in, chain_out};
use crate::output::{log_line, say};
use crate::{
    config::{NetConf, PluginConfig},
    paths::PLUGIN_NAME,
    preload,
};

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error(
        "network {network:?} ({file}) chains the reference portmap, and cnibpf would translate hostPorts a second time: pass --replace-portmap to put cnibpf in its place (the portMappings capability moves to cnibpf, uninstall puts portmap back)"
    )]
    PortmapPresent { network: String, file: String },
    #[error(
        "no network configuration in {0} (a .conf, .conflist or .json file that parses): the primary CNI has not written its own yet"
    )]
    NoNetwork(PathBuf),
    #[error("no network named {name:?} in {dir}")]
    NoSuchNetwork { name: String, dir: PathBuf },
    #[error("{0} exists already: cnibpf would write the chain of the network it converts there")]
    ConvertedExists(PathBuf),
    #[error("the entry in {path}: {reason}")]
    Entry { path: PathBuf, reason: String },
    #[error("could not {action}")]
    Io {
        action: String,
        #[source]
        source: io::Error,
    },
}

fn io_error(action: impl Into<String>) -> impl FnOnce(io::Error) -> InstallError {
    let action = action.into();
    move |source| InstallError::Io { action, source }
}

/// What `cnibpf install` is asked to do.
#[derive(Debug)]
pub struct Install {
    pub conf_dir: PathBuf,
    pub bin_dir: PathBuf,
    /// The network to chain into; the one the runtime uses when `None`.
    pub network: Option<String>,
    /// cnibpf's keys in its entry (`type` aside).
    pub entry: Map<String, Value>,
    pub replace_portmap: bool,
}

impl Install {
    /// The entry from a JSON file holding an object, or the default: every key at its
    /// default (the `portMappings` capability is added to an entry that names no capabilities).
    pub fn entry_from(path: Option<&Path>) -> Result<Map<String, Value>, InstallError> {
        let Some(path) = path else {
            return Ok(Map::new());
        };
        let text = fs::read_to_string(path)
            .map_err(io_error(format!("read the entry {}", path.display())))?;
        match serde_json::from_str(&text) {
            Ok(Value::Object(entry)) => Ok(entry),
            Ok(_) => Err(InstallError::Entry {
                path: path.to_owned(),
                reason: "not a JSON object".to_owned(),
            }),
            Err(error) => Err(InstallError::Entry {
                path: path.to_owned(),
                reason: error.to_string(),
            }),
        }
    }

    /// The binary in place and the entry chained in, once.
    pub fn run(&self) -> Result<(), InstallError> {
        // What the network becomes is worked out first: a refused chain changes nothing.
        let chaining = self.chaining(networks(&self.conf_dir)?)?;
        self.install_binary()?;
        chaining.apply()
    }

    /// Loads the datapath of the entry's backend and pinPath (see `crate::preload`). Reported,
    /// not fatal: otherwise the node's first ADD loads it, and answers with the cause.
    pub fn load_datapath(&self) {
        let loaded = self.entry_config().and_then(|plugin| {
            preload::run(&plugin.pin_path, plugin.backend).map_err(|error| error.to_string())
        });
        match loaded {
            Ok(done) => say!("{done}"),
            Err(error) => log_line!(
                "cnibpf install: could not load the datapath ahead of the first pod (its ADD will try): {error}"
            ),
        }
    }

    /// The entry as the plugin will read it: its keys in a network of their own.
    pub fn entry_config(&self) -> Result<PluginConfig, String> {
        let mut network = self.entry.clone();
        network
            .entry("cniVersion")
            .or_insert_with(|| Value::from("1.0.0"));
        network.insert("name".to_owned(), Value::from("cnibpf-install"));
        network.insert("type".to_owned(), Value::from(PLUGIN_NAME));
        let bytes =
            serde_json::to_vec(&Value::Object(network)).map_err(|error| error.to_string())?;
        NetConf::parse(&bytes)
            .map(|conf| conf.plugin)
            .map_err(|error| format!("the entry: {error}"))
    }

    fn install_binary(&self) -> Result<(), InstallError> {
        let binary = std::env::current_exe().map_err(io_error("find this program's binary"))?;
        if install_binary(&binary, &self.bin_dir)? {
            say!("installed {}", self.bin_dir.join(PLUGIN_NAME).display());
        }
        Ok(())
    }

    /// Runs [`Self::run`], then keeps the entry chained in as the primary CNI rewrites its
    /// file, and every `reclaim_every` removes the attachments of `pin_path` whose DEL never
    /// came, until SIGTERM or SIGINT. `beside` runs first, once the binary is in place and
    /// SIGTERM and SIGINT are blocked for the threads it may start (the metrics endpoint's).
    pub fn run_and_watch(
        &self,
        reclaim: Option<(Duration, PathBuf)>,
        beside: impl FnOnce() -> Result<(), InstallError>,
    ) -> Result<(), InstallError> {
        let binary = std::env::current_exe().map_err(io_error("find this program's binary"))?;
        install_binary(&binary, &self.bin_dir)?;
        // Blocked before another thread starts, which inherits the mask: the signals are the
        // watch loop's to take, never a default action in another thread.
        watch::block_signals()?;
        beside()?;
        watch::run(&self.conf_dir, reclaim, || {
            match self.chain_when_readable() {
                Ok(()) => {}
                // The primary may not have written its file yet, or may be half way through.
                Err(error) => log_line!("cnibpf install: {error}"),
            }
        })
    }

    /// [`Self::chain`], unless a file a runtime would consider first does not parse: the
    /// primary may be half way through writing it in place, and the next network is not the
    /// one to chain into.
    fn chain_when_readable(&self) -> Result<(), InstallError> {
        let mut networks = Vec::new();
        for path in candidates(&self.conf_dir)? {
            match read_network(&path)? {
                Some((value, form)) => networks.push(NetworkFile { path, value, form }),
                None if networks.is_empty() => {
                    log_line!("cnibpf install: waiting for {} to parse", path.display());
                    return Ok(());
                }
                None => {}
            }
        }
        self.chaining(networks)?.apply()
    }

    /// The entry chained into the network (of `networks`, in the runtime's order), not yet
    /// written.
    fn chaining(&self, networks: Vec<NetworkFile>) -> Result<Chaining, InstallError> {
        let primary = match &self.network {
            Some(name) => networks
                .into_iter()
                .find(|network| network.value["name"].as_str() == Some(name))
                .ok_or_else(|| InstallError::NoSuchNetwork {
                    name: name.clone(),
                    dir: self.conf_dir.clone(),
                })?,
            None => networks
                .into_iter()
                .next()
                .ok_or_else(|| InstallError::NoNetwork(self.conf_dir.clone()))?,
        };
        let chained = chain_in(
            &primary.value,
            primary.form,
            &primary.file_name(),
            &self.entry,
            self.replace_portmap,
        )?;
        if primary.form == Form::Single {
            let conflist = primary.path.with_extension("conflist");
            let taken = conflist
                .try_exists()
                .map_err(io_error(format!("look for {}", conflist.display())))?;
            if taken {
                return Err(InstallError::ConvertedExists(conflist));
            }
        }
        Ok(Chaining {
            primary,
            conflist: chained.conflist,
            notes: chained.notes,
        })
    }
}

/// A network with the entry chained in, to be written.
struct Chaining {
    primary: NetworkFile,
    conflist: Value,
    notes: Vec<String>,
}

impl Chaining {
    /// Writes the network, only when that changes it.
    fn apply(self) -> Result<(), InstallError> {
        for note in &self.notes {
            log_line!("cnibpf install: note: {note}");
        }
        // fail-closed: a value of the conflist, for the message.
        let network_name = self.conflist["name"].as_str().unwrap_or_default();
        let path = &self.primary.path;
        match self.primary.form {
            Form::List if self.conflist == self.primary.value => Ok(()),
            Form::List => {
                write_atomically(path, &self.conflist)?;
                say!(
                    "chained cnibpf into network {network_name:?} ({})",
                    path.display()
                );
                Ok(())
            }
            Form::Single => {
                let conflist = path.with_extension("conflist");
                // The chain is in place before the single plugin goes: a runtime reading in
                // between still finds the network, unchained, first.
                write_atomically(&conflist, &self.conflist)?;
                remove(path)?;
                say!(
                    "chained cnibpf into network {network_name:?}: {} is now {}",
                    path.display(),
                    conflist.display()
                );
                Ok(())
            }
        }
    }
}

/// `cnibpf uninstall`: cnibpf's entry out of every network in `conf_dir` (what it replaced put
/// back), and its binary out of `bin_dir`. Pinned state stays for the last DEL: running pods
/// keep their datapath.
pub fn uninstall(conf_dir: &Path, bin_dir: &Path) -> Result<(), InstallError> {
    for network in networks(conf_dir)? {
        let Some((restored, converted_from)) = chain_out(&network.value) else {
            continue;
        };
        match converted_from {
            Some(file_name) => {
                let single = conf_dir.join(file_name);
                write_atomically(&single, &restored)?;
                remove(&network.path)?;
                say!(
                    "took cnibpf out of {}: restored {}",
                    network.path.display(),
                    single.display()
                );
            }
            None => {
                write_atomically(&network.path, &restored)?;
                say!("took cnibpf out of {}", network.path.display());
            }
        }
    }
    let binary = bin_dir.join(PLUGIN_NAME);
    if remove(&binary)? {
        say!("removed {}", binary.display());
    }
    Ok(())
}

/// Whether the network the runtime uses — the first file of `conf_dir` that parses, or the
/// network named `network` — chains cnibpf: `Ok(())`, or what the runtime uses instead.
pub fn chained(conf_dir: &Path, network: Option<&str>) -> Result<Result<(), String>, InstallError> {
    let networks = networks(conf_dir)?;
    let used = match network {
        Some(name) => networks
            .iter()
            .find(|file| file.value["name"].as_str() == Some(name)),
        None => networks.first(),
    };
    let Some(used) = used else {
        return Ok(Err(match network {
            Some(name) => format!("no network named {name:?} in {}", conf_dir.display()),
            None => format!("no network configuration in {}", conf_dir.display()),
        }));
    };
    Ok(if chain::chains_cnibpf(&used.value) {
        Ok(())
    } else {
        Err(format!(
            "the network the runtime uses ({}) does not chain cnibpf",
            used.path.display()
        ))
    })
}

/// A network configuration file as a runtime would read it.
struct NetworkFile {
    path: PathBuf,
    value: Value,
    form: Form,
}

impl NetworkFile {
    fn file_name(&self) -> String {
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
fn networks(dir: &Path) -> Result<Vec<NetworkFile>, InstallError> {
    let mut networks = Vec::new();
    for path in candidates(dir)? {
        if let Some((value, form)) = read_network(&path)? {
            networks.push(NetworkFile { path, value, form });
        }
    }
    Ok(networks)
}

/// The files of `dir` a runtime considers, sorted.
fn candidates(dir: &Path) -> Result<Vec<PathBuf>, InstallError> {
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
fn read_network(path: &Path) -> Result<Option<(Value, Form)>, InstallError> {
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
fn install_binary(binary: &Path, bin_dir: &Path) -> Result<bool, InstallError> {
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
fn write_atomically(path: &Path, value: &Value) -> Result<(), InstallError> {
    let mut text = serde_json::to_vec_pretty(value).map_err(|error| InstallError::Io {
        action: format!("encode {}", path.display()),
        source: error.into(),
    })?;
    text.push(b'\n');
    replace_file(path, &text, 0o644)
}

/// Puts `content` at `path` by renaming a synced temporary file of the same directory over
/// it: a reader sees the old file or the new one, whole; a process running the old one keeps
/// it.
fn replace_file(path: &Path, content: &[u8], mode: u32) -> Result<(), InstallError> {
    // fail-closed: an Option of the path, not an error.
    let directory = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        // fail-closed: an Option of the path, as above.
        .unwrap_or_default();
    let temporary = directory.join(format!(".{name}.{}.tmp", std::process::id()));
    let written = (|| {
        let mut file = fs::File::create(&temporary)?;
        file.write_all(content)?;
        file.set_permissions(fs::Permissions::from_mode(mode))?;
        file.sync_all()?;
        fs::rename(&temporary, path)?;
        fs::File::open(directory)?.sync_all()
    })();
    // fail-closed: the write's own error is the one reported; a temporary left behind is a
    // dot file, which runtimes ignore.
    if written.is_err() {
        // fail-closed: as above.
        let _ = fs::remove_file(&temporary);
    }
    written.map_err(io_error(format!("write {}", path.display())))
}

/// Removes the file at `path`; whether there was one.
fn remove(path: &Path) -> Result<bool, InstallError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(error) => Err(io_error(format!("remove {}", path.display()))(error)),
    }
}
