//! One operation's transaction: the state after it, the batch that gets the table there, and
//! its application — the state file written before it (a record never says less than the
//! table holds) and after it; a refused transaction looked into (a part someone else removed,
//! a hostPort another holds, one whose holder is gone and is reclaimed).

use nftables::{batch::Batch, schema::NfListObject};

use super::{
    NftablesBackend, NftablesError, attachment_name, elements, guard,
    hooks::{self, Hooks},
    host,
    listing::Listing,
    members, nflog, nft, sources,
    store::{OwnerId, State},
};
use crate::{
    backend::{Backend, BackendError},
    journal,
    model::ResolvedMapping,
    netlink,
};

impl NftablesBackend {
    /// The state after this operation: every change's next record, the interfaces it recorded.
    pub(super) fn next_state(&self) -> Result<State, NftablesError> {
        let mut state = self.store.state_or_new()?;
        for (owner, change) in &self.changes {
            match &change.after {
                Some(record) => {
                    state.attachments.insert(OwnerId(*owner), record.clone());
                }
                None => {
                    state.attachments.remove(&OwnerId(*owner));
                }
            }
        }
        let recorded = [
            (&mut state.uplinks, &self.uplinks),
            (&mut state.filtered_bridges, &self.filtered_bridges),
            (&mut state.localnet_interfaces, &self.localnet_interfaces),
        ];
        for (list, names) in recorded {
            for name in names {
                if !list.contains(name) {
                    list.push(name.clone());
                }
            }
        }
        if let Some((service_interfaces, addresses)) = &self.node_addresses {
            state.service_interfaces.clone_from(service_interfaces);
            state.node_addresses.clone_from(addresses);
        }
        Ok(state)
    }

    /// The batch of this operation, after `batch`'s commands: what each change removes, then
    /// what it adds; with the table's removal when the last attachment leaves. `before` is the
    /// state the table was made from; `listing`, the table as listed when it may differ.
    fn batch(
        &self,
        mut batch: Batch<'static>,
        specific: Option<&Listing>,
        next: &State,
        before: &State,
        listing: Option<&Listing>,
    ) -> Result<Batch<'static>, BackendError> {
        if next.attachments.is_empty() {
            delete_tables(&mut batch)?;
            return Ok(batch);
        }
        members::add_sets(&mut batch, &members::needed(next));
        if self.exists {
            members::backfill(&mut batch, next, &members::present()?);
        }
        let kept_members = members::all(next);
        for (owner, change) in &self.changes {
            elements::remove(&mut batch, *owner, change, specific, &kept_members);
        }
        let log_group = nflog::group_of(next.instance);
        for (owner, change) in &self.changes {
            elements::add(&mut batch, *owner, change, log_group);
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
        if let Some((_, addresses)) = &self.node_addresses {
            elements::replace_node_addresses(&mut batch, addresses);
        }
        members::delete_unneeded(&mut batch, before, next, listing);
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
    pub(super) fn changed_mappings(&self) -> Vec<ResolvedMapping> {
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
    fn apply_from_listing(&mut self, next: &State, before: &State) -> Result<(), BackendError> {
        // fail-closed: `read` kept the errors; no table lists nothing.
        let listing = Listing::read()?.unwrap_or_default();
        // fail-closed: as above.
        let netdev = Listing::read_netdev()?.unwrap_or_default();
        let mut hooks = Vec::new();
        if !next.attachments.is_empty() {
            hooks = hooks::hook_changes(Hooks::of_listing(&listing), Hooks::of(next));
            hooks.extend(guard::hook_changes(
                &guard::hooked_in(&netdev),
                &guard::hooked(next),
            ));
        }
        let mut removals = Batch::new();
        for (owner, change) in &mut self.changes {
            let text = change
                .before
                .as_ref()
                .or(change.after.as_ref())
                .map(|record| record.owner.clone());
            if let Some(text) = text {
                elements::remove_listed(&mut removals, *owner, &text, &listing, &netdev);
            }
            change.before = None;
        }
        Ok(nft::apply_after(
            hooks,
            self.batch(removals, Some(&listing), next, before, Some(&listing))?,
        )?)
    }

    /// The attachments this operation removes.
    fn leaving(&self) -> Vec<u64> {
        self.changes
            .iter()
            .filter(|(_, change)| change.after.is_none())
            .map(|(owner, _)| *owner)
            .collect()
    }

    /// Tells the journal what the committed transaction did: the hostPorts attachments
    /// released, the holders in `reclaimed` removed.
    pub(super) fn note_changes(&self, reclaimed: &[u64]) {
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
                journal::note(journal::Change::Reclaimed(attachment_name(&before.owner)));
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
                for (holder, _) in listing.holders_of(*owner, mapping) {
                    let Some(record) = self.store.record(holder) else {
                        continue;
                    };
                    if leaving.contains(&holder) {
                        continue;
                    }
                    let gone = netlink::index_of(&record.host)
                        .map_err(|source| BackendError::Interface {
                            action: format!(
                                "could not tell whether interface {} of the holder of {mapping} still exists",
                                record.host
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
        let leaving = self.leaving();
        for (owner, change) in &self.changes {
            for mapping in change.after.iter().flat_map(|record| &record.mappings) {
                let holder = listing
                    .holders_of(*owner, mapping)
                    .into_iter()
                    .find(|(holder, _)| !leaving.contains(holder));
                if let Some((holder, attachment)) = holder {
                    return Ok(Some(BackendError::HostPortInUse {
                        mapping: mapping.host_side(),
                        holder: Box::new(attachment),
                        pod: self
                            .store
                            .record(holder)
                            .and_then(|record| record.pod.clone()),
                    }));
                }
            }
        }
        Ok(None)
    }

    /// Applies this operation's transaction, with the state file written before it — the
    /// records of what it adds, and still of what it removes — and after it: a record never
    /// says less than the table holds. A hostPort held by an attachment whose interface is gone
    /// is reclaimed, as many as there are, before a holder is named.
    pub(super) fn apply(&mut self) -> Result<Vec<u64>, BackendError> {
        let mut next = self.next_state()?;
        let mut intent = next.clone();
        for (owner, change) in &self.changes {
            if let (None, Some(before)) = (&change.after, &change.before) {
                intent.attachments.insert(OwnerId(*owner), before.clone());
            }
        }
        let before = self.store.state().cloned();
        self.store.save(Some(intent))?;
        let refused = |applied: &Result<(), BackendError>, why: &str| matches!(applied, Err(BackendError::Nftables(NftablesError::Refused(text))) if text.contains(why));
        // fail-closed: no state before is no attachment, whose table holds nothing of theirs.
        let made_from = before.clone().unwrap_or_default();
        let mut applied = self.attempt(self.first_commands(&made_from, &next), &next, &made_from);
        if refused(&applied, "No such file or directory") && self.exists {
            applied = self.apply_from_listing(&next, &made_from);
        }
        let mut reclaimed = Vec::new();
        while refused(&applied, "File exists") && self.exists {
            let Some(stale) = self.stale_holder()? else {
                break;
            };
            Backend::remove(self, stale)?;
            reclaimed.push(stale);
            next = self.next_state()?;
            applied = self.attempt(self.first_commands(&made_from, &next), &next, &made_from);
        }
        if refused(&applied, "File exists")
            && let Some(holder) = self.holder_error()?
        {
            applied = Err(holder);
        }
        if let Err(error) = applied {
            return Err(match self.store.save(before) {
                Ok(()) => error,
                Err(undo) => BackendError::UndoFailed {
                    failed: Box::new(error),
                    undo: Box::new(undo.into()),
                },
            });
        }
        let emptied = next.attachments.is_empty();
        self.store.save((!emptied).then_some(next))?;
        self.exists = !emptied;
        Ok(reclaimed)
    }

    /// What an attempt at the transaction starts with: a table this operation makes comes with
    /// its skeleton; an existing one gets the hooks `next` needs and loses those it no longer
    /// does, `before` being the state the tables were made from (they go whole with the last
    /// attachment).
    fn first_commands(&self, before: &State, next: &State) -> Vec<serde_json::Value> {
        if next.attachments.is_empty() {
            return Vec::new();
        }
        let (mut commands, guarded_before) = if self.exists {
            (
                hooks::hook_changes(Hooks::of(before), Hooks::of(next)),
                guard::hooked(before),
            )
        } else {
            (
                hooks::table_with(next.instance, Hooks::of(next)),
                Vec::new(),
            )
        };
        commands.extend(guard::hook_changes(&guarded_before, &guard::hooked(next)));
        commands
    }

    /// One attempt at the transaction: `first` (the skeleton of a table this operation makes),
    /// then this operation's batch.
    fn attempt(
        &self,
        first: Vec<serde_json::Value>,
        next: &State,
        before: &State,
    ) -> Result<(), BackendError> {
        let specific = if self.needs_specific() && self.exists {
            Listing::read_specific()?
        } else {
            None
        };
        let batch = self.batch(Batch::new(), specific.as_ref(), next, before, None)?;
        Ok(nft::apply_after(first, batch)?)
    }
}

/// Deletes table `inet cnibpf`, and table `netdev cnibpf` when there is one.
fn delete_tables(batch: &mut Batch<'static>) -> Result<(), BackendError> {
    batch.delete(NfListObject::Table(nftables::schema::Table {
        family: nft::FAMILY,
        name: nft::TABLE.into(),
        handle: None,
    }));
    if host::has_netdev_table()? {
        sources::delete_table(batch);
    }
    Ok(())
}
