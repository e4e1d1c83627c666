//! The nftables backend's compatibility. A table of layout 3 (the supported window's), whose
//! records lived in the table itself (the comments of each attachment's chain `a_<owner>`), is
//! migrated to this layout under the instance lock with every attachment's traffic flowing:
//! the records, the filters' rules and the hostPort conditions are read back from the table
//! into the state file (`comments`), then the table is replaced by one made from it, in one
//! transaction (`restore`). Connection tracking keeps each connection's translation, so no
//! connection notices; the filters' counters are carried over. A table of any other layout is
//! drained (`other_layout`).

mod comments;
pub mod other_layout;

use super::{
    NftablesError,
    filter::filter_of,
    host,
    listing::Counters,
    listing::Listing,
    portmap::conditions_of,
    restore::{self, Cause},
    skeleton,
    store::{OwnerId, Store},
};
use crate::{backend::BackendError, journal};

pub use comments::RecordError;

/// Migrates table `inet cnibpf` of layout 3 to this layout: its records into `store` (a new
/// state), then the table made anew from them. Whether the table exists now.
pub fn migrate(store: &mut Store) -> Result<bool, BackendError> {
    let comment = host::table_comment()
        .map_err(NftablesError::Netlink)?
        // fail-closed: a table gone since it was looked at leaves nothing to migrate.
        .unwrap_or_default();
    // The table as it is now, which is not always what the caller saw: a run killed after it
    // handed its transaction to `nft` does not take `nft` with it, and the transaction may land
    // after the next run looked at the table. Its records are read only from a table that
    // still has them.
    let Some(listing) = Listing::read()? else {
        // Gone since (a firewall reload): the records a run before this one read, if any, stand.
        return restore::restore(store, Cause::TableGone, &Counters::default());
    };
    if let Some(instance) = skeleton::marked_instance(listing.set_names()) {
        // Migrated since, from the records a run before this one wrote.
        restore::belongs_together(store, instance)?;
        journal::note(journal::Change::Migrated(format!(
            "nftables {comment:?}: migrated meanwhile by an earlier run's transaction"
        )));
        return Ok(true);
    }
    let mut state = store.state_or_new()?;
    state.attachments.clear();
    for (owner, chain) in record_chains(&listing) {
        let lines = listing
            .rules(&chain)
            .iter()
            .filter_map(|rule| rule.comment.as_deref());
        let read =
            comments::CommentRecord::parse(lines).map_err(|source| NftablesError::Record {
                chain: chain.clone(),
                source,
            })?;
        let mut record = read.record;
        if read.filtered {
            record.filter = filter_of(&listing, owner)?.map(|held| held.filter);
        }
        if read.conditioned_v4 || read.conditioned_v6 {
            let [v4, v6] = conditions_of(&listing, owner)?;
            (record.conditions_v4, record.conditions_v6) = (v4, v6);
        }
        state.attachments.insert(OwnerId(owner), record);
    }
    for (set, list) in [
        ("uplinks", &mut state.uplinks),
        ("filtered_bridges", &mut state.filtered_bridges),
        ("localnet_interfaces", &mut state.localnet_interfaces),
    ] {
        *list = listing
            .elements(set)
            .iter()
            .filter_map(|element| match &element.key {
                nftables::expr::Expression::String(name) => Some(name.to_string()),
                _ => None,
            })
            .collect();
    }
    state.service_interfaces = crate::config::DEFAULT_SERVICE_INTERFACES
        .iter()
        .map(|name| (*name).to_owned())
        .collect();
    let count = state.attachments.len();
    store.save(Some(state))?;
    journal::note(journal::Change::Migrated(format!(
        "nftables {comment:?}: {count} attachments' records read into {}",
        store.path().display()
    )));
    restore::restore(store, Cause::Migrated, &Counters::of(&listing))
}

/// The record chains of a table of layout 3: `a_<owner id>`.
fn record_chains(listing: &Listing) -> Vec<(u64, String)> {
    listing
        .chain_names()
        .filter_map(|chain| {
            // fail-closed: decoding a chain name; one not named a_<owner> is no record.
            let owner = u64::from_str_radix(chain.strip_prefix("a_")?, 16).ok()?;
            Some((owner, chain.to_owned()))
        })
        .collect()
}
