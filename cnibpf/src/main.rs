//! `cnibpf`: a chained CNI plugin when run with `CNI_COMMAND` set, an admin tool otherwise.

mod backend;
mod cni;
mod code;
mod config;
#[cfg(test)]
mod fuzz;
mod inspect;
mod install;
mod lock;
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

use std::{path::PathBuf, process::ExitCode, time::Duration};

use clap::{Parser, Subcommand};

use crate::{
    model::UnknownWord,
    output::{log_line, say},
};

#[derive(Debug, Parser)]
#[command(
    version,
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
    /// Install the plugin on this node: its binary into the CNI bin dir, its entry into the
    /// network the runtime uses (written atomically, once; everything else kept).
    Install {
        #[arg(long, default_value = paths::CNI_CONF_DIR)]
        conf_dir: PathBuf,
        #[arg(long, default_value = paths::CNI_BIN_DIR)]
        bin_dir: PathBuf,
        /// Chain into the network of this name instead of the one the runtime uses (the
        /// first file of the conf dir, by name, that parses).
        #[arg(long)]
        network: Option<String>,
        /// A JSON file holding cnibpf's keys for its entry (the portMappings capability is
        /// added when it names no capabilities).
        #[arg(long)]
        entry: Option<PathBuf>,
        /// Put cnibpf in the place of the reference portmap plugin instead of refusing.
        #[arg(long)]
        replace_portmap: bool,
        /// Keep running: chain the entry in again whenever the conf dir changes, until SIGTERM.
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
    },
    /// Take the plugin off this node: its entry out of every network (a portmap it replaced
    /// put back), its binary out of the bin dir. Running pods keep their datapath until their
    /// DEL.
    Uninstall {
        #[arg(long, default_value = paths::CNI_CONF_DIR)]
        conf_dir: PathBuf,
        #[arg(long, default_value = paths::CNI_BIN_DIR)]
        bin_dir: PathBuf,
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
        #[arg(long)]
        drops: bool,
    },
}

fn main() -> ExitCode {
    if let Ok(command) = std::env::var("CNI_COMMAND") {
        return ExitCode::from(u8::try_from(cni::run(&command)).unwrap_or(1));
    }
    match Cli::parse().command {
        AdminCommand::Inspect { pin_path, json } => match inspect::run(&pin_path, json) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                log_line!("cnibpf inspect: {error}");
                ExitCode::FAILURE
            }
        },
        AdminCommand::Gc { pin_path, stale } => match reclaim::run(&pin_path, stale) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                log_line!("cnibpf gc: {error}");
                ExitCode::FAILURE
            }
        },
        AdminCommand::Install {
            conf_dir,
            bin_dir,
            network,
            entry,
            replace_portmap,
            watch,
            reclaim_every,
            pin_path,
            load,
        } => {
            let installed = install::Install::entry_from(entry.as_deref()).and_then(|entry| {
                let install = install::Install {
                    conf_dir,
                    bin_dir,
                    network,
                    entry,
                    replace_portmap,
                };
                if load {
                    install.load_datapath();
                }
                if watch {
                    install.run_and_watch(reclaim_every.map(|period| (period, pin_path)))
                } else {
                    install.run()
                }
            });
            match installed {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    log_line!("cnibpf install: {error}");
                    ExitCode::FAILURE
                }
            }
        }
        AdminCommand::Uninstall { conf_dir, bin_dir } => {
            match install::uninstall(&conf_dir, &bin_dir) {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    log_line!("cnibpf uninstall: {error}");
                    ExitCode::FAILURE
                }
            }
        }
        AdminCommand::Load { pin_path, backend } => {
            let loaded = backend
                .parse()
                .map_err(|error: UnknownWord| {
                    format!("--backend: expected {}, got {backend:?}", error.expected)
                })
                .and_then(|choice| {
                    preload::run(&pin_path, choice).map_err(|error| error.to_string())
                });
            match loaded {
                Ok(done) => {
                    say!("{done}");
                    ExitCode::SUCCESS
                }
                Err(error) => {
                    log_line!("cnibpf load: {error}");
                    ExitCode::FAILURE
                }
            }
        }
        AdminCommand::Monitor {
            pin_path,
            json,
            drops,
        } => match monitor::run(
            &pin_path,
            json,
            if drops {
                monitor::Shown::Every
            } else {
                monitor::Shown::Policy
            },
        ) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                log_line!("cnibpf monitor: {error}");
                ExitCode::FAILURE
            }
        },
    }
}
