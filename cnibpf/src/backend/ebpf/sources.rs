//! The eBPF backend's source check: one `sources` element per attachment (keyed by its
//! host-side interface, replaced whole so that packets see the old addresses or the new ones;
//! marked unchecked for `sourceCheck: false`) and a checked one's drop counters in
//! `source_drops`. An attachment without an element was made by a cnibpf without source
//! checks: CHECK leaves it be, its next ADD checks it.

use std::net::IpAddr;

use aya::maps::PerCpuValues;
use cnibpf_common::{
    owner as owner_map,
    source::{self, FLAG_UNCHECKED, MAX_ADDRESSES, SourceSet},
    source_drop::{self, SourceDrops},
};

use super::{EbpfBackend, batch, found, map_error, read_error, remove_entry, removed};
use crate::{
    backend::{BackendError, Endpoint, SourceCheckRecord, SourceChecking},
    model::SourceCheck,
};

impl SourceChecking for EbpfBackend {
    fn setup_source_check(
        &mut self,
        endpoint: &Endpoint,
        check: Option<&SourceCheck>,
    ) -> Result<(), BackendError> {
        let ifindex = endpoint.host.index;
        let wanted = stored_set(endpoint.attachment.owner_id(), check);
        if check.is_none() {
            removed(self.source_drops.remove(&ifindex), source_drop::MAP_NAME)?;
            return self
                .sources
                .insert(&ifindex, &wanted, 0)
                .map_err(map_error("could not write map sources"));
        }
        let counted = found(self.source_drops.get(&ifindex, 0), source_drop::MAP_NAME)?.is_some();
        if counted && found(self.sources.get(&ifindex, 0), source::MAP_NAME)? == Some(wanted) {
            return Ok(());
        }
        if !counted {
            let cpus = aya::util::nr_cpus().map_err(|(_, source)| BackendError::MapRead {
                name: source_drop::MAP_NAME,
                source,
            })?;
            let zeroed = PerCpuValues::try_from(vec![SourceDrops::default(); cpus.get() as usize])
                .map_err(|source| BackendError::MapRead {
                    name: source_drop::MAP_NAME,
                    source,
                })?;
            self.source_drops
                .insert(&ifindex, zeroed, 0)
                .map_err(map_error("could not write map source_drops"))?;
        }
        self.sources
            .insert(&ifindex, &wanted, 0)
            .map_err(map_error("could not write map sources"))
    }

    fn teardown_source_check(&mut self, owner: u64) -> Result<(), BackendError> {
        if let Some(info) = found(self.owners.get(&owner, 0), owner_map::MAP_NAME)? {
            return self.remove_source_check(info.host_ifindex, Some(owner));
        }
        // Not recorded (yet): an ADD undone before it recorded the attachment, or a DEL
        // repeated; the element, if any, is found by its owner.
        let held: Vec<u32> = batch::entries(&self.sources)
            .map_err(read_error(source::MAP_NAME))?
            .into_iter()
            .filter(|(_, set)| set.owner == owner)
            .map(|(ifindex, _)| ifindex)
            .collect();
        for ifindex in held {
            self.remove_source_check(ifindex, Some(owner))?;
        }
        Ok(())
    }

    fn check_source_check(
        &self,
        endpoint: &Endpoint,
        check: Option<&SourceCheck>,
    ) -> Result<(), BackendError> {
        let Some(current) = found(self.sources.get(&endpoint.host.index, 0), source::MAP_NAME)?
        else {
            // Made by a cnibpf without source checks: checked from its next ADD.
            return Ok(());
        };
        if current == stored_set(endpoint.attachment.owner_id(), check) {
            return Ok(());
        }
        let described = |set: &SourceSet| {
            if set.flags & FLAG_UNCHECKED != 0 {
                "not checked".to_owned()
            } else {
                admitted(set).to_string()
            }
        };
        Err(BackendError::CheckFailed(format!(
            "the addresses {} may send from are {}, its configuration says {}",
            endpoint.attachment,
            described(&current),
            // fail-closed: an Option of the configuration, for the message.
            check.map_or_else(|| "not checked".to_owned(), ToString::to_string)
        )))
    }
}

impl EbpfBackend {
    /// Removes the source check of interface `ifindex` (only `owner`'s, when named).
    fn remove_source_check(
        &mut self,
        ifindex: u32,
        owner: Option<u64>,
    ) -> Result<(), BackendError> {
        let Some(current) = found(self.sources.get(&ifindex, 0), source::MAP_NAME)? else {
            return Ok(());
        };
        if owner.is_some_and(|owner| current.owner != owner) {
            return Ok(());
        }
        remove_entry(&mut self.sources, &ifindex, source::MAP_NAME)?;
        removed(self.source_drops.remove(&ifindex), source_drop::MAP_NAME)
    }

    /// The GC sweep: source checks whose attachment is gone (its record removed by a build
    /// that knew no source check).
    pub(super) fn sweep_orphaned_source_checks(&mut self) -> Result<(), BackendError> {
        let mut orphaned = Vec::new();
        for (ifindex, set) in batch::entries(&self.sources).map_err(read_error(source::MAP_NAME))? {
            // Only an owner the kernel says is not recorded is gone: a failed read keeps the check.
            if found(self.owners.get(&set.owner, 0), owner_map::MAP_NAME)?.is_none() {
                orphaned.push(ifindex);
            }
        }
        for ifindex in orphaned {
            self.remove_source_check(ifindex, None)?;
        }
        Ok(())
    }

    pub(super) fn source_check_records(
        &self,
    ) -> Result<Vec<(u64, SourceCheckRecord)>, BackendError> {
        let mut records = Vec::new();
        for (ifindex, set) in batch::entries(&self.sources).map_err(read_error(source::MAP_NAME))? {
            if set.flags & FLAG_UNCHECKED != 0 {
                continue;
            }
            let counters = found(self.source_drops.get(&ifindex, 0), source_drop::MAP_NAME)?;
            let dropped = counters
                .iter()
                .flat_map(|per_cpu| per_cpu.iter())
                .fold((0, 0), |(packets, bytes), drops| {
                    (packets + drops.packets, bytes + drops.bytes)
                });
            records.push((
                set.owner,
                SourceCheckRecord {
                    check: admitted(&set),
                    dropped,
                },
            ));
        }
        Ok(records)
    }
}

/// The `sources` element of `check` (whose addresses per family the plan limited to what an
/// element holds); `None`: unchecked.
fn stored_set(owner: u64, check: Option<&SourceCheck>) -> SourceSet {
    let mut set = SourceSet {
        owner,
        ..SourceSet::default()
    };
    let Some(check) = check else {
        set.flags = FLAG_UNCHECKED;
        return set;
    };
    for address in &check.addresses {
        match address {
            IpAddr::V4(v4) => {
                if let Some(slot) = set.ipv4.get_mut(set.ipv4_count as usize) {
                    *slot = v4.octets();
                    set.ipv4_count += 1;
                }
            }
            IpAddr::V6(v6) => {
                if let Some(slot) = set.ipv6.get_mut(set.ipv6_count as usize) {
                    *slot = v6.octets();
                    set.ipv6_count += 1;
                }
            }
        }
    }
    set
}

/// The addresses a `sources` element admits.
fn admitted(set: &SourceSet) -> SourceCheck {
    let ipv4 = set.ipv4[..(set.ipv4_count as usize).min(MAX_ADDRESSES)]
        .iter()
        .map(|octets| IpAddr::from(*octets));
    let ipv6 = set.ipv6[..(set.ipv6_count as usize).min(MAX_ADDRESSES)]
        .iter()
        .map(|octets| IpAddr::from(*octets));
    SourceCheck::new(ipv4.chain(ipv6))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_set_reads_back_as_the_check() {
        let check =
            SourceCheck::new(["10.22.0.2", "fd00::2", "fe80::1"].map(|text| text.parse().unwrap()));
        let set = stored_set(7, Some(&check));
        assert_eq!((set.owner, set.ipv4_count, set.ipv6_count), (7, 1, 2));
        assert_eq!(admitted(&set), check);
    }
}
