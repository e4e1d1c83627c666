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
mod filter;
mod host;
mod inspect;
mod listing;
mod masquerade;
mod migrate;
mod nft;
mod other_layout;
mod portmap;
mod record;
mod scrape;
mod sources;

use cnibpf_common::drop_stats::{DropCount, DropReason};
use std::{collections::BTreeMap, net::IpAddr};

use nftables::{batch::Batch, schema::NfListObject};

pub use self::host::firewall_chains;
use self::{listing::Listing, record::Record};
use super::{Access, Backend, BackendError};
use crate::{
    journal,
    model::{Attachment, Filter, HostPortAccess, Protocol, ResolvedMapping, SourceCheck},
    netlink,
};

/// nftables keeps comments of at most 128 bytes, NUL included.
const COMMENT_MAX: usize = 127;
/// The table's comment, naming the layout this build writes.
const LAYOUT: &str = "cnibpf layout 3";

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

/// The fixed part of the table. Chains: `hostports`, run from prerouting and from output (host
/// processes), hands conditioned hostPorts to their attachment's `c_` chain and everything else
/// to `hostports_dnat` (DNAT by exact hostIP, then by port for any local address, 127.0.0.1
/// included for host processes; `localnet_guard` drops what arrives from elsewhere for
/// 127.0.0.0/8, as kube-proxy does against CVE-2020-8558); `postrouting` masquerades host
/// processes reaching a hostPort through 127.0.0.1 and hands DNATed traffic (by destination)
/// and traffic leaving by an uplink (by source) to the container's `n_` chain, which
/// masquerades hairpin traffic (a container reaching a container of its own subnet through a
/// hostPort) and its masqueraded traffic; `forward`, `input` and `local_out` let what passes
/// every filter through (replies, related errors, IPv6 neighbour and listener control,
/// `icmpv6_control`) and hand the rest of a container's traffic to its filter chains.
/// Sets `filtered_bridges` and `localnet_interfaces` name the interfaces whose settings cnibpf
/// switched on, to switch them off with the table.
const SKELETON: &str = r#"
add table inet cnibpf { comment "cnibpf layout 3"; }
add set inet cnibpf attachments { type ifname; }
add set inet cnibpf uplinks { type ifname; }
add set inet cnibpf filtered_bridges { type ifname; }
add set inet cnibpf localnet_interfaces { type ifname; }
add map inet cnibpf hostports4 { type ipv4_addr . inet_proto . inet_service : ipv4_addr . inet_service; }
add map inet cnibpf hostports4_any { type inet_proto . inet_service : ipv4_addr . inet_service; }
add map inet cnibpf hostports6 { type ipv6_addr . inet_proto . inet_service : ipv6_addr . inet_service; }
add map inet cnibpf hostports6_any { type inet_proto . inet_service : ipv6_addr . inet_service; }
add set inet cnibpf specific_ports4 { type inet_proto . inet_service; }
add set inet cnibpf specific_ports6 { type inet_proto . inet_service; }
add map inet cnibpf conditions4 { type ipv4_addr . inet_proto . inet_service : verdict; }
add map inet cnibpf conditions4_any { type inet_proto . inet_service : verdict; }
add map inet cnibpf conditions6 { type ipv6_addr . inet_proto . inet_service : verdict; }
add map inet cnibpf conditions6_any { type inet_proto . inet_service : verdict; }
add map inet cnibpf filter_out4 { type ipv4_addr : verdict; }
add map inet cnibpf filter_in4 { type ipv4_addr : verdict; }
add map inet cnibpf filter_out6 { type ipv6_addr : verdict; }
add map inet cnibpf filter_in6 { type ipv6_addr : verdict; }
add chain inet cnibpf hostports
add chain inet cnibpf hostports_dnat
add chain inet cnibpf localnet_guard { type filter hook prerouting priority raw; policy accept; }
add chain inet cnibpf prerouting { type nat hook prerouting priority dstnat; policy accept; }
add chain inet cnibpf output { type nat hook output priority -100; policy accept; }
add chain inet cnibpf postrouting { type nat hook postrouting priority srcnat; policy accept; }
add chain inet cnibpf forward { type filter hook forward priority filter; policy accept; }
add chain inet cnibpf input { type filter hook input priority filter; policy accept; }
add chain inet cnibpf local_out { type filter hook output priority filter; policy accept; }
add rule inet cnibpf hostports ip daddr . meta l4proto . th dport vmap @conditions4
add rule inet cnibpf hostports fib daddr type local meta l4proto . th dport vmap @conditions4_any
add rule inet cnibpf hostports ip6 daddr . meta l4proto . th dport vmap @conditions6
add rule inet cnibpf hostports ip6 daddr != ::1 fib daddr type local meta l4proto . th dport vmap @conditions6_any
add rule inet cnibpf hostports goto hostports_dnat
add rule inet cnibpf hostports_dnat meta l4proto { tcp, udp, sctp } dnat ip to ip daddr . meta l4proto . th dport map @hostports4
add rule inet cnibpf hostports_dnat fib daddr type local meta l4proto { tcp, udp, sctp } dnat ip to meta l4proto . th dport map @hostports4_any
add rule inet cnibpf hostports_dnat meta l4proto { tcp, udp, sctp } dnat ip6 to ip6 daddr . meta l4proto . th dport map @hostports6
add rule inet cnibpf hostports_dnat ip6 daddr != ::1 fib daddr type local meta l4proto { tcp, udp, sctp } dnat ip6 to meta l4proto . th dport map @hostports6_any
add rule inet cnibpf prerouting jump hostports
add rule inet cnibpf output jump hostports
"#;

/// The rule of chain `localnet_guard`, counted. Tables made before it was counted hold it
/// without the counter and comment: the first ADD that meets one replaces it.
const LOCALNET_GUARD: &str = r#"
flush chain inet cnibpf localnet_guard
add rule inet cnibpf localnet_guard iifname != "lo" ip daddr 127.0.0.0/8 counter drop comment "drop reason localnet_guard"
"#;
const LOCALNET_GUARD_COMMENT: &str = "drop reason localnet_guard";
const LOCALNET_GUARD_CHAIN: &str = "localnet_guard";

/// The shared objects layout 3 added to layout 2's (see `migrate`).
const LAYOUT_3_OBJECTS: &str = r#"
add map inet cnibpf nat4 { type ipv4_addr : verdict; }
add map inet cnibpf nat6 { type ipv6_addr : verdict; }
add set inet cnibpf icmpv6_control { type icmpv6_type; elements = { nd-router-solicit, nd-router-advert, nd-neighbor-solicit, nd-neighbor-advert, nd-redirect, mld-listener-query, mld-listener-report, mld-listener-done, mld2-listener-report }; }
"#;

/// The rules of the hook chains `postrouting`, `forward`, `input` and `local_out` (the chains
/// layout 3 rewrote, see `migrate`).
const HOOK_RULES: &str = r#"
add rule inet cnibpf postrouting ip saddr 127.0.0.0/8 ct status dnat masquerade
add rule inet cnibpf postrouting ct status dnat ip daddr vmap @nat4
add rule inet cnibpf postrouting ct status dnat ip6 daddr vmap @nat6
add rule inet cnibpf postrouting oifname @uplinks ip saddr vmap @nat4
add rule inet cnibpf postrouting oifname @uplinks ip6 saddr vmap @nat6
add rule inet cnibpf forward ct direction reply accept
add rule inet cnibpf forward ct state related accept
add rule inet cnibpf forward icmpv6 type @icmpv6_control accept
add rule inet cnibpf input ct direction reply accept
add rule inet cnibpf input ct state related accept
add rule inet cnibpf input icmpv6 type @icmpv6_control accept
add rule inet cnibpf local_out ct direction reply accept
add rule inet cnibpf local_out ct state related accept
add rule inet cnibpf local_out icmpv6 type @icmpv6_control accept
add rule inet cnibpf forward ip saddr vmap @filter_out4
add rule inet cnibpf forward ip daddr vmap @filter_in4
add rule inet cnibpf forward ip6 saddr vmap @filter_out6
add rule inet cnibpf forward ip6 daddr vmap @filter_in6
add rule inet cnibpf input ip saddr vmap @filter_out4
add rule inet cnibpf input ip6 saddr vmap @filter_out6
add rule inet cnibpf local_out ip daddr vmap @filter_in4
add rule inet cnibpf local_out ip6 daddr vmap @filter_in6
"#;

/// What table `inet cnibpf` is to this build.
enum TableLayout {
    Absent,
    /// This build's layout: created so, or migrated (marked by chain `layout_3`).
    Current,
    /// The layout this build migrates from.
    Previous,
    /// Any other: its comment (empty for layout 1, which had none).
    Other(String),
}

/// The layout of the table whose comment (`None`: no table) is `comment`.
fn layout_of(comment: Option<String>) -> Result<TableLayout, NftablesError> {
    Ok(match comment {
        None => TableLayout::Absent,
        Some(comment) if comment == LAYOUT => TableLayout::Current,
        Some(comment) if comment == migrate::PREVIOUS => {
            if host::has_chain(migrate::MARKER)? {
                TableLayout::Current
            } else {
                TableLayout::Previous
            }
        }
        Some(comment) => TableLayout::Other(comment),
    })
}

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

/// Removes the kernel's tracked connections to the hostPorts of `changed`.
fn forget_connections(changed: &[ResolvedMapping]) -> Result<(), BackendError> {
    if changed.is_empty() || !conntrack::tracking_any().map_err(NftablesError::Conntrack)? {
        return Ok(());
    }
    let addresses = host_addresses()?;
    conntrack::forget(changed, &addresses)
        .map(drop)
        .map_err(|error| NftablesError::Conntrack(error).into())
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

/// The host's addresses, loopback included: where a wildcard hostPort's connections went.
fn host_addresses() -> Result<Vec<IpAddr>, BackendError> {
    let mut addresses: Vec<IpAddr> = netlink::addresses()
        .map_err(|source| BackendError::HostAddresses(Box::new(source)))?
        .into_iter()
        .map(|(_, addr)| addr)
        .collect();
    addresses.extend([
        IpAddr::from([127, 0, 0, 1]),
        IpAddr::from(std::net::Ipv6Addr::LOCALHOST),
    ]);
    Ok(addresses)
}

/// The text form of an attachment kept in comments; refused when it does not fit one.
fn owner_comment(attachment: &Attachment) -> Result<String, NftablesError> {
    let text = format!(
        "{}/{}/{}",
        attachment.network, attachment.ifname, attachment.container_id
    );
    if text.len() > COMMENT_MAX {
        return Err(NftablesError::OwnerTooLong(text));
    }
    Ok(text)
}

fn parse_owner(comment: &str) -> Option<Attachment> {
    let mut parts = comment.splitn(3, '/');
    let (network, ifname, container_id) = (parts.next()?, parts.next()?, parts.next()?);
    Some(Attachment::new(network, container_id, ifname))
}

/// The suffix of an address's family in set names: `4` or `6`.
fn family_suffix(ipv4: bool) -> char {
    if ipv4 { '4' } else { '6' }
}

/// The chains of an attachment: its record, its conditions, its filter (out, in).
/// The drop reasons the nftables datapath counts, each at zero: what it reports lists every
/// one, counted or not (what the kernel's own connection tracking and NAT drop is the
/// kernel's to count).
fn counted_drops() -> BTreeMap<DropReason, DropCount> {
    [
        DropReason::FilterRule,
        DropReason::FilterDefault,
        DropReason::SourceCheckAddress,
        DropReason::SourceCheckArp,
        DropReason::SourceCheckNeighbourAdvertisement,
        DropReason::SourceCheckNotIp,
        DropReason::LocalnetGuard,
    ]
    .into_iter()
    .map(|reason| (reason, DropCount::default()))
    .collect()
}

/// Adds (packets, bytes) to `reason`'s count in `drops`.
fn add_drops(
    drops: &mut BTreeMap<DropReason, DropCount>,
    reason: DropReason,
    (packets, bytes): (u64, u64),
) {
    let count = drops.entry(reason).or_default();
    count.packets += packets;
    count.bytes += bytes;
}

fn record_chain(owner: u64) -> String {
    format!("a_{owner:016x}")
}

fn conditions_chain(owner: u64) -> String {
    format!("c_{owner:016x}")
}

fn nat_chain(owner: u64) -> String {
    format!("n_{owner:016x}")
}

fn filter_chains(owner: u64) -> [String; 2] {
    [format!("f_{owner:016x}_out"), format!("f_{owner:016x}_in")]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_round_trip_through_comments_and_long_ones_are_refused() {
        let attachment = Attachment::new("net-a", "0123456789abcdef", "eth0");
        let comment = owner_comment(&attachment).expect("fits");
        assert_eq!(comment, "net-a/eth0/0123456789abcdef");
        assert_eq!(parse_owner(&comment), Some(attachment));
        let long = Attachment::new(&"n".repeat(100), &"c".repeat(64), "eth0");
        assert!(matches!(
            owner_comment(&long),
            Err(NftablesError::OwnerTooLong(_))
        ));
    }
}
