//! Table `inet cnibpf` of a layout this build neither writes nor migrates — one older than
//! layout 3 (see `compat`) or a newer one (a rollback) — or one of this layout whose
//! state file is missing. This build adds nothing to it, but DEL and GC must keep working (a runtime
//! retries a failed DEL for ever). Every layout keeps an attachment's parts findable
//! the same way: elements whose comment is its `<network>/<ifname>/<container id>`, chains
//! whose name holds its owner id in hex, and its host interface as an element of
//! `attachments`. That is enough to remove an attachment whole; with the last one the table
//! goes, and this build starts afresh at its own layout with the next ADD.

use std::{collections::BTreeSet, path::PathBuf};

use nftables::{batch::Batch, expr::Expression, schema::NfListObject};

use super::super::{NftablesError, host, listing::Listing, nft, parse_owner};
use crate::{
    backend::{AttachmentRecord, BackendError, Draining, GONE_IFINDEX},
    netlink,
};

/// Why a table is only drained.
pub enum Refusal {
    /// Another layout: the table's comment (empty for the first layout, which had none).
    Layout(String),
    /// This layout, without its state file (at this path).
    StateMissing(PathBuf),
}

pub struct OtherLayout {
    refusal: Refusal,
    listing: Listing,
    /// Owners whose parts this operation removes.
    leaving: BTreeSet<u64>,
}

impl OtherLayout {
    pub fn open(refusal: Refusal) -> Result<Self, BackendError> {
        Ok(Self {
            refusal,
            // fail-closed: `read` kept the errors; no table lists nothing.
            listing: Listing::read()?.unwrap_or_default(),
            leaving: BTreeSet::new(),
        })
    }

    /// Every owner text in the table, with its attachment's owner id.
    fn owners(&self) -> Vec<(u64, String)> {
        let texts: BTreeSet<&str> = self.listing.element_comments().collect();
        texts
            .into_iter()
            .filter_map(|text| Some((parse_owner(text)?.owner_id(), text.to_owned())))
            .collect()
    }

    fn owner_text(&self, owner: u64) -> Option<String> {
        self.owners()
            .into_iter()
            .find_map(|(id, text)| (id == owner).then_some(text))
    }

    fn host_interface(&self, owner_text: &str) -> Option<String> {
        self.listing
            .owned_by(owner_text)
            .find_map(|(set, element)| match (&element.key, set) {
                (Expression::String(name), "attachments") => Some(name.to_string()),
                _ => None,
            })
    }

    /// Deletes the parts of every leaving owner, or the whole table once no owner is left.
    fn batch(&self) -> Batch<'static> {
        let mut batch = Batch::new();
        let staying = self
            .owners()
            .into_iter()
            .any(|(owner, _)| !self.leaving.contains(&owner));
        if !staying {
            // The interface settings it switched on are switched off after it, in `commit`.
            batch.delete(NfListObject::Table(nftables::schema::Table {
                family: nft::FAMILY,
                name: nft::TABLE.into(),
                handle: None,
            }));
            return batch;
        }
        for owner in &self.leaving {
            let Some(text) = self.owner_text(*owner) else {
                continue;
            };
            for (set, element) in self.listing.owned_by(&text) {
                batch.delete(nft::elements(set, vec![element.key.clone()]));
            }
            let id = format!("{owner:016x}");
            for chain in self.listing.chain_names().filter(|name| name.contains(&id)) {
                batch.delete(nft::chain(chain));
            }
        }
        batch
    }
}

impl Draining for OtherLayout {
    fn backend_name(&self) -> &'static str {
        "nftables"
    }

    fn refused(&self) -> BackendError {
        match &self.refusal {
            Refusal::Layout(found) => NftablesError::Layout {
                found: found.clone(),
            },
            Refusal::StateMissing(path) => NftablesError::StateMissing { path: path.clone() },
        }
        .into()
    }

    fn held(&self) -> Result<Vec<AttachmentRecord>, BackendError> {
        let mut held = Vec::new();
        for (owner, text) in self.owners() {
            if self.leaving.contains(&owner) {
                continue;
            }
            let Some(attachment) = parse_owner(&text) else {
                continue;
            };
            // An attachment whose interface the table does not name has no interface to
            // outlive: it is as gone as one whose interface the kernel says is gone.
            let host_ifname = self.host_interface(&text);
            let host_ifindex = match &host_ifname {
                Some(name) => netlink::index_of(name)
                    .map_err(|source| BackendError::Interface {
                        action: format!("could not look up interface {name} of {attachment}"),
                        source: Box::new(source),
                    })?
                    // fail-closed: `index_of` kept the errors; only a gone interface gets here.
                    .unwrap_or(GONE_IFINDEX),
                None => GONE_IFINDEX,
            };
            held.push(AttachmentRecord {
                owner,
                attachment,
                pod: None,
                // fail-closed: an Option of the listing (see above).
                host_ifname: host_ifname.unwrap_or_default(),
                host_ifindex,
            });
        }
        Ok(held)
    }

    /// The attachment leaves whole with the commit.
    fn release(&mut self, owner: u64) -> Result<(), BackendError> {
        if self.owner_text(owner).is_some() {
            self.leaving.insert(owner);
        }
        Ok(())
    }

    fn commit_releases(&mut self) -> Result<(), BackendError> {
        if self.leaving.is_empty() {
            return Ok(());
        }
        let settings = ["filtered_bridges", "localnet_interfaces"].map(|set| {
            self.listing
                .elements(set)
                .iter()
                .filter_map(|element| match &element.key {
                    Expression::String(name) => Some(name.to_string()),
                    _ => None,
                })
                .collect::<Vec<_>>()
        });
        nft::apply(self.batch())?;
        if host::table_comment()
            .map_err(NftablesError::Netlink)?
            .is_none()
        {
            let [bridges, localnet] = settings;
            host::restore(&bridges, &localnet)?;
        }
        self.leaving.clear();
        // fail-closed: as above.
        self.listing = Listing::read()?.unwrap_or_default();
        Ok(())
    }
}
