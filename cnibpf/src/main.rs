//! `cnibpf`: a chained CNI plugin when run with `CNI_COMMAND` set, an admin tool otherwise.

mod backend;
mod cni;
mod code;
mod config;
#[cfg(test)]
mod fuzz;
mod inspect;
mod lock;
mod model;
mod monitor;
mod netlink;
mod netns;
mod nfnetlink;
mod paths;
mod reclaim;

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};

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
    /// Follow the packets the filter drops, one line each, until Ctrl-C.
    Monitor {
        /// The instance's pinPath.
        #[arg(long, default_value = paths::DEFAULT_PIN_PATH)]
        pin_path: PathBuf,
        /// Print one JSON object per event instead of a line of text.
        #[arg(long)]
        json: bool,
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
                eprintln!("cnibpf inspect: {error}");
                ExitCode::FAILURE
            }
        },
        AdminCommand::Gc { pin_path, stale } => match reclaim::run(&pin_path, stale) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("cnibpf gc: {error}");
                ExitCode::FAILURE
            }
        },
        AdminCommand::Monitor { pin_path, json } => match monitor::run(&pin_path, json) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("cnibpf monitor: {error}");
                ExitCode::FAILURE
            }
        },
    }
}
