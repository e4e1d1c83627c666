//! `cnibpf`: a chained CNI plugin when run with `CNI_COMMAND` set, an admin tool otherwise.

mod atomic_file;
mod backend;
mod call_log;
mod call_stats;
mod cni;
mod code;
mod config;
#[cfg(test)]
mod fuzz;
mod inspect;
mod install;
mod instance;
mod journal;
mod live_filter;
mod lock;
mod metrics;
mod model;
mod monitor;
mod netlink;
mod netns;
mod nfnetlink;
mod output;
mod paths;
mod phases;
mod preload;
mod reclaim;

use std::{
    net::SocketAddr,
    path::PathBuf,
    process::ExitCode,
    sync::{LazyLock, Mutex},
    time::Duration,
};

use clap::{Parser, Subcommand};

use crate::{
    model::UnknownWord,
    output::{log_line, say, with_causes},
};

/// `cnibpf --version`: the release, the commit it was built from, and the layouts of the
/// state it writes (what an upgrade or a downgrade crosses, see CHANGELOG.md).
static VERSION: LazyLock<String> = LazyLock::new(|| {
    format!(
        "{} (commit {}; eBPF state layout {}, nftables {})",
        env!("CARGO_PKG_VERSION"),
        env!("CNIBPF_COMMIT"),
        cnibpf_common::datapath::layout::stamped(),
        backend::nftables::TABLE_LAYOUT,
    )
});

/// The eBPF datapath's map sizes (see docs/kubernetes.md, "Memory"); a size not given keeps
/// what is loaded, the default for a datapath created new.
#[derive(Debug, clap::Args)]
struct CapacityArgs {
    /// Connections each connection table tracks (`maxFlows`).
    #[arg(long)]
    max_flows: Option<u64>,
    /// Attachments (pod interfaces) on the node (`maxAttachments`).
    #[arg(long)]
    max_attachments: Option<u64>,
    /// Port mappings of all pods together (`maxHostPorts`).
    #[arg(long)]
    max_host_ports: Option<u64>,
}

impl CapacityArgs {
    fn checked(&self) -> Result<model::Capacity, String> {
        model::Capacity::parse(self.max_flows, self.max_attachments, self.max_host_ports)
            .map_err(|(dimension, reason)| format!("--{}: {reason}", dimension.flag()))
    }
}

#[derive(Debug, Parser)]
#[command(
    version = VERSION.as_str(),
    about = "eBPF masquerade, port mapping and filter rules for containers (CNI plugin)"
)]
struct Cli {
    #[command(subcommand)]
    command: AdminCommand,
}

#[derive(Debug, Subcommand)]
enum AdminCommand {
    /// Show the attachments and port mappings of an instance.
    Inspect {
        /// The instance's pinPath.
        #[arg(long, default_value = paths::DEFAULT_PIN_PATH)]
        pin_path: PathBuf,
        /// Print JSON for scripts instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Remove expired connection state, and with --stale every attachment whose host
    /// interface is gone (its DEL never came); for runtimes that never call CNI GC.
    Gc {
        /// The instance's pinPath.
        #[arg(long, default_value = paths::DEFAULT_PIN_PATH)]
        pin_path: PathBuf,
        /// Also remove attachments whose host interface no longer exists.
        #[arg(long)]
        stale: bool,
    },
    /// Install the plugin on this node: its binary into the CNI bin dir, and a conflist of its
    /// own, `<primary>.cnibpf.conflist`, holding the network the runtime uses with cnibpf
    /// chained in, which the runtime reads in its place (written atomically; the primary's
    /// files never written).
    Install(InstallArgs),
    /// Serve Prometheus metrics, /healthz and /readyz over HTTP until SIGTERM: the datapath's
    /// state and counters and the plugin's calls, read at each scrape.
    Metrics {
        /// Where to listen, e.g. 127.0.0.1:9965 or [::]:9965.
        #[arg(long)]
        listen: SocketAddr,
        /// The instance's pinPath.
        #[arg(long, default_value = paths::DEFAULT_PIN_PATH)]
        pin_path: PathBuf,
        /// The backend the network's entry names, for /readyz.
        #[arg(long, default_value = "auto")]
        backend: String,
        /// Where /readyz looks for cnibpf chained into the runtime's network.
        #[arg(long, default_value = paths::CNI_CONF_DIR)]
        conf_dir: PathBuf,
        /// Where /readyz looks for this build's binary.
        #[arg(long, default_value = paths::CNI_BIN_DIR)]
        bin_dir: PathBuf,
        /// The network cnibpf must be chained into (default: the one the runtime uses).
        #[arg(long)]
        network: Option<String>,
    },
    /// Take the plugin off this node: the runtime reads the primary's files again. With no pod
    /// cnibpf set up left, its conflists, datapath, files and binary go now; otherwise its
    /// conflist keeps it in release-only mode (new pods are the restored network's, the old
    /// pods' DELs reach cnibpf) and the last DEL removes everything. Run it with the host's
    /// paths: the conflist names the files that DEL removes.
    Uninstall {
        #[arg(long, default_value = paths::CNI_CONF_DIR)]
        conf_dir: PathBuf,
        #[arg(long, default_value = paths::CNI_BIN_DIR)]
        bin_dir: PathBuf,
        /// Remove everything now, the running pods' hostPorts, masquerade and filters too,
        /// and list what was removed.
        #[arg(long)]
        purge: bool,
    },
    /// Load the datapath now (the kernel verifies the eBPF programs), so that the first pod's
    /// ADD does not wait for it; run it in the host's network namespace, at node set-up.
    Load {
        /// The instance's pinPath.
        #[arg(long, default_value = paths::DEFAULT_PIN_PATH)]
        pin_path: PathBuf,
        /// The backend, as the network's `backend` key names it.
        #[arg(long, default_value = "auto")]
        backend: String,
        #[command(flatten)]
        capacity: CapacityArgs,
    },
    /// Take the datapath and the instance's files off the node (`load`'s counterpart; the
    /// last pod's DEL leaves them for the next pod). Refused while any attachment uses them.
    Unload {
        /// The instance's pinPath.
        #[arg(long, default_value = paths::DEFAULT_PIN_PATH)]
        pin_path: PathBuf,
    },
    /// Mount a bpffs where the datapath pins its state, unless one is mounted there: the
    /// DaemonSet's init container does, with the mount propagated to the host.
    MountBpffs {
        #[arg(long, default_value = paths::BPFFS_MOUNT_POINT)]
        path: PathBuf,
    },
    /// The filter rules of running attachments.
    Filter {
        #[command(subcommand)]
        command: FilterCommand,
    },
    /// Follow the packets the eBPF datapath drops, one line each, until Ctrl-C: those the
    /// attachments' filters and source checks drop, or with --drops every one.
    Monitor {
        /// The instance's pinPath.
        #[arg(long, default_value = paths::DEFAULT_PIN_PATH)]
        pin_path: PathBuf,
        /// Print one JSON object per event instead of a line of text.
        #[arg(long)]
        json: bool,
        /// Every dropped packet, whatever the reason (masquerade out of ports, a failed
        /// rewrite, …), not only the attachments' policy.
        #[arg(long, conflicts_with = "matches")]
        drops: bool,
        /// The new connections filter rules with `"log": true` decided, whatever their
        /// verdict, instead of drops.
        #[arg(long)]
        matches: bool,
    },
}

#[derive(Debug, Subcommand)]
enum FilterCommand {
    /// Print the rules in effect as JSON: with --container, its rule list in the
    /// configuration's shape (each rule with `"action": "insert"`); else every attachment of
    /// the network with its rules and default.
    Show {
        /// The instance's pinPath.
        #[arg(long, default_value = paths::DEFAULT_PIN_PATH)]
        pin_path: PathBuf,
        #[command(flatten)]
        selection: SelectionArgs,
    },
    /// Change the rules of running attachments: reads a JSON list of rules from stdin, each
    /// with "action" insert (at its index), append (after the last rule) or delete (the rule
    /// at its index), and applies the list to each attachment it reaches, all of it or none;
    /// one line per attachment says what changed. Exit status 0 only when every one took it.
    Apply {
        /// The instance's pinPath.
        #[arg(long, default_value = paths::DEFAULT_PIN_PATH)]
        pin_path: PathBuf,
        #[command(flatten)]
        selection: SelectionArgs,
    },
}

/// Which attachments a `filter` command reaches.
#[derive(Debug, clap::Args)]
struct SelectionArgs {
    /// The network's name, as its configuration's `name`.
    #[arg(long)]
    network: String,
    /// Only this container's attachments (CNI_CONTAINERID).
    #[arg(long)]
    container: Option<String>,
    /// Only its attachment on this interface (CNI_IFNAME); needs --container.
    #[arg(long, requires = "container")]
    ifname: Option<String>,
}

impl From<SelectionArgs> for live_filter::Selection {
    fn from(args: SelectionArgs) -> Self {
        Self {
            network: args.network,
            container: args.container,
            ifname: args.ifname,
        }
    }
}

/// `cnibpf filter apply`: the changes on stdin, a line for each attachment.
fn filter_apply(
    pin_path: &std::path::Path,
    selection: live_filter::Selection,
) -> Result<(), String> {
    let mut input = Vec::new();
    std::io::Read::read_to_end(&mut std::io::stdin(), &mut input)
        .map_err(|error| format!("could not read the rules from stdin: {error}"))?;
    let applied =
        live_filter::apply(pin_path, &selection, &input).map_err(|error| with_causes(&error))?;
    let mut refused = 0;
    for one in &applied {
        let line = match &one.outcome {
            Ok(done) => format!("{}: {done}", one.attachment),
            Err(reason) => {
                refused += 1;
                format!("{}: unchanged: {reason}", one.attachment)
            }
        };
        output::write_line(std::io::stdout(), &line)
            .map_err(|error| format!("could not write to stdout: {error}"))?;
    }
    if refused > 0 {
        return Err(format!(
            "{refused} of {} attachments did not take the change",
            applied.len()
        ));
    }
    Ok(())
}

/// `cnibpf install`'s flags.
#[derive(Debug, clap::Args)]
struct InstallArgs {
    #[arg(long, default_value = paths::CNI_CONF_DIR)]
    conf_dir: PathBuf,
    #[arg(long, default_value = paths::CNI_BIN_DIR)]
    bin_dir: PathBuf,
    /// Chain into the network of this name instead of the one the runtime uses (the
    /// first file of the conf dir, by name, that parses; the cluster network after it
    /// when that is Multus).
    #[arg(long)]
    network: Option<String>,
    /// A JSON file holding cnibpf's keys for its entry (the portMappings capability is
    /// added when it names no capabilities).
    #[arg(long)]
    entry: Option<PathBuf>,
    /// Put cnibpf in the place of the reference portmap plugin instead of refusing.
    #[arg(long)]
    replace_portmap: bool,
    /// Keep running: render cnibpf's conflist again whenever the conf dir changes (the
    /// primary rewrote its file, another network became the first), until SIGTERM.
    #[arg(long)]
    watch: bool,
    /// With --watch: every so often (e.g. "5m"), remove the attachments whose host
    /// interface is gone, as `cnibpf gc --stale` does.
    #[arg(long, value_parser = humantime::parse_duration, requires = "watch")]
    reclaim_every: Option<Duration>,
    /// The pinPath --reclaim-every works on.
    #[arg(long, default_value = paths::DEFAULT_PIN_PATH)]
    pin_path: PathBuf,
    /// Also load the datapath of the entry's backend and pinPath first, as `cnibpf load`
    /// does, so that the node's first pod does not wait for it.
    #[arg(long)]
    load: bool,
    /// With --watch: serve /metrics, /healthz and /readyz on this address (as
    /// `cnibpf metrics` does) for the entry's pinPath and backend.
    #[arg(long, requires = "watch")]
    listen: Option<SocketAddr>,
    /// Written into cnibpf's entry (over the entry file's keys), and used by --load.
    #[command(flatten)]
    capacity: CapacityArgs,
}

/// The metrics endpoint of `install --watch --listen`, for the entry's pinPath and backend.
fn serve_beside(
    install: &install::Install,
    address: SocketAddr,
) -> Result<(), install::InstallError> {
    let plugin = install
        .entry_config()
        .map_err(|reason| install::InstallError::Entry {
            path: PathBuf::from("--entry"),
            reason,
        })?;
    metrics::serve_in_background(
        address,
        metrics::Exporter {
            pins: paths::PinLayout::new(&plugin.pin_path),
            conf_dir: install.conf_dir.clone(),
            bin_dir: install.bin_dir.clone(),
            network: install.network.clone(),
            backend: plugin.backend,
            binary_check: Mutex::default(),
        },
    )
    .map_err(|error| install::InstallError::Io {
        action: format!("serve the metrics endpoint on {address}"),
        source: std::io::Error::other(with_causes(&error)),
    })
}

fn main() -> ExitCode {
    if let Ok(command) = std::env::var("CNI_COMMAND") {
        return ExitCode::from(u8::try_from(cni::run(&command)).unwrap_or(1));
    }
    let command = Cli::parse().command;
    let name = command.name();
    match run(command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            log_line!("cnibpf {name}: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Runs an admin command: what failed, with its causes.
fn run(command: AdminCommand) -> Result<(), String> {
    let causes = |error: &dyn std::error::Error| with_causes(error);
    match command {
        AdminCommand::Inspect { pin_path, json } => {
            inspect::run(&pin_path, json).map_err(|error| causes(&error))
        }
        AdminCommand::Gc { pin_path, stale } => {
            reclaim::run(&pin_path, stale).map_err(|error| causes(&error))
        }
        AdminCommand::Install(args) => install_command(args).map_err(|error| causes(&error)),
        AdminCommand::Uninstall {
            conf_dir,
            bin_dir,
            purge,
        } => install::uninstall(&conf_dir, &bin_dir, purge).map_err(|error| causes(&error)),
        AdminCommand::Load {
            pin_path,
            backend,
            capacity,
        } => {
            let choice = parse_backend(&backend)?;
            let capacity = capacity.checked()?;
            let done =
                preload::run(&pin_path, choice, &capacity).map_err(|error| causes(&error))?;
            say!("{done}");
            Ok(())
        }
        AdminCommand::Unload { pin_path } => {
            let done = preload::unload(&pin_path).map_err(|error| causes(&error))?;
            say!("{done}");
            Ok(())
        }
        AdminCommand::MountBpffs { path } => {
            if backend::ebpf::mount_bpffs(&path).map_err(|error| causes(&error))? {
                say!("mounted bpffs on {}", path.display());
            } else {
                say!("{} is a bpffs already", path.display());
            }
            Ok(())
        }
        AdminCommand::Metrics {
            listen,
            pin_path,
            backend,
            conf_dir,
            bin_dir,
            network,
        } => {
            let exporter = metrics::Exporter {
                pins: paths::PinLayout::new(pin_path),
                conf_dir,
                bin_dir,
                network,
                backend: parse_backend(&backend)?,
                binary_check: Mutex::default(),
            };
            metrics::serve(listen, exporter).map_err(|error| causes(&error))
        }
        AdminCommand::Filter {
            command:
                FilterCommand::Show {
                    pin_path,
                    selection,
                },
        } => {
            let shown =
                live_filter::show(&pin_path, &selection.into()).map_err(|error| causes(&error))?;
            output::write_line(std::io::stdout(), &format!("{shown:#}"))
                .map_err(|error| format!("could not write the rules to stdout: {error}"))
        }
        AdminCommand::Filter {
            command:
                FilterCommand::Apply {
                    pin_path,
                    selection,
                },
        } => filter_apply(&pin_path, selection.into()),
        AdminCommand::Monitor {
            pin_path,
            json,
            drops,
            matches,
        } => {
            let shown = if matches {
                monitor::Shown::Matches
            } else if drops {
                monitor::Shown::Every
            } else {
                monitor::Shown::Policy
            };
            monitor::run(&pin_path, json, shown).map_err(|error| causes(&error))
        }
    }
}

/// `--backend`'s word.
fn parse_backend(word: &str) -> Result<model::BackendChoice, String> {
    word.parse().map_err(|error: UnknownWord| {
        format!("--backend: expected {}, got {word:?}", error.expected)
    })
}

/// `cnibpf install`: the entry with the capacity flags in it, the node checked, the datapath
/// loaded if asked, then the binary and conflist installed once or watched.
fn install_command(args: InstallArgs) -> Result<(), install::InstallError> {
    let InstallArgs {
        conf_dir,
        bin_dir,
        network,
        entry,
        replace_portmap,
        watch,
        reclaim_every,
        pin_path,
        load,
        listen,
        capacity,
    } = args;
    let mut entry = install::Install::entry_from(entry.as_deref())?;
    for (key, size) in capacity
        .checked()
        .map_err(install::InstallError::Argument)?
        .keys()
    {
        entry.insert(key.to_owned(), size.into());
    }
    let install = install::Install {
        conf_dir,
        bin_dir,
        network,
        entry,
        replace_portmap,
    };
    install.refuse_unmigrated_datapath()?;
    if load {
        install.load_datapath();
    }
    if !watch {
        return install.run();
    }
    install.run_and_watch(reclaim_every.map(|period| (period, pin_path)), || {
        listen.map_or(Ok(()), |address| serve_beside(&install, address))
    })
}

impl AdminCommand {
    /// The command's name, as its messages start.
    fn name(&self) -> &'static str {
        match self {
            Self::Inspect { .. } => "inspect",
            Self::Gc { .. } => "gc",
            Self::Install(_) => "install",
            Self::Uninstall { .. } => "uninstall",
            Self::Load { .. } => "load",
            Self::Unload { .. } => "unload",
            Self::MountBpffs { .. } => "mount-bpffs",
            Self::Metrics { .. } => "metrics",
            Self::Monitor { .. } => "monitor",
            Self::Filter { .. } => "filter",
        }
    }
}
