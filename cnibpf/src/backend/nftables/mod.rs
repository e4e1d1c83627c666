//! The nftables backend: the same configuration served by one table, `inet cnibpf`, where BPF
//! is unavailable.
//!
//! The table's fixed part (chains, hooks, the shared sets and maps) is declared once in
//! [`SKELETON`]. What belongs to an attachment is elements of the shared sets and maps —
//! hostPorts, their conditions' dispatch, the dispatch to its NAT and filter chains — each
//! carrying `<network>/<ifname>/<container id>` in its comment, and chains of its own: its
//! record `a_<owner>` (what it holds, see `record`), its filter `f_<owner>_out`/`_in`, its
//! hostPort conditions `c_<owner>` and its hairpin and masquerade `n_<owner>`. Its source
//! check is the one thing outside: chain `s_<owner>` of table `netdev cnibpf` (`sources`), on
//! its interface's ingress, which sees ARP too. Every shared
//! set is a hash keyed exactly: adding or removing an element costs the same however many
//! attachments there are. An operation reads the
//! records of the attachments it changes, never the whole table, and applies all its changes
//! as one typed batch (`nft -j -f -`): one atomic transaction.
//!
//! `endpoint`, `portmap`, `masquerade` and `filter` each serve one capability by changing the
//! attachment's next record; `commit` turns the difference between the records into the batch
//! (`elements`). `listing` reads the whole table for inspect, CHECK, GC and the rare slow paths;
//! `host` switches the interface settings nftables needs; `conntrack` forgets the connections
//! of hostPorts that changed hands.

mod conntrack;
mod elements;
mod endpoint;
mod error;
mod filter;
mod host;
mod inspect;
mod listing;
mod masquerade;
mod migrate;
mod names;
mod nft;
mod other_layout;
mod portmap;
mod record;
mod scrape;
mod skeleton;
mod sources;

use std::collections::BTreeMap;

use nftables::{batch::Batch, schema::NfListObject};

use self::{
    conntrack::forget_connections,
    listing::Listing,
    names::{
        conditions_chain, family_suffix, filter_chains, nat_chain, owner_comment, parse_owner,
        record_chain,
    },
    record::Record,
    skeleton::{
        HOOK_RULES, LAYOUT_3_OBJECTS, LOCALNET_GUARD, LOCALNET_GUARD_CHAIN, LOCALNET_GUARD_COMMENT,
        SKELETON, TableLayout, layout_of,
    },
};
pub use self::{error::NftablesError, host::firewall_chains};
use super::{Access, Backend, BackendError};
use crate::{
    journal,
    model::{Filter, HostPortAccess, Protocol, ResolvedMapping, SourceCheck},
    netlink,
};

/// nftables keeps comments of at most 128 bytes, NUL included.
const COMMENT_MAX: usize = 127;
/// The table's comment, naming the layout this build writes.
const LAYOUT: &str = "cnibpf layout 3";

/// What one operation changes of one attachment.
#[derive(Clone, Debug, Default)]
struct Change {
    /// What it held before, from its record.
    before: Option<Record>,
    /// What it holds after; `None`: it goes.
    after: Option<Record>,
    /// The rules its filter chains get (when `after` is filtered).
    filter: Option<Filter>,
    /// Who reaches its hostPorts.
    access: Option<HostPortAccess>,
    /// What its source check admits when it has siblings: its own addresses and theirs (see
    /// `sources`); `None`: its own.
    admitted: Option<SourceCheck>,
}

#[derive(Debug, Default)]
pub struct NftablesBackend {
    /// The table exists (or this operation creates it).
    exists: bool,
    /// The attachments this operation changes, by owner id.
    changes: BTreeMap<u64, Change>,
    /// Uplinks to record.
    uplinks: Vec<String>,
    /// The source checks of attachments this operation does not change whose sibling joined,
    /// changed or left: their host interface and what they admit now, by owner id.
    sibling_sources: BTreeMap<u64, (String, SourceCheck)>,
    /// Interfaces whose settings this operation switched on, to record.
    filtered_bridges: Vec<String>,
    localnet_interfaces: Vec<String>,
    /// The whole table, read once when CHECK, inspect or GC first need it.
    listing: std::cell::OnceCell<Listing>,
    /// The last attachment goes: so does the table, and the interface settings cnibpf
    /// switched on (bridges, `route_localnet` interfaces) are switched off after it.
    delete_table: Option<(Vec<String>, Vec<String>)>,
}

impl NftablesBackend {
    /// Whether nftables can work here (STATUS, `auto`): the kernel answers for nf_tables and
    /// `nft` is installed.
    pub fn probe() -> Result<(), BackendError> {
        let unavailable = |reason: String| BackendError::Unavailable {
            backend: "nftables",
            reason,
        };
        host::table_comment().map_err(|error| {
            let reason = format!("asking the kernel for nf_tables failed: {error}");
            if host::lacks_nf_tables(&error) {
                unavailable(reason)
            } else {
                BackendError::ProbeFailed {
                    backend: "nftables",
                    reason,
                }
            }
        })?;
        if !host::nft_installed() {
            return Err(unavailable(format!("{} is not installed", nft::NFT)));
        }
        Ok(())
    }

    /// The backend for an ADD: unavailable (104) where nftables cannot work; an error for a
    /// table of another layout.
    pub fn open_for_changes() -> Result<Self, BackendError> {
        Self::probe()?;
        Self::open(Access::Changes)
    }

    /// The table as this backend sees it: whether it exists, migrated first when it is of the
    /// previous layout and `access` changes it.
    fn open(access: Access) -> Result<Self, BackendError> {
        let comment = host::table_comment().map_err(NftablesError::Netlink)?;
        Self::open_as(layout_of(comment)?, access)
    }

    /// [`Self::open`] of a table whose layout is known.
    fn open_as(layout: TableLayout, access: Access) -> Result<Self, BackendError> {
        let existing = Self {
            exists: true,
            ..Self::default()
        };
        match layout {
            TableLayout::Absent => Ok(Self::default()),
            TableLayout::Current => Ok(existing),
            TableLayout::Previous if access == Access::Changes => {
                migrate::migrate()?;
                Ok(existing)
            }
            TableLayout::Previous => Err(NftablesError::Older.into()),
            TableLayout::Other(found) => Err(NftablesError::Layout { found }.into()),
        }
    }

    /// The table if it exists, for DEL, GC, inspect and ADD's hostPort conflicts. One netlink
    /// question; no `nft` runs on a host without the table (every eBPF host).
    pub fn open_existing(access: Access) -> Result<Option<Self>, BackendError> {
        match existing_table_comment()? {
            Some(comment) => Self::open_as(layout_of(Some(comment))?, access).map(Some),
            None => Ok(None),
        }
    }

    /// [`Self::open_existing`] for DEL and GC: a table of another layout is opened for removing
    /// attachments, never refused (see `other_layout`).
    pub fn open_for_removal() -> Result<Option<Box<dyn Backend>>, BackendError> {
        let Some(comment) = existing_table_comment()? else {
            return Ok(None);
        };
        match layout_of(Some(comment))? {
            TableLayout::Other(comment) => {
                Ok(Some(Box::new(other_layout::OtherLayout::open(comment)?)))
            }
            layout => Ok(Some(Box::new(Self::open_as(layout, Access::Changes)?))),
        }
    }

    /// The whole table as the kernel has it (empty when there is none), read once.
    fn listing(&self) -> Result<&Listing, BackendError> {
        if let Some(listing) = self.listing.get() {
            return Ok(listing);
        }
        let listing = if self.exists {
            // fail-closed: `read` kept the errors; no table lists nothing.
            Listing::read()?.unwrap_or_default()
        } else {
            Listing::default()
        };
        Ok(self.listing.get_or_init(|| listing))
    }

    /// The change of `owner` in this operation, its record read on first use.
    fn change(&mut self, owner: u64) -> Result<&mut Change, BackendError> {
        if !self.changes.contains_key(&owner) {
            let before = if self.exists {
                listing::record_of(owner)?
            } else {
                None
            };
            self.changes.insert(
                owner,
                Change {
                    after: before.clone(),
                    before,
                    ..Change::default()
                },
            );
        }
        Ok(self.changes.get_mut(&owner).expect("inserted above"))
    }

    /// The change of the attachment `endpoint` is for, whose next record exists and names its
    /// interface, pod and addresses as they are now.
    fn attach(&mut self, endpoint: &crate::backend::Endpoint) -> Result<&mut Change, BackendError> {
        let owner_text = owner_comment(&endpoint.attachment)?;
        let change = self.change(endpoint.attachment.owner_id())?;
        let after = change.after.get_or_insert_with(Record::default);
        after.owner = owner_text;
        after.host.clone_from(&endpoint.host.name);
        after.pod.clone_from(&endpoint.pod);
        after.networks.clone_from(&endpoint.container_networks);
        Ok(change)
    }

    /// Creates the table's fixed part if it is not there (a fixed declaration, applied once),
    /// or counts its localnet guard's drops if it does not yet.
    fn ensure_table(&mut self) -> Result<(), BackendError> {
        if !self.exists {
            let script = format!("{SKELETON}{LOCALNET_GUARD}{LAYOUT_3_OBJECTS}{HOOK_RULES}");
            nft::run_script(&["-f", "-"], script.as_bytes())?;
            self.exists = true;
            return Ok(());
        }
        let guard = host::rule_comments(LOCALNET_GUARD_CHAIN)?;
        if guard.is_some_and(|comments| !comments.iter().any(|c| c == LOCALNET_GUARD_COMMENT)) {
            nft::run_script(&["-f", "-"], LOCALNET_GUARD.as_bytes())?;
        }
        Ok(())
    }

    /// The batch of this operation, after `batch`'s commands: what each change removes, then
    /// what it adds.
    fn batch(
        &self,
        mut batch: Batch<'static>,
        specific: Option<&Listing>,
    ) -> Result<Batch<'static>, BackendError> {
        for (owner, change) in &self.changes {
            elements::remove(&mut batch, *owner, change, specific);
        }
        for (owner, change) in &self.changes {
            elements::add(&mut batch, *owner, change);
        }
        for (owner, (host, admitted)) in &self.sibling_sources {
            if !self.changes.contains_key(owner) {
                sources::add_chain(&mut batch, *owner, host, admitted);
            }
        }
        let shared = [
            ("uplinks", &self.uplinks),
            ("filtered_bridges", &self.filtered_bridges),
            ("localnet_interfaces", &self.localnet_interfaces),
        ];
        for (set, names) in shared {
            if !names.is_empty() {
                batch.add(nft::elements(set, names.iter().map(nft::text).collect()));
            }
        }
        if self.deletes_table() {
            batch.delete(NfListObject::Table(nftables::schema::Table {
                family: nft::FAMILY,
                name: nft::TABLE.into(),
                handle: None,
            }));
            if host::has_source_table()? {
                sources::delete_table(&mut batch);
            }
        }
        Ok(batch)
    }

    /// Whether this operation's changes need the others' address-specific hostPorts: to keep a
    /// marker another still needs, or to refuse a wildcard one of them overlaps.
    fn needs_specific(&self) -> bool {
        self.changes.values().any(|change| {
            [&change.before, &change.after]
                .into_iter()
                .flatten()
                .any(|record| {
                    record
                        .mappings
                        .iter()
                        .any(|mapping| mapping.host_addr.is_some())
                })
        })
    }

    /// The mappings whose tracked connections go once the transaction is in: those added,
    /// removed or leading elsewhere now.
    fn changed_mappings(&self) -> Vec<ResolvedMapping> {
        let mut changed = Vec::new();
        for change in self.changes.values() {
            let before = change
                .before
                .as_ref()
                // fail-closed: an Option: no record holds no mapping.
                .map_or(&[][..], |record| &record.mappings);
            let after = change
                .after
                .as_ref()
                // fail-closed: as above.
                .map_or(&[][..], |record| &record.mappings);
            changed.extend(before.iter().filter(|mapping| !after.contains(mapping)));
            changed.extend(after.iter().filter(|mapping| !before.contains(mapping)));
        }
        changed
    }

    /// The transaction again when a record said more than the table holds (someone removed
    /// part of it): what goes is what the kernel lists as the attachment's, not its record.
    fn apply_from_listing(&mut self) -> Result<(), BackendError> {
        // fail-closed: `read` kept the errors; no table lists nothing.
        let listing = Listing::read()?.unwrap_or_default();
        let mut removals = Batch::new();
        for (owner, change) in &mut self.changes {
            let text = change
                .before
                .as_ref()
                .or(change.after.as_ref())
                .map(|record| record.owner.clone());
            if let Some(text) = text {
                elements::remove_listed(&mut removals, *owner, &text, &listing)?;
            }
            change.before = None;
        }
        Ok(nft::apply(self.batch(removals, Some(&listing))?)?)
    }

    /// The attachments this operation removes.
    fn leaving(&self) -> Vec<u64> {
        self.changes
            .iter()
            .filter(|(_, change)| change.after.is_none())
            .map(|(owner, _)| *owner)
            .collect()
    }

    /// The table goes with this operation: its last attachment leaves and none is added.
    fn deletes_table(&self) -> bool {
        self.delete_table.is_some() && self.changes.values().all(|change| change.after.is_none())
    }

    /// Tells the journal what the committed transaction did: the hostPorts attachments
    /// released, the holders in `reclaimed` removed.
    fn note_changes(&self, reclaimed: &[u64]) {
        for (owner, change) in &self.changes {
            let Some(before) = &change.before else {
                continue;
            };
            let kept = change
                .after
                .as_ref()
                // fail-closed: an Option: an attachment that goes keeps no hostPort.
                .map_or(&[][..], |after| &after.mappings[..]);
            for mapping in before.mappings.iter().filter(|held| !kept.contains(held)) {
                journal::note(journal::Change::HostPortReleased(mapping.to_string()));
            }
            if reclaimed.contains(owner) {
                // fail-closed: a record names its owner; an unreadable one is shown as stored.
                let name = parse_owner(&before.owner)
                    .map_or_else(|| before.owner.clone(), |attachment| attachment.to_string());
                journal::note(journal::Change::Reclaimed(name));
            }
        }
    }

    /// After a refused transaction: an attachment whose interface is gone holding a hostPort
    /// this operation claims.
    fn stale_holder(&self) -> Result<Option<u64>, BackendError> {
        let Some(listing) = Listing::read()? else {
            return Ok(None);
        };
        let leaving = self.leaving();
        for (owner, change) in &self.changes {
            for mapping in change.after.iter().flat_map(|record| &record.mappings) {
                for (holder, _, _) in listing.holders_of(*owner, mapping)? {
                    let chain = record_chain(holder);
                    if leaving.contains(&holder) || !listing.has_chain(&chain) {
                        continue;
                    }
                    let host = listing.record(&chain)?.host;
                    let gone = netlink::index_of(&host)
                        .map_err(|source| BackendError::Interface {
                            action: format!(
                                "could not tell whether interface {host} of the holder of {mapping} still exists"
                            ),
                            source: Box::new(source),
                        })?
                        .is_none();
                    if gone {
                        return Ok(Some(holder));
                    }
                }
            }
        }
        Ok(None)
    }

    /// After a refused transaction: error 100 for a hostPort this operation claims that
    /// another attachment holds.
    fn holder_error(&self) -> Result<Option<BackendError>, BackendError> {
        let Some(listing) = Listing::read()? else {
            return Ok(None);
        };
        for (owner, change) in &self.changes {
            for mapping in change.after.iter().flat_map(|record| &record.mappings) {
                if let Some(error) = listing.overlap_error(*owner, mapping, &self.leaving())? {
                    return Ok(Some(error));
                }
            }
        }
        Ok(None)
    }
}

impl Backend for NftablesBackend {
    fn name(&self) -> &'static str {
        "nftables"
    }

    fn sweep_expired(&mut self) -> Result<(), BackendError> {
        // The kernel's connection tracking expires its own entries.
        Ok(())
    }

    fn commit(&mut self) -> Result<(), BackendError> {
        let has_work = self
            .changes
            .values()
            .any(|change| change.before != change.after || change.after.is_some())
            || !self.uplinks.is_empty()
            || self.delete_table.is_some();
        if !has_work {
            return Ok(());
        }
        if self.changes.values().any(|change| change.after.is_some()) || !self.uplinks.is_empty() {
            self.ensure_table()?;
        }
        if !self.exists {
            return Ok(());
        }
        let specific = if self.needs_specific() {
            Listing::read_specific()?
        } else {
            None
        };
        let refused = |applied: &Result<(), BackendError>, why: &str| matches!(applied, Err(BackendError::Nftables(NftablesError::Refused(text))) if text.contains(why));
        let mut applied =
            nft::apply(self.batch(Batch::new(), specific.as_ref())?).map_err(BackendError::from);
        if refused(&applied, "No such file or directory") {
            applied = self.apply_from_listing();
        }
        // A hostPort held by an attachment whose interface is gone is reclaimed, as many as
        // there are, before a holder is named.
        let mut reclaimed = Vec::new();
        while refused(&applied, "File exists") {
            let Some(stale) = self.stale_holder()? else {
                break;
            };
            super::remove_attachment(self, stale)?;
            reclaimed.push(stale);
            let specific = if self.needs_specific() {
                Listing::read_specific()?
            } else {
                None
            };
            applied = nft::apply(self.batch(Batch::new(), specific.as_ref())?)
                .map_err(BackendError::from);
        }
        if refused(&applied, "File exists")
            && let Some(holder) = self.holder_error()?
        {
            return Err(holder);
        }
        applied?;
        self.note_changes(&reclaimed);
        let deleted_table = self.deletes_table();
        let mut failures = Vec::new();
        if let Some((bridges, localnet)) = self.delete_table.take()
            && deleted_table
            && let Err(error) = host::restore(&bridges, &localnet)
        {
            failures.push(("interface settings", error.into()));
        }
        // As the reference portmap: datagram flows that met a hostPort before it was there
        // (or while it led elsewhere) would otherwise keep their old fate; a TCP connection
        // does not outlive its endpoints. The change is in either way; a failure is reported
        // (an ADD is undone and retried; a DEL's leftovers go with the next ADD of the port).
        let changed: Vec<ResolvedMapping> = self
            .changed_mappings()
            .into_iter()
            .filter(|mapping| mapping.protocol != Protocol::Tcp)
            .collect();
        if let Err(error) = forget_connections(&changed) {
            failures.push(("connection tracking", error));
        }
        self.changes.clear();
        self.uplinks.clear();
        self.sibling_sources.clear();
        BackendError::collect(failures)
    }
}

/// The table's comment, `None` when there is no table — or no nf_tables in this kernel at all,
/// where nothing of ours can be. Any other failure to ask is an error.
fn existing_table_comment() -> Result<Option<String>, BackendError> {
    match host::table_comment() {
        Ok(comment) => Ok(comment),
        Err(error) if host::lacks_nf_tables(&error) => Ok(None),
        Err(error) => Err(NftablesError::Netlink(error).into()),
    }
}

/// Whether table `inet cnibpf` is at this build's layout: `Ok(())` when it is (or there is
/// none: an ADD makes it so), else which layout it has.
/// The layout of table `inet cnibpf` when it is one this build neither writes nor migrates
/// (the first layout's comment is empty): its attachments drain, and no ADD is served until the
/// last is gone.
pub fn unmigrated_layout() -> Result<Option<String>, BackendError> {
    Ok(match layout_of(existing_table_comment()?)? {
        TableLayout::Other(found) => Some(found),
        TableLayout::Absent | TableLayout::Current | TableLayout::Previous => None,
    })
}

pub fn table_at_this_layout() -> Result<Result<(), String>, BackendError> {
    Ok(match layout_of(existing_table_comment()?)? {
        TableLayout::Absent | TableLayout::Current => Ok(()),
        TableLayout::Previous => Err(format!(
            "table inet cnibpf has the previous layout (\"{}\"; the next ADD, DEL or GC migrates it)",
            migrate::PREVIOUS
        )),
        TableLayout::Other(found) => Err(format!(
            "table inet cnibpf has layout {found:?}, not this build's \"{LAYOUT}\""
        )),
    })
}

/// The layout comment this build writes on table `inet cnibpf`.
pub const TABLE_LAYOUT: &str = LAYOUT;
