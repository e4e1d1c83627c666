//! Tables of layouts 2 and 3, whose records lived in the table itself (the comments of each
//! attachment's chain `a_<owner>`), migrated to this layout under the instance lock with every
//! attachment's traffic flowing: the records, the filters' rules and the hostPort conditions
//! are read back from the table into the state file, then the table is replaced by one made
//! from it, in one transaction (`restore`). Connection tracking keeps each connection's
//! translation, so no connection notices; the filters' counters start again.
//!
//! Layout 2 tables (`cnibpf layout 2`, without chain `layout_3`) began each filter chain with
//! what passes every filter, rules without a comment; layout 3 (`cnibpf layout 3`, or a
//! migrated `cnibpf layout 2` with chain `layout_3`) kept it in the hook chains. Both keep the
//! records in the same lines (`comments`).

mod comments;

use super::{
    NftablesError,
    filter::{filter_of, filter_of_layout_2},
    host,
    listing::Listing,
    portmap::conditions_of,
    restore::{self, Cause, Counters},
    skeleton::LAYOUT_2,
    store::{OwnerId, Store},
};
use crate::{backend::BackendError, journal};

pub use comments::RecordError;

/// The chain a `cnibpf layout 2` table migrated to layout 3 carries.
const LAYOUT_3_MARKER: &str = "layout_3";

/// Migrates table `inet cnibpf` of layout 2 or 3 to this layout: its records into `store`
/// (a new state), then the table made anew from them. Whether the table exists now.
pub fn migrate(store: &mut Store) -> Result<bool, BackendError> {
    let comment = host::table_comment()
        .map_err(NftablesError::Netlink)?
        // fail-closed: a table gone since it was looked at leaves nothing to migrate.
        .unwrap_or_default();
    let layout_2 = comment == LAYOUT_2 && !host::has_chain(LAYOUT_3_MARKER)?;
    // fail-closed: `read` kept the errors; no table lists nothing.
    let listing = Listing::read()?.unwrap_or_default();
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
            let filter = if layout_2 {
                filter_of_layout_2(&listing, owner)?
            } else {
                filter_of(&listing, owner)?
            };
            record.filter = filter.map(|held| held.filter);
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

/// The record chains of a table of layout 2 or 3: `a_<owner id>`.
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
