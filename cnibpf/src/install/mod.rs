//! `cnibpf install` and `cnibpf uninstall`: the plugin onto a node the way CNI add-ons get
//! there from a DaemonSet — its binary into the host's CNI bin dir, and a file of its own
//! holding the network the runtime uses with cnibpf chained in, which the runtime reads in the
//! primary's place — and off again. The primary CNI's own files are never written: it may
//! rewrite them at any time (Calico's install-cni does on every start), and cnibpf's file,
//! re-rendered by `--watch`, stays first throughout.
//!
//! Runtimes read these directories while we write them (containerd reloads on every inotify
//! event), and run the binary while it is replaced. So nothing is written in place: each file
//! is written whole under a name runtimes ignore (a dot file with a `.tmp` extension), synced,
//! and renamed over the old one, which a running process keeps as it was.

mod chain;
mod events;
mod files;
mod uninstall;
mod watch;

use std::{
    fs, io,
    path::{Path, PathBuf},
    time::Duration,
};

use serde_json::{Map, Value};

pub use self::uninstall::uninstall;
use self::{
    chain::{Form, chain_in, chain_out, is_multus},
    files::{
        NetworkFile, candidates, install_binary, networks, own_file_of, read_network, remove,
        write_atomically,
    },
};
use crate::output::{log_line, say, with_causes};
use crate::{
    backend::{BackendError, purge},
    config::{NetConf, PluginConfig},
    instance::Instance,
    lock::{InstanceLock, LockError, lock_timeout},
    paths::{DEFAULT_PIN_PATH, PLUGIN_NAME, PinLayout, is_own_conflist},
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
    #[error(
        "the runtime's network is Multus's ({0}) and no cluster network follows it for cnibpf to chain into"
    )]
    MultusOnly(PathBuf),
    #[error(
        "{found}, which this build does not migrate: the cnibpf in place is left to serve the node; upgrade it through {} first (docs/upgrades.md), or drain the node (its pods' DELs drain the state) and install this build",
        crate::backend::compat::PASS_THROUGH
    )]
    UnmigratedDatapath { found: String },
    #[error("the datapath")]
    Datapath(#[from] BackendError),
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("{0}")]
    Argument(String),
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

    /// Refuses to replace the binary while the node's datapath (either backend's, at the
    /// entry's pinPath) is of a layout this build neither writes nor migrates — from a release
    /// before the supported window, or a newer one: the binary in place serves the node on,
    /// where this build would refuse every ADD (106) until the state drained. A node that
    /// cannot be asked is said so, and the install goes on (nothing is removed on it).
    pub fn refuse_unmigrated_datapath(&self) -> Result<(), InstallError> {
        let pins = self.pins();
        let ebpf = crate::backend::ebpf::EbpfBackend::unmigrated_layout(&pins).map(|found| {
            found.map(|found| format!("the eBPF state in {} has {found}", pins.root().display()))
        });
        let nftables = crate::backend::nftables::unmigrated_layout().map(|found| {
            found.map(|found| match found.as_str() {
                "" => "table inet cnibpf has layout \"cnibpf layout 1\" (no comment)".to_owned(),
                _ => format!("table inet cnibpf has layout {found:?}"),
            })
        });
        for (backend, asked) in [("eBPF", ebpf), ("nftables", nftables)] {
            match asked {
                Ok(None) => {}
                Ok(Some(found)) => return Err(InstallError::UnmigratedDatapath { found }),
                Err(error) => log_line!(
                    "cnibpf install: could not tell the layout of the {backend} datapath: {}",
                    with_causes(&error)
                ),
            }
        }
        Ok(())
    }

    /// The instance the entry names: its pinPath, or the default.
    fn pins(&self) -> PinLayout {
        PinLayout::new(
            self.entry
                .get("pinPath")
                .and_then(Value::as_str)
                // fail-closed: a value of the entry: none is the default pinPath.
                .unwrap_or(DEFAULT_PIN_PATH),
        )
    }

    /// The binary in place and cnibpf's conflist written, once.
    pub fn run(&self) -> Result<(), InstallError> {
        // What the network becomes is worked out first: a refused chain changes nothing.
        let node = self
            .read_node(false)?
            .ok_or_else(|| InstallError::NoNetwork(self.conf_dir.clone()))?;
        let chaining = self.chaining(node)?;
        self.install_binary()?;
        self.cancel_release()?;
        chaining.apply()
    }

    /// An uninstall that left the instance to be removed by its last DEL is called off: cnibpf
    /// serves the node again, and that DEL must leave it be.
    fn cancel_release(&self) -> Result<(), InstallError> {
        let pins = self.pins();
        let release = pins.release_file();
        if !release
            .try_exists()
            .map_err(io_error(format!("look for {}", release.display())))?
        {
            return Ok(());
        }
        let _lock = InstanceLock::acquire(&pins.lock_file(), lock_timeout())?;
        if purge::remove_file(&release)? {
            say!(
                "{}: the uninstall still waiting for its pods' DELs is called off",
                pins.root().display()
            );
        }
        Ok(())
    }

    /// Loads the datapath of the entry's backend and pinPath (see `crate::preload`). Reported,
    /// not fatal: otherwise the node's first ADD loads it, and answers with the cause.
    pub fn load_datapath(&self) {
        let loaded = self.entry_config().and_then(|plugin| {
            preload::run(&plugin.pin_path, plugin.backend, &plugin.capacity)
                .map_err(|error| error.to_string())
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

    /// Runs [`Self::run`], then renders cnibpf's conflist again as the primary CNI rewrites
    /// its file, and every `reclaim_every` removes the attachments of `pin_path` whose DEL never
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
        // The instance the entry names follows the host: the node's addresses as they change,
        // and the nftables tables put back when a firewall reload took them.
        let instance = self
            .entry_config()
            .map(|plugin| (PinLayout::new(plugin.pin_path), plugin.service_interfaces));
        if let Err(error) = &instance {
            log_line!(
                "cnibpf install: the entry does not parse, so the host's addresses and tables are not followed: {error}"
            );
        }
        // fail-closed: the entry's error is reported above; with no instance nothing is followed.
        let mut follow = instance.ok().map(|(pins, service_interfaces)| {
            move || {
                if let Err(error) = Instance::follow_host(&pins, &service_interfaces) {
                    log_line!("cnibpf install: following the host's addresses and tables: {error}");
                }
            }
        });
        watch::run(
            &self.conf_dir,
            reclaim,
            || match self.chain_when_readable() {
                Ok(()) => {}
                // The primary may not have written its file yet, or may be half way through.
                Err(error) => log_line!("cnibpf install: {error}"),
            },
            follow.as_mut().map(|follow| follow as &mut dyn FnMut()),
        )
    }

    /// [`Self::chaining`] and its writes, unless a file a runtime would consider before the
    /// primary network does not parse: the primary may be half way through writing it in
    /// place, and the next network is not the one to chain into.
    fn chain_when_readable(&self) -> Result<(), InstallError> {
        match self.read_node(true)? {
            Some(node) => self.chaining(node)?.apply(),
            None => Ok(()),
        }
    }

    /// The conf dir as the install sees it: its own files apart, every other network as it
    /// was before any earlier in-place install. `None` (with `wait_for_parse`) when a file
    /// before the primary network does not parse.
    fn read_node(&self, wait_for_parse: bool) -> Result<Option<Node>, InstallError> {
        let mut node = Node::default();
        let mut primary_seen = false;
        for path in candidates(&self.conf_dir)? {
            let Some((value, form)) = read_network(&path)? else {
                if wait_for_parse && !primary_seen && !is_own_conflist(&path) {
                    log_line!("cnibpf install: waiting for {} to parse", path.display());
                    return Ok(None);
                }
                continue;
            };
            if is_own_conflist(&path) {
                node.own.push(NetworkFile { path, value, form });
                continue;
            }
            let network = match chain_out(&value) {
                Some((restored, converted_from)) => {
                    let source = match &converted_from {
                        Some(file_name) => self.conf_dir.join(file_name),
                        None => path.clone(),
                    };
                    let restored_form = if converted_from.is_some() {
                        Form::Single
                    } else {
                        Form::List
                    };
                    node.in_place.push(InPlace {
                        chained: path,
                        restored: restored.clone(),
                        source: source.clone(),
                    });
                    NetworkFile {
                        path: source,
                        value: restored,
                        form: restored_form,
                    }
                }
                None => NetworkFile { path, value, form },
            };
            primary_seen |= match &self.network {
                Some(name) => network.value["name"].as_str() == Some(name),
                None => !is_multus(&network.value),
            };
            node.networks.push(network);
        }
        Ok(Some(node))
    }

    /// cnibpf's own file for the network to chain into (the one named, or the one the runtime
    /// uses — the cluster network when that is Multus), not yet written.
    fn chaining(&self, node: Node) -> Result<Chaining, InstallError> {
        let Node {
            networks,
            own,
            in_place,
        } = node;
        let mut notes = Vec::new();
        let primary = match &self.network {
            Some(name) => networks
                .into_iter()
                .find(|network| network.value["name"].as_str() == Some(name))
                .ok_or_else(|| InstallError::NoSuchNetwork {
                    name: name.clone(),
                    dir: self.conf_dir.clone(),
                })?,
            None => {
                let mut networks = networks.into_iter().peekable();
                let multus = networks
                    .next_if(|network| is_multus(&network.value))
                    .map(|network| network.path);
                let primary = networks
                    .find(|network| !is_multus(&network.value))
                    .ok_or_else(|| match &multus {
                        Some(multus) => InstallError::MultusOnly(multus.clone()),
                        None => InstallError::NoNetwork(self.conf_dir.clone()),
                    })?;
                if let Some(multus) = multus {
                    notes.push(format!(
                        "the runtime's network is Multus's ({}): cnibpf is chained into the cluster network it delegates to, which Multus reads from the first file after its own once it regenerates its configuration",
                        multus.display()
                    ));
                }
                primary
            }
        };
        let chained = chain_in(
            &primary.value,
            primary.form,
            &primary.file_name(),
            &self.entry,
            self.replace_portmap,
        )?;
        notes.extend(chained.notes);
        let own_path = own_file_of(&primary.path);
        let current = own
            .iter()
            .find(|file| file.path == own_path)
            .map(|file| file.value.clone());
        let stale = own
            .into_iter()
            .map(|file| file.path)
            .filter(|path| *path != own_path)
            .collect();
        Ok(Chaining {
            source: primary.path,
            own: own_path,
            conflist: chained.conflist,
            current,
            notes,
            in_place,
            stale,
        })
    }
}

/// A conf dir as the install sees it.
#[derive(Default)]
struct Node {
    /// Every network but cnibpf's own files, in the runtime's order, as it was before an
    /// earlier in-place install.
    networks: Vec<NetworkFile>,
    /// cnibpf's own files.
    own: Vec<NetworkFile>,
    /// Networks an earlier release chained cnibpf into in place.
    in_place: Vec<InPlace>,
}

/// A network an earlier release chained cnibpf into in place, and what it was.
struct InPlace {
    /// The file holding the chain.
    chained: PathBuf,
    restored: Value,
    /// Where the restored network goes: the chain's file, or the single-plugin file it was
    /// converted from.
    source: PathBuf,
}

/// cnibpf's own file, to be written.
struct Chaining {
    /// The primary network's file.
    source: PathBuf,
    own: PathBuf,
    conflist: Value,
    /// The own file as it is, if there is one.
    current: Option<Value>,
    notes: Vec<String>,
    in_place: Vec<InPlace>,
    /// Own files of another network (the primary changed), removed once the new one is there.
    stale: Vec<PathBuf>,
}

impl Chaining {
    /// Writes cnibpf's own file when that changes it, then takes cnibpf out of networks an
    /// earlier release chained it into and removes own files of other networks: the runtime
    /// finds the own file first throughout.
    fn apply(self) -> Result<(), InstallError> {
        if self.current.as_ref() != Some(&self.conflist) {
            // Said with each write, not at each look of `--watch`.
            for note in &self.notes {
                log_line!("cnibpf install: note: {note}");
            }
            write_atomically(&self.own, &self.conflist)?;
            // fail-closed: a value of the conflist, for the message.
            let network_name = self.conflist["name"].as_str().unwrap_or_default();
            say!(
                "chained cnibpf into network {network_name:?} of {}: wrote {}",
                self.source.display(),
                self.own.display()
            );
        }
        for in_place in self.in_place {
            write_atomically(&in_place.source, &in_place.restored)?;
            if in_place.chained != in_place.source {
                remove(&in_place.chained)?;
            }
            say!(
                "took cnibpf out of {} (an earlier install's chain in place): restored {}",
                in_place.chained.display(),
                in_place.source.display()
            );
        }
        for stale in self.stale {
            if remove(&stale)? {
                say!(
                    "removed {}: its network is no longer the one chained",
                    stale.display()
                );
            }
        }
        Ok(())
    }
}

/// Whether the network the runtime uses — the first file of `conf_dir` that parses, or the
/// network named `network` — chains cnibpf: `Ok(())`, or what the runtime uses instead. When
/// that is Multus, its cluster network is looked at: inline (thin), or the first file after
/// Multus's own, which Multus reads (thick).
pub fn chained(conf_dir: &Path, network: Option<&str>) -> Result<Result<(), String>, InstallError> {
    let networks = networks(conf_dir)?;
    let used = match network {
        Some(name) => networks
            .iter()
            .position(|file| file.value["name"].as_str() == Some(name)),
        None => (!networks.is_empty()).then_some(0),
    };
    let Some(used) = used else {
        return Ok(Err(match network {
            Some(name) => format!("no network named {name:?} in {}", conf_dir.display()),
            None => format!("no network configuration in {}", conf_dir.display()),
        }));
    };
    let file = &networks[used];
    if chain::chains_cnibpf(&file.value) {
        return Ok(Ok(()));
    }
    if is_multus(&file.value) {
        let cluster = match chain::multus_delegate_chains_cnibpf(&file.value) {
            Some(inline) => inline,
            None => networks[used + 1..]
                .iter()
                .find(|next| !is_multus(&next.value))
                .is_some_and(|next| chain::chains_cnibpf(&next.value)),
        };
        return Ok(if cluster {
            Ok(())
        } else {
            Err(format!(
                "the cluster network Multus ({}) delegates to does not chain cnibpf (Multus regenerates its configuration from the first file after its own)",
                file.path.display()
            ))
        });
    }
    Ok(Err(format!(
        "the network the runtime uses ({}) does not chain cnibpf",
        file.path.display()
    )))
}
