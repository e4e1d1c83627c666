//! The tables made again from the state file, whole, in one transaction: after a firewall
//! reload took them (`nft flush ruleset`), and when an older layout's table is replaced. An
//! attachment whose host interface is gone is not made again: it is gone (its pod's network
//! namespace went), and its record goes, as `gc --stale` would take it.

use std::collections::BTreeMap;

use nftables::batch::Batch;

use super::{
    Change, NftablesError, elements, host,
    listing::Counters,
    members, nflog, nft, parse_owner,
    record::Sources,
    store::{State, Store},
};
use crate::{
    backend::{BackendError, node_addresses},
    journal,
    model::SourceCheck,
    netlink,
};

/// Why the tables are made again.
#[derive(Clone, Copy, Debug)]
pub enum Cause {
    /// Table `inet cnibpf` is gone (a firewall reload flushed the ruleset).
    TableGone,
    /// Table `netdev cnibpf`, with the source checks and the masquerade guard, is gone.
    NetdevTableGone,
    /// The table is of an older layout, migrated into the state file.
    Migrated,
}

impl Cause {
    fn describe(self) -> &'static str {
        match self {
            Self::TableGone => "table inet cnibpf was gone (a firewall reload?)",
            Self::NetdevTableGone => "table netdev cnibpf was gone (a firewall reload?)",
            Self::Migrated => "an older layout's table was migrated",
        }
    }
}

/// Makes both tables anew from `store`'s state, replacing what is there, in one transaction,
/// each rule's counter starting where `counters` says (a migrated table's); then writes the
/// state as made (gone attachments out, the node's addresses as they are now). Whether the
/// tables exist now (not when no attachment is left).
pub fn restore(store: &mut Store, cause: Cause, counters: &Counters) -> Result<bool, BackendError> {
    let mut state = store.state_or_new()?;
    let gone = reclaim_gone(&mut state)?;
    let addresses: Vec<_> = node_addresses(&state.service_interfaces)?
        .into_iter()
        .map(|(_, addr)| addr)
        .collect();
    state.node_addresses = addresses;
    let mut deletions = Batch::new();
    if host::table_comment()
        .map_err(NftablesError::Netlink)?
        .is_some()
    {
        deletions.delete(nftables::schema::NfListObject::Table(
            nftables::schema::Table {
                family: nft::FAMILY,
                name: nft::TABLE.into(),
                handle: None,
            },
        ));
    }
    if host::has_netdev_table()? {
        super::sources::delete_table(&mut deletions);
    }
    let mut additions = Batch::new();
    let mut made = Vec::new();
    if !state.attachments.is_empty() {
        add_shared(&mut additions, &state);
        members::add_sets(&mut additions, &members::needed(&state));
        let log_group = nflog::group_of(state.instance);
        for (owner, change) in changes_of(&state) {
            elements::add(&mut additions, owner, &change, log_group);
        }
        made = super::hooks::table_with(state.instance, super::hooks::Hooks::of(&state));
        made.extend(super::guard::hook_changes(
            &[],
            &super::guard::hooked(&state),
        ));
        made.extend(nft::commands(additions)?);
        counters.seed(&mut made);
    }
    nft::apply_parts(vec![nft::commands(deletions)?, made])?;
    let kept = state.attachments.len();
    store.save((!state.attachments.is_empty()).then_some(state))?;
    journal::note(journal::Change::Restored(format!(
        "{}: {kept} attachments made again from {}{}",
        cause.describe(),
        store.path().display(),
        if gone.is_empty() {
            String::new()
        } else {
            format!(", {} gone with their interfaces", gone.len())
        }
    )));
    for name in gone {
        journal::note(journal::Change::Reclaimed(name));
    }
    Ok(kept > 0)
}

/// Takes the attachments whose host interface is gone out of `state`: their names.
fn reclaim_gone(state: &mut State) -> Result<Vec<String>, BackendError> {
    let mut gone = Vec::new();
    let mut kept = BTreeMap::new();
    for (key, record) in std::mem::take(&mut state.attachments) {
        let index = netlink::index_of(&record.host).map_err(|source| BackendError::Interface {
            action: format!(
                "could not tell whether interface {} of {} still exists",
                record.host, record.owner
            ),
            source: Box::new(source),
        })?;
        if index.is_some() {
            kept.insert(key, record);
        } else {
            gone.push(super::attachment_name(&record.owner));
        }
    }
    state.attachments = kept;
    Ok(gone)
}

/// The shared sets' elements `state` records.
fn add_shared(batch: &mut Batch<'static>, state: &State) {
    let shared = [
        ("uplinks", &state.uplinks),
        ("filtered_bridges", &state.filtered_bridges),
        ("localnet_interfaces", &state.localnet_interfaces),
    ];
    for (set, names) in shared {
        if !names.is_empty() {
            batch.add(nft::elements(set, names.iter().map(nft::text).collect()));
        }
    }
    elements::replace_node_addresses(batch, &state.node_addresses);
}

/// Every attachment of `state` as a change that adds it whole, its source check admitting its
/// siblings' addresses (the container's other checked attachments).
fn changes_of(state: &State) -> Vec<(u64, Change)> {
    let records: Vec<(u64, &super::Record)> = state
        .attachments
        .iter()
        .map(|(owner, record)| (owner.0, record))
        .collect();
    let container_of = |record: &super::Record| {
        parse_owner(&record.owner).map(|attachment| attachment.container_id)
    };
    records
        .iter()
        .map(|(owner, record)| {
            let siblings: Vec<SourceCheck> = records
                .iter()
                .filter(|(other, sibling)| {
                    other != owner && container_of(sibling) == container_of(record)
                })
                .filter_map(|(_, sibling)| match &sibling.sources {
                    Sources::Checked(check) => Some(check.clone()),
                    _ => None,
                })
                .collect();
            let admitted = match &record.sources {
                Sources::Checked(check) if !siblings.is_empty() => Some(check.admitting(&siblings)),
                _ => None,
            };
            let change = Change {
                before: None,
                after: Some((*record).clone()),
                admitted,
                kept_counters: None,
            };
            (*owner, change)
        })
        .collect()
}

/// Whether `store` is the state the table named `instance` was made from: a table without its
/// state, or with another's (two instances in one network namespace, or a state file left from
/// another table), is never changed on a guess.
pub fn belongs_together(store: &Store, instance: u64) -> Result<(), NftablesError> {
    match store.state() {
        Some(state) if state.instance == instance => Ok(()),
        Some(state) => Err(NftablesError::ForeignState {
            path: store.path().to_owned(),
            table: instance,
            state: state.instance,
        }),
        None => Err(NftablesError::StateMissing {
            path: store.path().to_owned(),
        }),
    }
}

/// Whether an attachment has a source check or a masquerade guard that table `netdev
/// cnibpf`, now gone, held.
pub fn netdev_table_gone(store: &Store) -> Result<bool, NftablesError> {
    let held = store.records().any(|(_, record)| {
        matches!(record.sources, Sources::Checked(_)) || record.masquerade.is_some()
    });
    Ok(held && !host::has_netdev_table()?)
}
