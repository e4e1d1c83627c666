//! The nftables backend: the same configuration served by one table, `inet cnibpf`, where BPF
//! is unavailable.
//!
//! What each attachment holds is its record (`record`), kept in the instance's state file
//! (`store`) outside the ruleset; the ruleset is derived from the records. The table's fixed
//! part (sets, maps, chains and hook rules) is declared once (`skeleton`). What belongs to an
//! attachment is elements of the shared sets and maps — hostPorts, their conditions' dispatch,
//! the dispatch to its NAT and filter chains — each carrying
//! `<network>/<ifname>/<container id>` in its comment, and chains of its own: its filter
//! `f_<owner>_out`/`_in`, its hostPort conditions `c_<owner>`, its hairpin and masquerade
//! `n_<owner>`. What hooks on one interface is in table `netdev cnibpf`: its source check,
//! chain `s_<owner>` (`sources`) on its interface's ingress, which sees ARP too, and its
//! masquerade guard, chain `g_<owner>` entered from the uplinks' egress (`guard`). Every
//! shared set is a hash keyed exactly: adding or removing an element costs the same however
//! many attachments there are. An operation applies all its changes as one
//! typed batch (`nft -j -f -`): one atomic transaction, with the state file written before it
//! (what it adds) and after it (what it removed).
//!
//! A firewall reload that flushes the ruleset (`nft flush ruleset`, firewalld, an `nft -f` file
//! that starts with `flush ruleset`) takes the tables, not the records: the next operation of
//! the instance, and `install --watch` as soon as it sees the change, make the tables again
//! from them, whole, in one transaction (`restore`).
//!
//! `endpoint`, `portmap`, `masquerade` and `filter` each serve one capability by changing the
//! attachment's next record; `commit` turns the difference between the records into the batch
//! (`elements`). `listing` reads the whole table for inspect, CHECK and the rare slow paths;
//! `host` switches the interface settings nftables needs; `conntrack` forgets the connections
//! of hostPorts that changed hands.

mod commit;
mod compat;
mod conntrack;
mod elements;
mod endpoint;
mod error;
mod filter;
mod guard;
mod hooks;
mod host;
mod inspect;
mod listing;
mod masquerade;
mod members;
mod names;
pub mod nflog;
mod nft;
mod portmap;
mod record;
mod restore;
mod scrape;
mod skeleton;
mod sources;
mod store;

use std::{collections::BTreeMap, net::IpAddr};

use self::{
    compat::other_layout::{OtherLayout, Refusal},
    conntrack::forget_connections,
    listing::Listing,
    names::{
        GUARD_CHAIN_PREFIX, conditions_chain, family_suffix, filter_chains, guard_chain, log_chain,
        member_set, nat_chain, owner_comment, parse_owner, reject_chain,
    },
    record::Record,
    skeleton::{LOCALNET_GUARD_CHAIN, TableLayout, layout},
    store::Store,
};
pub use self::{
    error::NftablesError,
    host::{HostChain, firewall_chains},
};
use super::{Access, Backend, BackendError, Datapath, Drained};
use crate::{
    model::{Protocol, ResolvedMapping, SourceCheck},
    paths::PinLayout,
};

/// nftables keeps comments of at most 128 bytes, NUL included.
const COMMENT_MAX: usize = 127;
/// The layout this build writes (its tables carry the set `skeleton::marker` names).
const LAYOUT: &str = "cnibpf layout 4";

/// What one operation changes of one attachment.
#[derive(Clone, Debug, Default)]
struct Change {
    /// What it held before, from its record.
    before: Option<Record>,
    /// What it holds after; `None`: it goes.
    after: Option<Record>,
    /// What its source check admits when it has siblings: its own addresses and theirs (see
    /// `sources`); `None`: its own.
    admitted: Option<SourceCheck>,
    /// What its filter's rules had counted, for those that stay when a live change rewrites
    /// its chains (`Filtering::change_filter`); `None`: they start from zero.
    kept_counters: Option<listing::Counters>,
}

#[derive(Debug)]
pub struct NftablesBackend {
    /// The instance's state file, as this operation read it and wrote it.
    store: Store,
    /// The table exists, made from the state file (or this operation creates it).
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
    /// The node's addresses, when this operation takes them anew, with the interfaces whose
    /// addresses are not the node's.
    node_addresses: Option<(Vec<String>, Vec<IpAddr>)>,
    /// The whole table, read once when CHECK, inspect or GC first need it.
    listing: std::cell::OnceCell<Listing>,
    /// Table `netdev cnibpf` (source checks, masquerade guard), read as the other.
    netdev_listing: std::cell::OnceCell<Listing>,
}

impl NftablesBackend {
    /// The NFLOG group the table's `log` rules send to (`nflog`).
    pub fn log_group(&self) -> Result<u16, BackendError> {
        Ok(nflog::group_of(self.store.state_or_new()?.instance))
    }

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
    pub fn open_for_changes(pins: &PinLayout) -> Result<Self, BackendError> {
        Self::probe()?;
        let comment = existing_table_comment()?;
        let store = Store::load(pins)?;
        Self::open_as(layout(comment)?, store, Access::Changes)
    }

    /// The table as this backend sees it with the state file `store`: put back from it when a
    /// firewall reload took it and `access` changes it, migrated first when it is of an older
    /// layout.
    fn open_as(
        layout: TableLayout,
        mut store: Store,
        access: Access,
    ) -> Result<Self, BackendError> {
        let exists = match layout {
            TableLayout::Absent if access == Access::Changes && store.has_records() => {
                restore::restore(
                    &mut store,
                    restore::Cause::TableGone,
                    &listing::Counters::default(),
                )?
            }
            TableLayout::Absent => false,
            TableLayout::Current { instance } => {
                restore::belongs_together(&store, instance)?;
                if access == Access::Changes && restore::netdev_table_gone(&store)? {
                    // fail-closed: `read` kept the errors; no table lists nothing.
                    let listing = Listing::read()?.unwrap_or_default();
                    restore::restore(
                        &mut store,
                        restore::Cause::NetdevTableGone,
                        &listing::Counters::of(&listing),
                    )?
                } else {
                    true
                }
            }
            TableLayout::Previous if access == Access::Changes => compat::migrate(&mut store)?,
            TableLayout::Previous => return Err(NftablesError::Older.into()),
            TableLayout::Other(found) => return Err(NftablesError::Layout { found }.into()),
        };
        Ok(Self {
            store,
            exists,
            changes: BTreeMap::new(),
            uplinks: Vec::new(),
            sibling_sources: BTreeMap::new(),
            filtered_bridges: Vec::new(),
            localnet_interfaces: Vec::new(),
            node_addresses: None,
            listing: std::cell::OnceCell::new(),
            netdev_listing: std::cell::OnceCell::new(),
        })
    }

    /// The table or the records of the instance at `pins` if there are any, for DEL, GC,
    /// inspect and ADD's hostPort conflicts. One netlink question and one file read; no `nft`
    /// runs on a host without either (every eBPF host).
    pub fn open_existing(pins: &PinLayout, access: Access) -> Result<Option<Self>, BackendError> {
        let comment = existing_table_comment()?;
        let store = Store::load(pins)?;
        if comment.is_none() && !store.has_records() {
            return Ok(None);
        }
        Self::open_as(layout(comment)?, store, access).map(Some)
    }

    /// [`Self::open_existing`] for DEL and GC: a table of another layout, or one whose records
    /// are missing, is opened for removing attachments, never refused (see `other_layout`).
    pub fn open_for_removal(pins: &PinLayout) -> Result<Option<Box<dyn Backend>>, BackendError> {
        let comment = existing_table_comment()?;
        let store = Store::load(pins)?;
        if comment.is_none() && !store.has_records() {
            return Ok(None);
        }
        match layout(comment)? {
            TableLayout::Other(comment) => Ok(Some(Box::new(Drained(OtherLayout::open(
                Refusal::Layout(comment),
            )?)))),
            TableLayout::Current { .. } if store.state().is_none() => Ok(Some(Box::new(Drained(
                OtherLayout::open(Refusal::StateMissing(store.path().to_owned()))?,
            )))),
            layout => Ok(Some(Box::new(Self::open_as(
                layout,
                store,
                Access::Changes,
            )?))),
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

    /// Table `netdev cnibpf`, read once.
    fn netdev_listing(&self) -> Result<&Listing, BackendError> {
        if let Some(listing) = self.netdev_listing.get() {
            return Ok(listing);
        }
        // fail-closed: `read_netdev` kept the errors; no table lists nothing.
        let listing = Listing::read_netdev()?.unwrap_or_default();
        Ok(self.netdev_listing.get_or_init(|| listing))
    }

    /// The change of `owner` in this operation, its record read on first use.
    fn change(&mut self, owner: u64) -> &mut Change {
        let before = self.store.record(owner).cloned();
        self.changes.entry(owner).or_insert_with(|| Change {
            after: before.clone(),
            before,
            ..Change::default()
        })
    }

    /// The change of the attachment `endpoint` is for, whose next record exists and names its
    /// interface, pod and addresses as they are now.
    fn attach(&mut self, endpoint: &crate::backend::Endpoint) -> Result<&mut Change, BackendError> {
        let owner_text = owner_comment(&endpoint.attachment)?;
        let change = self.change(endpoint.attachment.owner_id());
        let after = change.after.get_or_insert_with(Record::default);
        after.owner = owner_text;
        after.host.clone_from(&endpoint.host.name);
        after.pod.clone_from(&endpoint.pod);
        after.networks.clone_from(&endpoint.container_networks);
        Ok(change)
    }
}

impl Datapath for NftablesBackend {
    fn datapath_name(&self) -> &'static str {
        "nftables"
    }

    fn sweep_expired_state(&mut self) -> Result<(), BackendError> {
        // The kernel's connection tracking expires its own entries.
        Ok(())
    }

    fn commit_changes(&mut self) -> Result<(), BackendError> {
        let has_work = self
            .changes
            .values()
            .any(|change| change.before != change.after || change.after.is_some())
            || !self.uplinks.is_empty()
            || self.node_addresses.is_some();
        if !has_work
            || (!self.exists && !self.changes.values().any(|change| change.after.is_some()))
        {
            self.clear();
            return Ok(());
        }
        let switched_on = self.store.state().map(|state| {
            (
                state.filtered_bridges.clone(),
                state.localnet_interfaces.clone(),
            )
        });
        let reclaimed = self.apply()?;
        self.note_changes(&reclaimed);
        let mut failures = Vec::new();
        if !self.exists
            && let Some((bridges, localnet)) = switched_on
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
        self.clear();
        BackendError::collect(failures)
    }
}

impl NftablesBackend {
    /// Forgets what this operation changed, once committed (or found to change nothing).
    fn clear(&mut self) {
        self.changes.clear();
        self.uplinks.clear();
        self.sibling_sources.clear();
        self.filtered_bridges.clear();
        self.localnet_interfaces.clear();
        self.node_addresses = None;
        self.listing = std::cell::OnceCell::new();
        self.netdev_listing = std::cell::OnceCell::new();
    }
}

/// An owner text as people read it (the attachment's name), or as stored when it does not
/// parse.
fn attachment_name(owner: &str) -> String {
    // fail-closed: a record names its owner; an unreadable one is shown as stored.
    parse_owner(owner).map_or_else(|| owner.to_owned(), |attachment| attachment.to_string())
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

/// The layout of table `inet cnibpf` when it is one this build neither writes nor migrates
/// (the first layout's comment is empty): its attachments drain, and no ADD is served until the
/// last is gone.
pub fn unmigrated_layout() -> Result<Option<String>, BackendError> {
    Ok(match layout(existing_table_comment()?)? {
        TableLayout::Other(found) => Some(found),
        TableLayout::Absent | TableLayout::Current { .. } | TableLayout::Previous => None,
    })
}

/// Whether table `inet cnibpf` is at this build's layout: `Ok(())` when it is (or there is
/// none: an ADD makes it so), else which layout it has.
pub fn table_at_this_layout() -> Result<Result<(), String>, BackendError> {
    Ok(match layout(existing_table_comment()?)? {
        TableLayout::Absent | TableLayout::Current { .. } => Ok(()),
        TableLayout::Previous => Err(format!(
            "table inet cnibpf has an older layout (\"{}\"; the next ADD, DEL or GC migrates it)",
            skeleton::LAYOUT_3
        )),
        TableLayout::Other(found) => Err(format!(
            "table inet cnibpf has layout {found:?}, not this build's \"{LAYOUT}\""
        )),
    })
}

/// The layout this build writes on table `inet cnibpf`.
pub const TABLE_LAYOUT: &str = LAYOUT;
