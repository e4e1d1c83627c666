//! What one plugin process did, gathered as it goes for the line the call log gets and the
//! counts `call_stats` keeps: which attachment, which backend, what changed. The verbs and
//! backends note what they know where they know it; `cni::run` reads it back once, at the end.

use std::sync::Mutex;

/// What a call changed, one entry per thing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// A hostPort the attachment holds after an ADD (`tcp 8080 -> 10.22.0.5:80`).
    HostPortHeld(String),
    /// A hostPort an attachment released (its DEL, a reclaim, a re-ADD without it).
    HostPortReleased(String),
    /// An attachment whose interface was gone, removed to free what it held.
    Reclaimed(String),
    /// An attachment CNI GC removed (not among the runtime's valid attachments).
    Removed(String),
    /// A step of a migration of the previous layout's state.
    Migrated(String),
    /// State put back that someone else took (the nftables ruleset a firewall reload
    /// flushed), with why.
    Restored(String),
    /// What the last DEL in release-only mode removed of cnibpf (its datapath, conflist and
    /// binary).
    Uninstalled(String),
}

#[derive(Debug, Default)]
struct Journal {
    network: Option<String>,
    container_id: Option<String>,
    ifname: Option<String>,
    pod: Option<String>,
    backends: Vec<&'static str>,
    changes: Vec<Change>,
}

static JOURNAL: Mutex<Journal> = Mutex::new(Journal {
    network: None,
    container_id: None,
    ifname: None,
    pod: None,
    backends: Vec::new(),
    changes: Vec::new(),
});

fn with<T>(work: impl FnOnce(&mut Journal) -> T) -> T {
    // fail-closed: a panic elsewhere while holding it leaves a journal still worth writing.
    let mut journal = JOURNAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    work(&mut journal)
}

/// The container and interface the call is about (CNI_CONTAINERID, CNI_IFNAME).
pub fn container(container_id: &str, ifname: &str) {
    with(|journal| {
        journal.container_id = Some(container_id.to_owned());
        journal.ifname = Some(ifname.to_owned());
    });
}

/// The network the call is about (its configuration's `name`).
pub fn network(network: &str) {
    with(|journal| journal.network = Some(network.to_owned()));
}

/// The pod (`namespace/name`) the runtime named in CNI_ARGS.
pub fn pod(pod: &str) {
    with(|journal| journal.pod = Some(pod.to_owned()));
}

/// A backend that served the call (each once, in the order met).
pub fn backend(name: &'static str) {
    with(|journal| {
        if !journal.backends.contains(&name) {
            journal.backends.push(name);
        }
    });
}

pub fn note(change: Change) {
    with(|journal| journal.changes.push(change));
}

/// Everything noted, as the call log's fields.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Noted {
    pub network: Option<String>,
    pub container_id: Option<String>,
    pub ifname: Option<String>,
    pub pod: Option<String>,
    pub backends: Vec<&'static str>,
    pub host_ports: Vec<String>,
    pub host_ports_released: Vec<String>,
    pub reclaimed: Vec<String>,
    pub removed: Vec<String>,
    pub migrated: Vec<String>,
    pub restored: Vec<String>,
    pub uninstalled: Vec<String>,
}

/// What was noted so far.
pub fn noted() -> Noted {
    with(|journal| {
        let of = |kind: fn(&Change) -> Option<&String>| {
            journal
                .changes
                .iter()
                .filter_map(kind)
                .cloned()
                .collect::<Vec<_>>()
        };
        Noted {
            network: journal.network.clone(),
            container_id: journal.container_id.clone(),
            ifname: journal.ifname.clone(),
            pod: journal.pod.clone(),
            backends: journal.backends.clone(),
            host_ports: of(|change| match change {
                Change::HostPortHeld(text) => Some(text),
                _ => None,
            }),
            host_ports_released: of(|change| match change {
                Change::HostPortReleased(text) => Some(text),
                _ => None,
            }),
            reclaimed: of(|change| match change {
                Change::Reclaimed(text) => Some(text),
                _ => None,
            }),
            removed: of(|change| match change {
                Change::Removed(text) => Some(text),
                _ => None,
            }),
            migrated: of(|change| match change {
                Change::Migrated(text) => Some(text),
                _ => None,
            }),
            restored: of(|change| match change {
                Change::Restored(text) => Some(text),
                _ => None,
            }),
            uninstalled: of(|change| match change {
                Change::Uninstalled(text) => Some(text),
                _ => None,
            }),
        }
    })
}
