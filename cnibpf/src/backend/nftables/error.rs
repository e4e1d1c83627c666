//! What can go wrong in the nftables backend.

use std::path::PathBuf;

use super::compat;
use super::{COMMENT_MAX, LAYOUT, skeleton};
use crate::backend::compat::PASS_THROUGH;

#[derive(Debug, thiserror::Error)]
pub enum NftablesError {
    #[error("could not run nft")]
    Run(#[source] std::io::Error),
    #[error("nft refused the change: {0}")]
    Refused(String),
    #[error("could not read the table from nft: {0}")]
    Listing(String),
    #[error("could not encode the nft batch: {0}")]
    Encode(String),
    #[error(
        "{0} is too long for the nftables backend, which keeps owners in comments of at most {COMMENT_MAX} bytes"
    )]
    OwnerTooLong(String),
    #[error("the record in chain {chain} of the older table is unreadable")]
    Record {
        chain: String,
        #[source]
        source: compat::RecordError,
    },
    #[error("could not read or write the nftables state file {}", .path.display())]
    State {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "table inet cnibpf holds attachments whose records ({}) are missing: it adds no attachment to it, but DEL and GC remove its attachments, and once none is left it starts afresh",
        .path.display()
    )]
    StateMissing { path: PathBuf },
    #[error(
        "table inet cnibpf was made from another state (instance {table:016x}) than this instance's ({}, instance {state:016x}): another instance of cnibpf serves this network namespace, or the state file is another table's; cnibpf changes neither",
        .path.display()
    )]
    ForeignState {
        path: PathBuf,
        table: u64,
        state: u64,
    },
    #[error("a rule of chain {chain} is unreadable: {reason}")]
    Rule { chain: String, reason: String },
    #[error(
        "table inet cnibpf has a layout ({}) this cnibpf neither writes (\"{LAYOUT}\") nor migrates: it adds no attachment to it (a node on a release before the supported window upgrades through {PASS_THROUGH} first), but DEL and GC remove its attachments, and once none is left it starts afresh",
        if .found.is_empty() { "\"cnibpf layout 1\", uncommented" } else { .found.as_str() }
    )]
    Layout { found: String },
    #[error(
        "table inet cnibpf has an older layout (\"{}\") than this cnibpf's (\"{LAYOUT}\"): ADD, DEL and GC migrate it in place",
        skeleton::LAYOUT_3
    )]
    Older,
    #[error("could not ask the kernel about table inet cnibpf")]
    Netlink(#[source] std::io::Error),
    #[error(
        "the table is gone, but switching off what cnibpf switched on failed (switch it off by hand): {0}"
    )]
    Restore(String),
    #[error("could not remove the tracked connections of changed hostPorts")]
    Conntrack(#[source] std::io::Error),
    #[error("could not read how full the kernel's connection tracking table is")]
    ConntrackFill(#[source] std::io::Error),
    #[error("could not {action}")]
    HostSetting {
        action: String,
        #[source]
        source: std::io::Error,
    },
}
