//! What can go wrong in a backend, and the CNI code each failure reports.

use std::path::PathBuf;

use super::nftables;
use crate::{
    code,
    model::{Attachment, Pod},
};

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("backend {backend} cannot work on this host: {reason}")]
    Unavailable {
        backend: &'static str,
        reason: String,
    },
    /// Whether the backend works could not be asked (a transient failure, not a refusal).
    #[error("could not tell whether backend {backend} works on this host: {reason}")]
    ProbeFailed {
        backend: &'static str,
        reason: String,
    },
    #[error("could not prepare bpffs directory {path}")]
    Bpffs {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A pinned object or an instance file that could not be removed.
    #[error("could not remove {path}")]
    Unpin {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("could not load the eBPF object")]
    Load(#[source] Box<aya::EbpfError>),
    #[error("{action}")]
    Program {
        action: String,
        #[source]
        source: Box<aya::programs::ProgramError>,
    },
    #[error("{action}")]
    Map {
        action: String,
        #[source]
        source: Box<aya::maps::MapError>,
    },
    #[error("could not read map {name}")]
    MapRead {
        name: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("could not write map {name}")]
    MapWrite {
        name: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{action}")]
    Pin {
        action: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error(
        "the pinned state in {path} has {found}, older than this cnibpf's {} and than the releases it upgrades from: it adds no attachment to it (upgrade through {} first), but DEL and GC release them, and once none is left it starts afresh",
        found.ours(),
        crate::backend::compat::PASS_THROUGH
    )]
    OlderState {
        path: PathBuf,
        found: crate::backend::ebpf::Found,
    },
    #[error(
        "the pinned state in {path} has {found}, written by a newer cnibpf (this one writes {}): it adds no attachment to it, but DEL and GC release them, and once none is left it starts afresh",
        found.ours()
    )]
    NewerState {
        path: PathBuf,
        found: crate::backend::ebpf::Found,
    },
    #[error(
        "the pinned maps {maps} in {path} are of an older version: the next CNI call or `cnibpf load` migrates them"
    )]
    MapsToMigrate { path: PathBuf, maps: String },
    #[error("its record is missing from map owners")]
    NotRecorded,
    /// The instance's release file (`cnibpf uninstall`'s) holds something cnibpf cannot read.
    #[error("{path} is not a release file cnibpf uninstall wrote")]
    ForeignReleaseFile { path: PathBuf },
    #[error(
        "the datapath in {path} still serves {count} attachment(s): their DELs go first, or `cnibpf uninstall --purge` removes them with it"
    )]
    StillServing { path: PathBuf, count: usize },
    #[error("{path} holds no cnibpf state ({reason}); choose another pinPath")]
    ForeignState { path: PathBuf, reason: String },
    /// The eBPF datapath under `path` was set up for, and still serves, another network
    /// namespace than the caller's (see `ebpf::namespace`).
    #[error(
        "the eBPF datapath in {path} serves another network namespace (cookie {datapath}) than this call's (cookie {caller}), whose interfaces it hooks ({hooked}): each host needs a pinPath of its own, and a datapath is unloaded from the namespace it serves"
    )]
    OtherNamespace {
        path: PathBuf,
        datapath: u64,
        caller: u64,
        hooked: String,
    },
    #[error("could not read the pinned state in {path}{}", permission_hint(source))]
    UnreadableState {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("owner id {owner:016x} of {attachment} is already used by {holder}")]
    OwnerCollision {
        owner: u64,
        attachment: Box<Attachment>,
        holder: Box<Attachment>,
    },
    #[error("{mapping} is already held by {holder}{}", pod.as_ref().map(|pod| format!(" (pod {pod})")).unwrap_or_default())]
    HostPortInUse {
        mapping: String,
        holder: Box<Attachment>,
        pod: Option<Pod>,
    },
    #[error("check failed: {0}")]
    CheckFailed(String),
    /// Two network names with one id (64-bit FNV-1a): a rule naming either would match both.
    #[error(
        "network {network:?} has the id of network {holder:?} (64-bit FNV-1a of the names): a rule naming one would match the other's pods; rename one"
    )]
    NetworkIdTaken { network: String, holder: String },
    #[error(
        "container {container_id} has more addresses over its attachments than a source check holds ({admitted}; at most {} of a family): set sourceCheck to false for it",
        cnibpf_common::sources::MAX_ADDRESSES
    )]
    TooManySources {
        container_id: String,
        admitted: String,
    },
    #[error(
        "{key} {size} is too small for what the datapath holds now: map {map} would have {entries} entries and holds {held}; resize when fewer are live, or leave {key} out to keep the sizes loaded"
    )]
    CapacityTooSmall {
        key: &'static str,
        size: u32,
        map: &'static str,
        held: usize,
        entries: u32,
    },
    #[error("could not list the host's addresses")]
    HostAddresses(#[source] Box<crate::netlink::NetlinkError>),
    /// A question about an interface the kernel answered with an error (not "no such
    /// interface", which means gone).
    #[error("{action}")]
    Interface {
        action: String,
        #[source]
        source: Box<crate::netlink::NetlinkError>,
    },
    #[error(transparent)]
    Nftables(#[from] nftables::NftablesError),
    /// Several steps of one operation failed; each ran regardless.
    #[error("{}", describe_failures(.0))]
    Several(Vec<(&'static str, BackendError)>),
    /// An ADD failed, and undoing what it had done failed too.
    #[error("{}; undoing the ADD failed too: {}", with_causes(.failed), with_causes(.undo))]
    UndoFailed {
        failed: Box<BackendError>,
        undo: Box<BackendError>,
    },
}

impl BackendError {
    pub fn code(&self) -> u32 {
        match self {
            Self::Unavailable { .. } => code::BACKEND_UNAVAILABLE,
            Self::ProbeFailed { .. } => code::TRY_AGAIN,
            Self::OlderState { .. }
            | Self::NewerState { .. }
            | Self::ForeignState { .. }
            | Self::OtherNamespace { .. }
            | Self::MapsToMigrate { .. }
            | Self::StillServing { .. } => code::INCOMPATIBLE_STATE,
            Self::UnreadableState { .. } | Self::ForeignReleaseFile { .. } => code::DATAPATH,
            Self::HostPortInUse { .. } => code::HOST_PORT_IN_USE,
            Self::CheckFailed(_) => code::CHECK_FAILED,
            Self::TooManySources { .. }
            | Self::CapacityTooSmall { .. }
            | Self::NetworkIdTaken { .. } => code::INVALID_CONFIG,
            Self::Bpffs { .. }
            | Self::Unpin { .. }
            | Self::Load(_)
            | Self::Program { .. }
            | Self::Map { .. }
            | Self::MapRead { .. }
            | Self::MapWrite { .. }
            | Self::Pin { .. }
            | Self::NotRecorded
            | Self::OwnerCollision { .. } => code::DATAPATH,
            Self::HostAddresses(_) | Self::Interface { .. } => code::INTERFACE,
            Self::Nftables(
                nftables::NftablesError::Layout { .. }
                | nftables::NftablesError::Older
                | nftables::NftablesError::StateMissing { .. }
                | nftables::NftablesError::ForeignState { .. },
            ) => code::INCOMPATIBLE_STATE,
            Self::Nftables(_) => code::DATAPATH,
            Self::Several(failures) => failures
                .first()
                .map_or(code::DATAPATH, |(_, error)| error.code()),
            Self::UndoFailed { failed, .. } => failed.code(),
        }
    }

    /// The outcome of steps that all ran: success, the one failure, or every failure named
    /// by its step.
    pub fn collect(mut failures: Vec<(&'static str, BackendError)>) -> Result<(), BackendError> {
        match failures.len() {
            0 => Ok(()),
            1 => Err(failures.remove(0).1),
            _ => Err(Self::Several(failures)),
        }
    }
}

/// What to do about an error that is only a lack of privilege.
fn permission_hint(error: &std::io::Error) -> &'static str {
    match error.raw_os_error() {
        Some(libc::EACCES | libc::EPERM) => " (permission denied: run as root)",
        _ => "",
    }
}

/// An error with its causes, as one line (for errors that carry several).
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(inner) = cause {
        text = format!("{text}: {inner}");
        cause = inner.source();
    }
    text
}

fn describe_failures(failures: &[(&'static str, BackendError)]) -> String {
    failures
        .iter()
        .map(|(step, error)| format!("{step}: {}", with_causes(error)))
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_failure_of_a_teardown_is_reported_with_its_step_and_causes() {
        assert!(BackendError::collect(Vec::new()).is_ok());
        let one = BackendError::collect(vec![("filter", BackendError::CheckFailed("x".into()))]);
        assert_eq!(one.expect_err("failed").to_string(), "check failed: x");
        let several = BackendError::collect(vec![
            (
                "masquerade",
                BackendError::MapRead {
                    name: "connections",
                    source: std::io::Error::from_raw_os_error(libc::EPERM),
                },
            ),
            (
                "filter",
                BackendError::HostPortInUse {
                    mapping: "hostPort 80/tcp".into(),
                    holder: Box::new(Attachment::new("n", "c", "eth0")),
                    pod: None,
                },
            ),
        ])
        .expect_err("failed");
        assert_eq!(several.code(), code::DATAPATH, "the first failure's code");
        let text = several.to_string();
        assert!(
            text.starts_with("masquerade: could not read map connections: Operation not permitted"),
            "{text}"
        );
        assert!(
            text.contains("; filter: hostPort 80/tcp is already held by"),
            "{text}"
        );
    }

    #[test]
    fn a_failed_undo_keeps_the_original_error_first_and_its_code() {
        let error = BackendError::UndoFailed {
            failed: Box::new(BackendError::HostPortInUse {
                mapping: "hostPort 80/tcp".into(),
                holder: Box::new(Attachment::new("n", "c", "eth0")),
                pod: None,
            }),
            undo: Box::new(BackendError::CheckFailed("y".into())),
        };
        assert_eq!(error.code(), code::HOST_PORT_IN_USE);
        let text = error.to_string();
        assert!(
            text.starts_with("hostPort 80/tcp is already held by"),
            "{text}"
        );
        assert!(
            text.ends_with("; undoing the ADD failed too: check failed: y"),
            "{text}"
        );
    }
}
