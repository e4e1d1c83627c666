//! `cnibpf inspect`: the state of an instance, for people (a table, `text`) or scripts
//! (`--json`, `json`): every backend's attachments with what each holds, the uplinks, the
//! counters, drops and flow tables, the eBPF maps' memory, and the host's firewall chains the
//! eBPF datapath passes by.

mod json;
mod text;

use std::{io::Write as _, path::Path};

use cnibpf_common::drops::{DropCount, DropReason};

use crate::{
    backend::{
        self, AttachmentRecord, Backend, BackendError, FilterRecord, FlowTable, MasqueradeRecord,
        NetworkMembers, SourceCheckRecord, UplinkAddresses, ebpf::Memory, nftables,
    },
    cni::error::Error,
    instance::Instance,
    model::ResolvedMapping,
    paths::PinLayout,
};

pub fn run(pin_path: &Path, as_json: bool) -> Result<(), Error> {
    let pins = PinLayout::new(pin_path);
    let snapshot = Snapshot::read(&pins)?;
    let lines = if as_json {
        vec![format!("{:#}", json::document(&pins, &snapshot))]
    } else {
        text::lines(pin_path, &snapshot)
    };
    print(&lines)
}

/// A datapath's drops by reason (`None`: a datapath that does not count them).
type Drops = Vec<(DropReason, DropCount)>;

/// Everything inspect shows, read once, by backend.
struct Snapshot {
    attachments: Vec<Shown>,
    counters: Vec<(&'static str, Vec<(&'static str, u64)>)>,
    drops: Vec<(&'static str, Option<Drops>)>,
    flow_tables: Vec<(&'static str, Vec<FlowTable>)>,
    uplinks: Vec<(&'static str, UplinkAddresses)>,
    /// Each network's members as `srcNetwork` and `dstNetwork` match them, by backend.
    networks: Vec<(&'static str, NetworkMembers)>,
    memory: Option<Memory>,
    /// What is to know of an eBPF datapath another network namespace set up.
    namespace: Option<String>,
    /// The host's firewall chains that do not see what the eBPF datapath forwards.
    bypassed: Vec<nftables::HostChain>,
}

/// One attachment as inspect shows it.
struct Shown {
    backend: &'static str,
    record: AttachmentRecord,
    mappings: Vec<ResolvedMapping>,
    masquerade: Option<MasqueradeRecord>,
    filter: Option<FilterRecord>,
    source_check: Option<SourceCheckRecord>,
}

impl Snapshot {
    fn read(pins: &PinLayout) -> Result<Self, Error> {
        let mut snapshot = Self {
            attachments: Vec::new(),
            counters: Vec::new(),
            drops: Vec::new(),
            flow_tables: Vec::new(),
            uplinks: Vec::new(),
            networks: Vec::new(),
            memory: None,
            namespace: None,
            bypassed: Vec::new(),
        };
        for backend in Instance::to_read(pins)?.backends() {
            snapshot.add(backend)?;
        }
        if snapshot.flow_tables.iter().any(|(name, _)| *name == "ebpf") {
            snapshot.memory = Some(backend::ebpf::memory(pins)?);
            snapshot.namespace = backend::ebpf::EbpfBackend::namespace_note(pins)?;
        }
        snapshot.attachments.sort_by_key(|shown| {
            let attachment = &shown.record.attachment;
            (
                attachment.network.clone(),
                attachment.container_id.clone(),
                attachment.ifname.clone(),
            )
        });
        // The eBPF datapath hands what it translates past the host's own chains
        // (docs/datapath.md: the host's firewall); a user whose rules would judge that traffic
        // should know.
        if snapshot
            .attachments
            .iter()
            .any(|shown| shown.backend == "ebpf")
        {
            snapshot.bypassed = nftables::firewall_chains().map_err(BackendError::from)?;
        }
        Ok(snapshot)
    }

    /// What `backend` holds.
    fn add(&mut self, backend: &dyn Backend) -> Result<(), BackendError> {
        let mappings = backend.port_mappings()?;
        let masquerades = backend.masquerades()?;
        let filters = backend.filters()?;
        let source_checks = backend.source_checks()?;
        for record in backend.attachments()? {
            let owner = record.owner;
            let mut own: Vec<_> = owned(&mappings, owner).copied().collect();
            own.sort_by_key(|mapping| (mapping.protocol, mapping.host_port, mapping.host_addr));
            self.attachments.push(Shown {
                backend: backend.name(),
                record,
                mappings: own,
                masquerade: owned(&masquerades, owner)
                    .next()
                    .filter(|masquerade| !masquerade.masquerade.sources.is_empty())
                    .cloned(),
                filter: owned(&filters, owner).next().cloned(),
                source_check: owned(&source_checks, owner).next().cloned(),
            });
        }
        let name = backend.name();
        self.counters.push((name, backend.counters()?));
        self.drops.push((name, backend.drops()?));
        self.flow_tables.push((name, backend.flow_tables()?));
        for uplink in backend.uplink_addresses()? {
            self.uplinks.push((name, uplink));
        }
        for network in backend.network_members()? {
            self.networks.push((name, network));
        }
        Ok(())
    }
}

/// The entries of `list` that belong to attachment `owner`.
fn owned<T>(list: &[(u64, T)], owner: u64) -> impl Iterator<Item = &T> {
    list.iter()
        .filter(move |(of, _)| *of == owner)
        .map(|(_, item)| item)
}

/// What an attachment's user should know that its state does not show.
fn notes(backend: &str, mappings: &[ResolvedMapping]) -> Vec<String> {
    let loopback_v6: Vec<String> = mappings
        .iter()
        .filter(|mapping| {
            !mapping.is_ipv4() && mapping.host_addr.is_none_or(|addr| addr.is_loopback())
        })
        .map(|mapping| format!("{}/{}", mapping.host_port, mapping.protocol))
        .collect();
    if backend != "nftables" || loopback_v6.is_empty() {
        return Vec::new();
    }
    vec![format!(
        "host processes cannot reach [::1]:{} through the nftables backend (IPv6 has no route_localnet); they can by 127.0.0.1 and the host's addresses",
        loopback_v6.join(", [::1]:")
    )]
}

/// Writes the report; one that cannot be written is the command's failure.
fn print(lines: &[String]) -> Result<(), Error> {
    let mut out = std::io::stdout().lock();
    for line in lines {
        writeln!(out, "{line}").map_err(Error::Output)?;
    }
    out.flush().map_err(Error::Output)
}
