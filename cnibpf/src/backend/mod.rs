//! Datapath backends. Each capability is a symmetric setup/teardown pair; handles to kernel
//! objects stay inside the backend that made them.

pub mod ebpf;
pub mod nftables;

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::PathBuf,
};

pub use cnibpf_common::masq_exclude::Reason as ExcludeReason;
use ipnet::IpNet;

use crate::{
    attachment::{Attachment, ResolvedMapping},
    cni::args::Pod,
    config::{BackendChoice, FilterRule, HostPortAccess, Target},
    error::code,
    netlink::Link,
};

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("backend {backend} cannot work on this host: {reason}")]
    Unavailable {
        backend: &'static str,
        reason: String,
    },
    #[error("could not prepare bpffs directory {path}")]
    Bpffs {
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
    #[error("{action}")]
    Pin {
        action: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error(
        "pinned state in {path} has layout {found}, this cnibpf needs layout {expected}: delete every attachment (or the directory) before upgrading across layouts"
    )]
    IncompatibleState {
        path: PathBuf,
        found: String,
        expected: String,
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
    #[error("could not list the host's addresses")]
    HostAddresses(#[source] Box<crate::netlink::NetlinkError>),
    #[error(transparent)]
    Nftables(#[from] nftables::NftablesError),
}

impl BackendError {
    pub fn code(&self) -> u32 {
        match self {
            Self::Unavailable { .. } => code::BACKEND_UNAVAILABLE,
            Self::IncompatibleState { .. } => code::INCOMPATIBLE_STATE,
            Self::HostPortInUse { .. } => code::HOST_PORT_IN_USE,
            Self::CheckFailed(_) => code::CHECK_FAILED,
            Self::Bpffs { .. }
            | Self::Load(_)
            | Self::Program { .. }
            | Self::Map { .. }
            | Self::MapRead { .. }
            | Self::Pin { .. }
            | Self::OwnerCollision { .. } => code::DATAPATH,
            Self::HostAddresses(_) => code::INTERFACE,
            Self::Nftables(_) => code::DATAPATH,
        }
    }
}

/// Where an attachment's traffic passes: its host-side interface and the uplinks.
#[derive(Clone, Debug)]
pub struct Endpoint {
    pub attachment: Attachment,
    /// The container's host-side interface.
    pub host: Link,
    pub uplinks: Vec<Link>,
    /// MAC address of the container's interface.
    pub container_mac: [u8; 6],
    /// MAC address the container's gateway answers with (the bridge's, or the host-side
    /// veth's when it is not enslaved to a bridge).
    pub gateway_mac: [u8; 6],
    pub gateway_v4: Option<Ipv4Addr>,
    pub gateway_v6: Option<Ipv6Addr>,
    /// The cgroup (v2) whose processes' sockets reach hostPorts through the socket hooks.
    pub cgroup: PathBuf,
    /// The container's addresses with their prefixes (from prevResult).
    pub container_networks: Vec<IpNet>,
    /// The pod, when the runtime named it (CNI_ARGS).
    pub pod: Option<Pod>,
    /// Something shapes the container's traffic on its host-side interface (the `bandwidth`
    /// plugin): what the datapath translates must pass that interface's qdiscs.
    pub shaped: bool,
    /// Where the container's routed traffic enters the host: the bridge its host-side
    /// interface is enslaved to, else that interface.
    pub gateway_ifindex: u32,
    /// Who reaches the attachment's hostPorts (the reference portmap's keys).
    pub host_ports: HostPortAccess,
    /// The interfaces `host_ports` conditions name, with their indexes.
    pub condition_interfaces: Vec<(String, u32)>,
}

/// How one attachment is masqueraded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Masquerade {
    /// The container's addresses whose traffic is masqueraded.
    pub sources: Vec<IpAddr>,
    /// Destinations never masqueraded, and why.
    pub excludes: Vec<(IpNet, ExcludeReason)>,
}

/// An attachment's masquerade as a backend holds it, for `cnibpf inspect`.
#[derive(Clone, Debug, Default)]
pub struct MasqueradeRecord {
    pub masquerade: Masquerade,
    /// Tracked flows of the attachment (expired ones included until they are swept).
    pub flows: usize,
}

/// An attachment's filter: its rules in evaluation order (ascending `index`) and the verdict
/// when none matches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    pub rules: Vec<FilterRule>,
    pub default: Target,
}

/// An attachment's filter as a backend holds it, for `cnibpf inspect`.
#[derive(Clone, Debug)]
pub struct FilterRecord {
    pub filter: Filter,
    /// (packets, bytes) each rule decided, in rule order.
    pub hits: Vec<(u64, u64)>,
    /// (packets, bytes) the default verdict decided.
    pub default_hits: (u64, u64),
    /// Tracked connections of the attachment (expired ones included until they are swept).
    pub flows: usize,
}

/// What a backend knows about one attachment it serves.
#[derive(Clone, Debug)]
pub struct AttachmentRecord {
    pub owner: u64,
    pub attachment: Attachment,
    pub pod: Option<Pod>,
    pub host_ifname: String,
    pub host_ifindex: u32,
}

pub trait Backend {
    fn name(&self) -> &'static str;

    /// Records the attachment and hooks the datapath onto its interface and the uplinks.
    fn setup_endpoint(&mut self, endpoint: &Endpoint) -> Result<(), BackendError>;
    /// Unhooks and forgets the attachment; state shared by all attachments goes with the last.
    fn teardown_endpoint(&mut self, owner: u64) -> Result<(), BackendError>;
    fn check_endpoint(&self, endpoint: &Endpoint) -> Result<(), BackendError>;

    /// Makes the attachment's port mappings exactly `mappings`.
    fn setup_port_mappings(
        &mut self,
        endpoint: &Endpoint,
        mappings: &[ResolvedMapping],
    ) -> Result<(), BackendError>;
    /// Removes the attachment's port mappings and the state of the flows they translated.
    fn teardown_port_mappings(&mut self, owner: u64) -> Result<(), BackendError>;
    fn check_port_mappings(
        &self,
        endpoint: &Endpoint,
        mappings: &[ResolvedMapping],
    ) -> Result<(), BackendError>;

    /// Makes the attachment's masquerade exactly `masquerade`; `None` turns it off.
    fn setup_masquerade(
        &mut self,
        endpoint: &Endpoint,
        masquerade: Option<&Masquerade>,
    ) -> Result<(), BackendError>;
    /// Removes the attachment's masquerade and its flows' state (and may sweep expired state
    /// of others on the way).
    fn teardown_masquerade(&mut self, owner: u64) -> Result<(), BackendError>;
    fn check_masquerade(
        &self,
        endpoint: &Endpoint,
        masquerade: Option<&Masquerade>,
    ) -> Result<(), BackendError>;
    /// Makes the attachment's filter exactly `filter` in one atomic step; `None` leaves it
    /// unfiltered.
    fn setup_filter(
        &mut self,
        endpoint: &Endpoint,
        filter: Option<&Filter>,
    ) -> Result<(), BackendError>;
    /// Removes the attachment's filter and its connections' state.
    fn teardown_filter(&mut self, owner: u64) -> Result<(), BackendError>;
    fn check_filter(
        &self,
        endpoint: &Endpoint,
        filter: Option<&Filter>,
    ) -> Result<(), BackendError>;
    /// Every attachment's filter with its counters, by owner.
    fn filters(&self) -> Result<Vec<(u64, FilterRecord)>, BackendError>;

    /// Removes expired connection-tracking state of every attachment. GC, which runtimes call
    /// periodically, runs it: no daemon runs between CNI calls.
    fn sweep_expired(&mut self) -> Result<(), BackendError>;
    /// Takes the uplinks' current addresses as the addresses they masquerade to.
    fn refresh_uplinks(&mut self, uplinks: &[Link]) -> Result<(), BackendError>;

    /// Every attachment this backend holds state for, on any network.
    fn attachments(&self) -> Result<Vec<AttachmentRecord>, BackendError>;
    /// The attachment, other than `owner`, holding a mapping that overlaps `mapping`.
    fn holder_of(&self, owner: u64, mapping: &ResolvedMapping)
    -> Result<Option<u64>, BackendError>;
    /// Every installed port mapping with its owner.
    fn port_mappings(&self) -> Result<Vec<(u64, ResolvedMapping)>, BackendError>;
    /// Every attachment's masquerade, by owner.
    fn masquerades(&self) -> Result<Vec<(u64, MasqueradeRecord)>, BackendError>;
    /// Datapath counters and table sizes, by name.
    fn counters(&self) -> Result<Vec<(&'static str, u64)>, BackendError>;
    /// The addresses each uplink masquerades to, as last taken by ADD or CHECK.
    fn uplink_addresses(&self) -> Result<Vec<UplinkAddresses>, BackendError>;

    /// Applies the changes of this operation. The eBPF backend applies each as it is made (so
    /// it has nothing left to do); the nftables backend collects them into one transaction.
    fn commit(&mut self) -> Result<(), BackendError>;
}

/// A mapping as people write it: `tcp 0.0.0.0:8080 -> 10.22.0.2:80`.
pub fn describe_mapping(mapping: &ResolvedMapping) -> String {
    let host = match mapping.host_addr {
        Some(IpAddr::V6(addr)) => format!("[{addr}]"),
        Some(addr) => addr.to_string(),
        None if mapping.is_ipv4() => "0.0.0.0".to_owned(),
        None => "[::]".to_owned(),
    };
    let container = match mapping.container_addr {
        IpAddr::V6(addr) => format!("[{addr}]"),
        addr => addr.to_string(),
    };
    format!(
        "{} {host}:{} -> {container}:{}",
        mapping.protocol.as_str(),
        mapping.host_port,
        mapping.container_port
    )
}

/// CHECK's last word on port mappings, once each configured one was found: no more are
/// installed than configured.
fn check_mapping_count(installed: usize, configured: usize) -> Result<(), BackendError> {
    if installed == configured {
        return Ok(());
    }
    Err(BackendError::CheckFailed(format!(
        "{installed} port mappings installed, {configured} configured"
    )))
}

pub fn is_link_local(addr: IpAddr) -> bool {
    match addr {
        IpAddr::V4(addr) => addr.is_link_local(),
        IpAddr::V6(addr) => addr.is_unicast_link_local(),
    }
}

/// An uplink and the addresses it masquerades to.
#[derive(Clone, Debug)]
pub struct UplinkAddresses {
    pub ifindex: u32,
    pub v4: Option<Ipv4Addr>,
    pub v6: Option<Ipv6Addr>,
}

/// The backend `choice` names, ready for changes, or why it cannot be used. `auto` asks the
/// kernel every time (nothing cached could go stale): eBPF when it works, else nftables.
pub fn select(
    choice: BackendChoice,
    pins: &crate::paths::PinLayout,
) -> Result<Box<dyn Backend>, BackendError> {
    match choice {
        BackendChoice::Ebpf => {
            ebpf::EbpfBackend::probe()?;
            Ok(Box::new(ebpf::EbpfBackend::load_for_changes(pins)?))
        }
        BackendChoice::Nftables => Ok(Box::new(nftables::NftablesBackend::open_for_changes()?)),
        BackendChoice::Auto => match ebpf::EbpfBackend::probe() {
            Ok(()) => Ok(Box::new(ebpf::EbpfBackend::load_for_changes(pins)?)),
            Err(ebpf_error) => match nftables::NftablesBackend::open_for_changes() {
                Ok(nftables) => Ok(Box::new(nftables)),
                Err(nftables_error) => Err(BackendError::Unavailable {
                    backend: "auto",
                    reason: format!("{ebpf_error}; {nftables_error}"),
                }),
            },
        },
    }
}

/// Whether any backend can work on this host (STATUS).
pub fn any_available() -> Result<(), BackendError> {
    ebpf::EbpfBackend::probe().or_else(|ebpf_error| {
        nftables::NftablesBackend::probe().map_err(|nftables_error| BackendError::Unavailable {
            backend: "auto",
            reason: format!("{ebpf_error}; {nftables_error}"),
        })
    })
}

/// Every backend that holds state under `pins`, for DEL, GC and inspect, which must find an
/// attachment whichever backend made it (a host may gain or lose BPF across a reboot).
pub fn existing(pins: &crate::paths::PinLayout) -> Result<Vec<Box<dyn Backend>>, BackendError> {
    existing_except(pins, None)
}

/// [`existing`] without the backend named `except` (the one an ADD already opened).
pub fn existing_except(
    pins: &crate::paths::PinLayout,
    except: Option<&str>,
) -> Result<Vec<Box<dyn Backend>>, BackendError> {
    let mut backends: Vec<Box<dyn Backend>> = Vec::new();
    if except != Some("ebpf")
        && let Some(ebpf) = ebpf::EbpfBackend::open_existing(pins)?
    {
        backends.push(Box::new(ebpf));
    }
    if except != Some("nftables")
        && let Some(nftables) = nftables::NftablesBackend::open_existing()?
    {
        backends.push(Box::new(nftables));
    }
    Ok(backends)
}
