//! What can go wrong in the nftables backend.

use super::{COMMENT_MAX, LAYOUT, migrate, record};

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
    #[error("the record of {owner} in chain {chain} is unreadable")]
    Record {
        owner: String,
        chain: String,
        #[source]
        source: record::RecordError,
    },
    #[error("a rule of chain {chain} is unreadable: {reason}")]
    Rule { chain: String, reason: String },
    #[error(
        "table inet cnibpf has another layout ({}) than this cnibpf writes (\"{LAYOUT}\"): it adds no attachment to it, but DEL and GC remove its attachments, and once none is left it starts afresh",
        if .found.is_empty() { "\"cnibpf layout 1\", uncommented" } else { .found.as_str() }
    )]
    Layout { found: String },
    #[error(
        "table inet cnibpf has layout \"{}\", older than this cnibpf's (\"{LAYOUT}\"): ADD, DEL and GC migrate it in place",
        migrate::PREVIOUS
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
