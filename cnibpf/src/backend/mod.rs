//! Datapath backends. The verbs use a [`Backend`]: apply an attachment's [`Plan`], remove an
//! attachment, check one against its plan, list what is there ([`Inspect`]). A [`Datapath`]
//! (eBPF, nftables) serves them from its capabilities, each a trait of symmetric
//! setup/teardown pairs with CHECK's verification beside them; state of another layout serves
//! them as [`Drained`], which only lets attachments go. Handles to kernel objects stay inside
//! the backend that made them.

pub mod compat;
pub mod ebpf;
mod error;
pub mod nftables;
pub mod purge;
mod verbs;

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::PathBuf,
};

use cnibpf_common::drops::{DropCount, DropReason};
use ipnet::IpNet;

pub use self::{
    compat::{Drained, Draining},
    error::BackendError,
    verbs::{Backend, Datapath, Plan},
};
use crate::{
    journal,
    model::{
        Attachment, BackendChoice, Filter, HostPortAccess, Masquerade, Pod, ResolvedMapping,
        SourceCheck,
    },
    netlink::{self, Link},
};

/// The datapath counter (`Inspect`) of the host's own flows moved off a port that a container's
/// masqueraded flow held towards the same remote.
pub const HOST_FLOWS_MOVED: &str = "host flows moved off a container's port";
/// The datapath counters (`Inspect`) of the answers REJECT rules sent, and of the rejected
/// packets the answer budget left unanswered.
pub const REJECT_ANSWERS_SENT: &str = "reject answers sent";
pub const REJECT_ANSWERS_SUPPRESSED: &str = "reject answers suppressed (rate limit)";
/// The datapath counter (`Inspect`) of the `log` rules' events the rate limit held back.
pub const MATCH_EVENTS_SUPPRESSED: &str = "match events suppressed (rate limit)";

/// Where an attachment's traffic passes: its host-side interface and the uplinks.
#[derive(Clone, Debug)]
pub struct Endpoint {
    pub attachment: Attachment,
    /// The container's host-side interface.
    pub host: Link,
    pub uplinks: Vec<Link>,
    /// Interfaces whose addresses are Service addresses, not the node's (`serviceInterfaces`):
    /// a wildcard hostPort never takes them.
    pub service_interfaces: Vec<String>,
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
    /// `hostFirewall`: what the datapath translates for the container goes through the host's
    /// stack, so that the host's own firewall chains judge it.
    pub host_firewall: bool,
    /// The attachment has a filter (rules, or a default that drops).
    pub filtered: bool,
    /// The attachment has hostPorts: flows translated to the container are tracked.
    pub host_ports_mapped: bool,
    /// The container has other veths than this attachment's: it may be attached more than
    /// once, and its source checks admit each other's addresses (false: no sibling to look
    /// for).
    pub may_have_siblings: bool,
    /// The container's traffic is masqueraded (`ipMasq`).
    pub masqueraded: bool,
    /// Where the container's routed traffic enters the host: the bridge its host-side
    /// interface is enslaved to, else that interface.
    pub gateway_ifindex: u32,
    /// Who reaches the attachment's hostPorts (the reference portmap's keys).
    pub host_ports: HostPortAccess,
    /// The interfaces `host_ports` conditions name, with their indexes.
    pub condition_interfaces: Vec<(String, u32)>,
}

/// An attachment's masquerade as a backend holds it, for `cnibpf inspect`.
#[derive(Clone, Debug, Default)]
pub struct MasqueradeRecord {
    pub masquerade: Masquerade,
    /// Tracked flows of the attachment (expired ones included until they are swept).
    pub flows: usize,
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

/// An attachment's source check as a backend holds it, for `cnibpf inspect`.
#[derive(Clone, Debug)]
pub struct SourceCheckRecord {
    pub check: SourceCheck,
    /// (packets, bytes) dropped for their source.
    pub dropped: (u64, u64),
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

/// An attachment's record and the hooks that bring its traffic to the datapath.
pub trait Endpoints {
    /// Records the attachment and hooks the datapath onto its interface and the uplinks.
    fn setup_endpoint(&mut self, endpoint: &Endpoint) -> Result<(), BackendError>;
    /// Unhooks and forgets the attachment; state shared by all attachments goes with the last.
    fn teardown_endpoint(&mut self, owner: u64) -> Result<(), BackendError>;
    fn check_endpoint(&self, endpoint: &Endpoint) -> Result<(), BackendError>;
}

/// hostPorts: what arrives at a host port goes to the container's port.
pub trait PortMappings {
    /// Makes the attachment's port mappings exactly `mappings`; refuses (100) a hostPort
    /// another attachment of this backend holds, before it changes anything (eBPF) or with the
    /// transaction that would claim it (nftables).
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
    /// The attachment, other than `owner`, holding a mapping that overlaps `mapping`.
    fn holder_of(&self, owner: u64, mapping: &ResolvedMapping)
    -> Result<Option<u64>, BackendError>;
    /// Takes the node's addresses as they are now (see [`node_addresses`]) as those a wildcard
    /// hostPort listens on.
    fn refresh_host_addresses(&mut self, service_interfaces: &[String])
    -> Result<(), BackendError>;
}

/// ipMasq: what containers send off-host leaves from the uplink's address.
pub trait Masquerading {
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
    /// Hooks the uplinks (the eBPF backend's tcx links) and takes their current addresses as
    /// the addresses they masquerade to.
    fn refresh_uplinks(&mut self, uplinks: &[Link]) -> Result<(), BackendError>;
}

/// The attachment's index-ordered filter rules.
pub trait Filtering {
    /// Makes the attachment's filter exactly `filter` in one atomic step; `None` leaves it
    /// unfiltered.
    fn setup_filter(
        &mut self,
        endpoint: &Endpoint,
        filter: Option<&Filter>,
    ) -> Result<(), BackendError>;
    /// Removes the attachment's filter and its connections' state.
    fn teardown_filter(&mut self, owner: u64) -> Result<(), BackendError>;
    /// Replaces the rules of attachment `owner`'s filter while it runs (`cnibpf filter
    /// apply`), in one atomic step: the counters of the rules that stay (by index) and of the
    /// default are kept, and the rules are the attachment's from then on — CHECK verifies
    /// them, not its configuration's, until a `setup_filter` (a re-ADD) puts those back. An
    /// attachment without a filter gets one, set up as an ADD's is.
    fn change_filter(&mut self, owner: u64, filter: &Filter) -> Result<(), BackendError>;
    fn check_filter(
        &self,
        endpoint: &Endpoint,
        filter: Option<&Filter>,
    ) -> Result<(), BackendError>;
}

/// Source address verification: what the container sends leaves only from its own addresses.
pub trait SourceChecking {
    /// Makes the addresses the attachment's container may send from exactly `check`'s, in one
    /// atomic step; `None` turns the check off.
    fn setup_source_check(
        &mut self,
        endpoint: &Endpoint,
        check: Option<&SourceCheck>,
    ) -> Result<(), BackendError>;
    fn teardown_source_check(&mut self, owner: u64) -> Result<(), BackendError>;
    fn check_source_check(
        &self,
        endpoint: &Endpoint,
        check: Option<&SourceCheck>,
    ) -> Result<(), BackendError>;
}

/// What a backend holds, read back: for `cnibpf inspect`, and for the verbs that must find
/// attachments (CHECK, GC, a re-ADD moving between backends).
pub trait Inspect {
    /// Every attachment this backend holds state for, on any network.
    fn attachments(&self) -> Result<Vec<AttachmentRecord>, BackendError>;
    /// Whether it holds state for attachment `owner`. A backend that can ask for one record
    /// answers without reading them all (a DEL asks).
    fn holds(&self, owner: u64) -> Result<bool, BackendError> {
        Ok(self
            .attachments()?
            .iter()
            .any(|record| record.owner == owner))
    }
    /// Every installed port mapping with its owner.
    fn port_mappings(&self) -> Result<Vec<(u64, ResolvedMapping)>, BackendError>;
    /// Every attachment's masquerade, by owner.
    fn masquerades(&self) -> Result<Vec<(u64, MasqueradeRecord)>, BackendError>;
    /// The addresses each uplink masquerades to, as last taken by ADD or CHECK.
    fn uplink_addresses(&self) -> Result<Vec<UplinkAddresses>, BackendError>;
    /// Every attachment's filter with its counters, by owner.
    fn filters(&self) -> Result<Vec<(u64, FilterRecord)>, BackendError>;
    /// Every attachment's source check with its drop counters, by owner.
    fn source_checks(&self) -> Result<Vec<(u64, SourceCheckRecord)>, BackendError>;
    /// Datapath counters and table sizes, by name.
    fn counters(&self) -> Result<Vec<(&'static str, u64)>, BackendError>;
    /// The packets the datapath dropped, by reason (every reason it counts, zero or not);
    /// `None` for state of a build that did not count them.
    fn drops(&self) -> Result<Option<Vec<(DropReason, DropCount)>>, BackendError>;
    /// How full each connection-tracking table the datapath relies on is.
    fn flow_tables(&self) -> Result<Vec<FlowTable>, BackendError>;
    /// Each network's members as the filter's `srcNetwork` and `dstNetwork` match them: the
    /// addresses of its attachments, with their owners.
    fn network_members(&self) -> Result<Vec<NetworkMembers>, BackendError>;
}

/// A network's members (see [`Inspect::network_members`]), by address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetworkMembers {
    pub network: String,
    pub members: Vec<(IpAddr, u64)>,
}

/// The fill of a connection-tracking table: what an operator watches for pressure (a full
/// LRU table evicts live connections' state; a full conntrack table drops new connections).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlowTable {
    pub name: &'static str,
    pub entries: u64,
    pub capacity: u64,
}

/// Fails with "hostPort in use" (100) naming the holder when another live attachment of
/// `backend` holds a hostPort overlapping one of `wanted`. A holder whose host interface is
/// gone (its pod's network namespace went without a DEL) is reclaimed instead: no DEL will
/// ever free what it holds. A holder that cannot be told gone (the kernel's answer was an
/// error, not "no such interface") counts as live: the ADD fails with that error.
pub fn refuse_held_host_ports(
    backend: &mut dyn Backend,
    owner: u64,
    wanted: &[ResolvedMapping],
) -> Result<(), BackendError> {
    for mapping in wanted {
        while let Some(holder) = backend.holder_of(owner, mapping)? {
            let record = backend
                .attachments()?
                .into_iter()
                .find(|record| record.owner == holder);
            if let Some(record) = &record
                && is_stale(record)?
            {
                backend.remove(holder)?;
                journal::note(journal::Change::Reclaimed(record.attachment.to_string()));
                continue;
            }
            let (holder, pod) = match record {
                Some(record) => (record.attachment, record.pod),
                None => (
                    Attachment::new("(unknown)", &format!("owner {holder:016x}"), "?"),
                    None,
                ),
            };
            return Err(BackendError::HostPortInUse {
                mapping: mapping.host_side(),
                holder: Box::new(holder),
                pod,
            });
        }
    }
    Ok(())
}

/// Whether an attachment's host-side interface is gone: its pod's network namespace went
/// (deleting one deletes its veth pair) and only a DEL that never came would free it. An
/// index now held by another interface is gone too, and so is index 0 (a record whose
/// interface the kernel said was gone when it was read). Only the kernel's "no such device"
/// says gone; any other failure to ask is an error, and the caller counts the attachment as
/// live.
pub fn is_stale(record: &AttachmentRecord) -> Result<bool, BackendError> {
    if record.host_ifindex == GONE_IFINDEX {
        return Ok(true);
    }
    let link =
        netlink::link_if_there(record.host_ifindex).map_err(|source| BackendError::Interface {
            action: format!(
                "could not tell whether interface {} (index {}) of {} still exists",
                record.host_ifname, record.host_ifindex, record.attachment
            ),
            source: Box::new(source),
        })?;
    Ok(link.is_none_or(|link| link.name != record.host_ifname))
}

/// The `host_ifindex` of an [`AttachmentRecord`] whose interface the kernel said is gone (no
/// interface has index 0).
pub const GONE_IFINDEX: u32 = 0;

/// Refuses a container whose attachments hold more addresses of a family than a source check
/// holds (the eBPF backend's element; the same limit on both backends).
pub(crate) fn fits_a_source_check(
    container_id: &str,
    admitted: &SourceCheck,
) -> Result<(), BackendError> {
    let (ipv4, ipv6) = admitted.counts();
    let most = cnibpf_common::sources::MAX_ADDRESSES;
    if ipv4 <= most && ipv6 <= most {
        return Ok(());
    }
    Err(BackendError::TooManySources {
        container_id: container_id.to_owned(),
        admitted: admitted.to_string(),
    })
}

/// CHECK's last word on port mappings, once each configured one was found: no more are
/// installed than configured.
pub(crate) fn check_mapping_count(installed: usize, configured: usize) -> Result<(), BackendError> {
    if installed == configured {
        return Ok(());
    }
    Err(BackendError::CheckFailed(format!(
        "{installed} port mappings installed, {configured} configured"
    )))
}

/// The node's own addresses, by interface index: every address of the host but the link-local
/// ones and those of `service_interfaces` — Service addresses (kube-proxy's IPVS mode binds
/// every ClusterIP to `kube-ipvs0`), which are local to the host but not the node's, and which
/// a wildcard hostPort must leave to the Services.
pub fn node_addresses(service_interfaces: &[String]) -> Result<Vec<(u32, IpAddr)>, BackendError> {
    let mut services = Vec::new();
    for name in service_interfaces {
        let index = netlink::index_of(name).map_err(|source| BackendError::Interface {
            action: format!("could not look up service interface {name}"),
            source: Box::new(source),
        })?;
        services.extend(index);
    }
    let addresses =
        netlink::addresses().map_err(|source| BackendError::HostAddresses(Box::new(source)))?;
    Ok(addresses
        .into_iter()
        .filter(|(index, addr)| !services.contains(index) && !is_link_local(*addr))
        .collect())
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
    /// Its index in the namespace the backend serves.
    pub ifindex: u32,
    /// Its name as the backend knows it (the eBPF datapath: its links' pins, which the caller's
    /// namespace need not share); `None` when its hooks no longer attach it.
    pub ifname: Option<String>,
    pub v4: Option<Ipv4Addr>,
    pub v6: Option<Ipv6Addr>,
}

/// The backend `choice` names, ready for changes, or why it cannot be used. A datapath already
/// pinned under `pins` is the answer for `ebpf` and `auto` alike: the kernel that loaded it
/// runs BPF (bpffs does not outlive a boot), and `load` checks its stamp. Without one, `auto`
/// asks the kernel (nothing cached could go stale): eBPF when it works, else nftables; a forced
/// `ebpf` asks too, for an error that says why the host cannot run it.
pub fn select(
    choice: BackendChoice,
    pins: &crate::paths::PinLayout,
    capacity: &crate::model::Capacity,
) -> Result<Box<dyn Backend>, BackendError> {
    let ebpf = || -> Result<Box<dyn Backend>, BackendError> {
        Ok(Box::new(ebpf::EbpfBackend::load_for_changes(
            pins, capacity,
        )?))
    };
    if choice != BackendChoice::Nftables && ebpf::EbpfBackend::is_pinned(pins)? {
        return ebpf();
    }
    match choice {
        BackendChoice::Ebpf => {
            ebpf::EbpfBackend::probe()?;
            crate::phases::mark("probe");
            ebpf()
        }
        BackendChoice::Nftables => Ok(Box::new(nftables::NftablesBackend::open_for_changes(pins)?)),
        BackendChoice::Auto => match ebpf::EbpfBackend::probe() {
            Ok(()) => {
                crate::phases::mark("probe");
                ebpf()
            }
            // Only a host that refuses BPF is served by nftables; a failure to ask fails.
            Err(ebpf_error @ BackendError::Unavailable { .. }) => {
                match nftables::NftablesBackend::open_for_changes(pins) {
                    Ok(nftables) => Ok(Box::new(nftables)),
                    Err(nftables_error) => Err(BackendError::Unavailable {
                        backend: "auto",
                        reason: format!("{ebpf_error}; {nftables_error}"),
                    }),
                }
            }
            Err(error) => Err(error),
        },
    }
}

/// Loads the datapath `choice` picks under `pins` as the first ADD would, touching no
/// interface (see `crate::preload`): whether there was one to load (the nftables backend has
/// nothing to load ahead).
pub fn preload(
    choice: BackendChoice,
    pins: &crate::paths::PinLayout,
    capacity: &crate::model::Capacity,
) -> Result<bool, BackendError> {
    let ebpf = match choice {
        BackendChoice::Nftables => false,
        BackendChoice::Ebpf => {
            ebpf::EbpfBackend::probe()?;
            true
        }
        BackendChoice::Auto => match ebpf::EbpfBackend::probe() {
            Ok(()) => true,
            Err(BackendError::Unavailable { .. }) => false,
            Err(error) => return Err(error),
        },
    };
    if ebpf {
        ebpf::EbpfBackend::load(pins, capacity)?;
    }
    Ok(ebpf)
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

/// What a caller of [`existing`] will do with the state it finds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Look only (inspect, monitor): no lock held, nothing migrated.
    ReadOnly,
    /// Change it, under the instance lock: eBPF state of an older layout is migrated first;
    /// eBPF state of a newer layout (a downgrade), and an nftables table of another layout,
    /// only lose attachments.
    Changes,
}

/// Every backend that holds state under `pins`, for DEL, GC and inspect, which must find an
/// attachment whichever backend made it (a host may gain or lose BPF across a reboot).
pub fn existing(
    pins: &crate::paths::PinLayout,
    access: Access,
) -> Result<Vec<Box<dyn Backend>>, BackendError> {
    existing_except(pins, None, access)
}

/// [`existing`] without the backend named `except` (the one an ADD already opened).
pub fn existing_except(
    pins: &crate::paths::PinLayout,
    except: Option<&str>,
    access: Access,
) -> Result<Vec<Box<dyn Backend>>, BackendError> {
    let mut backends: Vec<Box<dyn Backend>> = Vec::new();
    if except != Some("ebpf") {
        let ebpf = match access {
            Access::ReadOnly => ebpf::EbpfBackend::open_existing(pins, access)?
                .map(|backend| Box::new(backend) as Box<dyn Backend>),
            Access::Changes => ebpf::EbpfBackend::open_for_removal(pins)?,
        };
        backends.extend(ebpf);
    }
    if except != Some("nftables") {
        let nftables = match access {
            Access::ReadOnly => nftables::NftablesBackend::open_existing(pins, access)?
                .map(|backend| Box::new(backend) as Box<dyn Backend>),
            Access::Changes => nftables::NftablesBackend::open_for_removal(pins)?,
        };
        backends.extend(nftables);
    }
    Ok(backends)
}
