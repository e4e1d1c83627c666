//! The eBPF backend's source check: one source set per attachment, in its host-side
//! interface's `endpoints` record (written through `EndpointMaps`, the record replaced whole so
//! that packets see the old addresses or the new ones; marked unchecked for `sourceCheck:
//! false`), and a checked one's drop counters in `source_drops`. An attachment without a set
//! was made by a cnibpf without source checks: CHECK leaves it be, its next ADD checks it. The
//! checked attachments of one container admit each other's addresses (see
//! `cnibpf_common::source`): ADD and DEL of one rewrite its siblings' sets.

use std::net::IpAddr;

use aya::maps::{MapData, PerCpuHashMap, PerCpuValues};
use cnibpf_common::{
    address::Address,
    sources::{
        self, FLAG_OWN_COUNTED, FLAG_RECORDED, FLAG_UNCHECKED, MAX_ADDRESSES, SourceDrops,
        SourceSet,
    },
};

use super::{EbpfBackend, found, map_error, open_pinned, owner::read_name, removed};
use crate::{
    backend::{BackendError, Endpoint, SourceCheckRecord, SourceChecking, fits_a_source_check},
    model::SourceCheck,
    paths::PinLayout,
};

/// The source check's own map: each checked interface's drops (its sets are in `endpoints`).
pub(super) struct SourceMaps {
    pub(super) source_drops: PerCpuHashMap<MapData, u32, SourceDrops>,
}

impl SourceMaps {
    pub(super) fn open(pins: &PinLayout) -> Result<Self, BackendError> {
        Ok(Self {
            source_drops: open_pinned(pins, sources::DROPS.name)?,
        })
    }
}

/// A checked attachment of the same container: its owner, host interface and set.
struct Sibling {
    owner: u64,
    ifindex: u32,
    set: SourceSet,
}

impl SourceChecking for EbpfBackend {
    fn setup_source_check(
        &mut self,
        endpoint: &Endpoint,
        check: Option<&SourceCheck>,
    ) -> Result<(), BackendError> {
        let owner = endpoint.attachment.owner_id();
        let ifindex = endpoint.host.index;
        let siblings = self.siblings_of(endpoint)?;
        // An attachment new to the node has no counters and no record to keep or compare.
        let new = self.endpoint.owner(owner)?.is_none();
        let Some(check) = check else {
            removed(
                self.source_check.source_drops.remove(&ifindex),
                sources::DROPS.name,
            )?;
            self.record_own_source_set(new, ifindex, &unchecked_set(owner))?;
            return self.rewrite_siblings(&siblings, None);
        };
        let sibling_owns: Vec<SourceCheck> =
            siblings.iter().map(|sibling| own(&sibling.set)).collect();
        let admitted = check.admitting(&sibling_owns);
        fits_a_source_check(&endpoint.attachment.container_id, &admitted)?;
        let wanted = stored_set(owner, check, &admitted);
        let counted = !new
            && found(
                self.source_check.source_drops.get(&ifindex, 0),
                sources::DROPS.name,
            )?
            .is_some();
        if !counted {
            let cpus = aya::util::nr_cpus().map_err(|(_, source)| BackendError::MapRead {
                name: sources::DROPS.name,
                source,
            })?;
            let zeroed = PerCpuValues::try_from(vec![SourceDrops::default(); cpus.get() as usize])
                .map_err(|source| BackendError::MapRead {
                    name: sources::DROPS.name,
                    source,
                })?;
            self.source_check
                .source_drops
                .insert(&ifindex, zeroed, 0)
                .map_err(map_error("could not write map source_drops"))?;
        }
        self.record_own_source_set(new, ifindex, &wanted)?;
        self.rewrite_siblings(&siblings, Some(check))
    }

    fn teardown_source_check(&mut self, owner: u64) -> Result<(), BackendError> {
        if let Some(info) = self.endpoint.owner(owner)? {
            let set = self.endpoint.source_set(info.host_ifindex)?;
            // Only a set that admits addresses besides its own has checked siblings to rewrite:
            // a DEL without them reads no other attachment.
            let admits_siblings = set.is_some_and(|set| {
                set.owner == owner && set.flags & FLAG_UNCHECKED == 0 && admitted(&set) != own(&set)
            });
            let siblings = if admits_siblings {
                self.siblings(&read_name(&info.container_id), owner)?
            } else {
                Vec::new()
            };
            self.remove_source_check(info.host_ifindex, Some(owner))?;
            return self.rewrite_siblings(&siblings, None);
        }
        // Not recorded (yet): an ADD undone before it recorded the attachment, or a DEL
        // repeated; the set, if any, is found by its owner.
        let held: Vec<u32> = self
            .endpoint
            .source_sets()?
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
        let owner = endpoint.attachment.owner_id();
        let Some(current) = self.endpoint.source_set(endpoint.host.index)? else {
            // Made by a cnibpf without source checks: checked from its next ADD.
            return Ok(());
        };
        let siblings = self.siblings_of(endpoint)?;
        let sibling_owns: Vec<SourceCheck> =
            siblings.iter().map(|sibling| own(&sibling.set)).collect();
        let wanted = check.map(|check| check.admitting(&sibling_owns));
        let held = (current.flags & FLAG_UNCHECKED == 0).then(|| admitted(&current));
        if current.owner == owner && held == wanted {
            return Ok(());
        }
        let described = |addresses: Option<&SourceCheck>| {
            // fail-closed: an Option of the configuration, for the message.
            addresses.map_or_else(|| "not checked".to_owned(), ToString::to_string)
        };
        Err(BackendError::CheckFailed(format!(
            "the addresses {} may send from are {}, its configuration (with its container's other interfaces) says {}",
            endpoint.attachment,
            described(held.as_ref()),
            described(wanted.as_ref())
        )))
    }
}

impl EbpfBackend {
    /// Records the attachment's own source set for its interface `ifindex` (an unchanged set
    /// stays unwritten); a `new` attachment's goes into the record `setup_endpoint` writes.
    fn record_own_source_set(
        &mut self,
        new: bool,
        ifindex: u32,
        set: &SourceSet,
    ) -> Result<(), BackendError> {
        if new {
            self.endpoint.defer_source_set(ifindex, set);
            return Ok(());
        }
        self.endpoint.record_source_set(ifindex, set)
    }

    /// The checked attachments of `endpoint`'s container other than its own; none looked for
    /// when the container has no other interface.
    fn siblings_of(&self, endpoint: &Endpoint) -> Result<Vec<Sibling>, BackendError> {
        if !endpoint.may_have_siblings {
            return Ok(Vec::new());
        }
        self.siblings(
            &endpoint.attachment.container_id,
            endpoint.attachment.owner_id(),
        )
    }

    /// The checked attachments of container `container_id` other than `owner`.
    fn siblings(&self, container_id: &str, owner: u64) -> Result<Vec<Sibling>, BackendError> {
        let mut siblings = Vec::new();
        for (sibling, info) in self.endpoint.owner_records()? {
            if sibling == owner || read_name(&info.container_id) != container_id {
                continue;
            }
            let set = self.endpoint.source_set(info.host_ifindex)?;
            if let Some(set) = set
                && set.owner == sibling
                && set.flags & FLAG_UNCHECKED == 0
            {
                siblings.push(Sibling {
                    owner: sibling,
                    ifindex: info.host_ifindex,
                    set,
                });
            }
        }
        Ok(siblings)
    }

    /// Rewrites each sibling's set to admit its own addresses and the others': those of
    /// `siblings` and `joining` (the attachment set up now; `None` when it leaves or is not
    /// checked).
    fn rewrite_siblings(
        &mut self,
        siblings: &[Sibling],
        joining: Option<&SourceCheck>,
    ) -> Result<(), BackendError> {
        let owns: Vec<SourceCheck> = siblings.iter().map(|sibling| own(&sibling.set)).collect();
        let admitting = SourceCheck::each_admitting(&owns, joining);
        for ((sibling, own), admitted) in siblings.iter().zip(&owns).zip(&admitting) {
            let wanted = stored_set(sibling.owner, own, admitted);
            if wanted != sibling.set {
                self.endpoint.record_source_set(sibling.ifindex, &wanted)?;
            }
        }
        Ok(())
    }

    /// Removes the source check of interface `ifindex` (only `owner`'s, when named).
    fn remove_source_check(
        &mut self,
        ifindex: u32,
        owner: Option<u64>,
    ) -> Result<(), BackendError> {
        let Some(current) = self.endpoint.source_set(ifindex)? else {
            return Ok(());
        };
        if owner.is_some_and(|owner| current.owner != owner) {
            return Ok(());
        }
        self.endpoint.clear_source_set(ifindex)?;
        removed(
            self.source_check.source_drops.remove(&ifindex),
            sources::DROPS.name,
        )
    }

    /// The GC sweep: source checks whose attachment is gone (its record removed by a build
    /// that knew no source check).
    pub(super) fn sweep_orphaned_source_checks(&mut self) -> Result<(), BackendError> {
        let mut orphaned = Vec::new();
        for (ifindex, set) in self.endpoint.source_sets()? {
            // Only an owner the kernel says is not recorded is gone: a failed read keeps the check.
            if self.endpoint.owner(set.owner)?.is_none() {
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
        for (ifindex, set) in self.endpoint.source_sets()? {
            if set.flags & FLAG_UNCHECKED != 0 {
                continue;
            }
            let counters = found(
                self.source_check.source_drops.get(&ifindex, 0),
                sources::DROPS.name,
            )?;
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

/// The set of an attachment whose own addresses are `own`, admitting `admitted` (its own and
/// its siblings', which the plan and `fits_a_source_check` limited to what a set holds): its
/// own first, counted.
fn stored_set(owner: u64, own: &SourceCheck, admitted: &SourceCheck) -> SourceSet {
    let mut set = SourceSet {
        owner,
        flags: FLAG_RECORDED | FLAG_OWN_COUNTED,
        ..SourceSet::default()
    };
    let others = admitted
        .addresses
        .iter()
        .filter(|address| !own.addresses.contains(address));
    for (position, address) in own.addresses.iter().chain(others).enumerate() {
        let is_own = position < own.addresses.len();
        match address {
            IpAddr::V4(v4) => {
                if let Some(slot) = set.ipv4.get_mut(set.ipv4_count as usize) {
                    *slot = v4.octets();
                    set.ipv4_count += 1;
                    set.own_ipv4_count += u16::from(is_own);
                }
            }
            IpAddr::V6(v6) => {
                if let Some(slot) = set.ipv6.get_mut(set.ipv6_count as usize) {
                    *slot = Address::from_bytes(v6.octets());
                    set.ipv6_count += 1;
                    set.own_ipv6_count += u16::from(is_own);
                }
            }
        }
    }
    set
}

/// The set of an attachment that is not checked (`sourceCheck: false`).
fn unchecked_set(owner: u64) -> SourceSet {
    SourceSet {
        owner,
        flags: FLAG_RECORDED | FLAG_UNCHECKED | FLAG_OWN_COUNTED,
        ..SourceSet::default()
    }
}

/// The attachment's own addresses in its set: the first of each family as counted, or all of
/// them in a set written before siblings were admitted.
pub(super) fn own(set: &SourceSet) -> SourceCheck {
    if set.flags & FLAG_OWN_COUNTED == 0 {
        return admitted(set);
    }
    let ipv4 = set.ipv4[..usize::from(set.own_ipv4_count).min(MAX_ADDRESSES)]
        .iter()
        .map(|octets| IpAddr::from(*octets));
    let ipv6 = set.ipv6[..usize::from(set.own_ipv6_count).min(MAX_ADDRESSES)]
        .iter()
        .map(|address| IpAddr::from(address.bytes));
    SourceCheck::new(ipv4.chain(ipv6))
}

/// The addresses a source set admits.
fn admitted(set: &SourceSet) -> SourceCheck {
    let ipv4 = set.ipv4[..(set.ipv4_count as usize).min(MAX_ADDRESSES)]
        .iter()
        .map(|octets| IpAddr::from(*octets));
    let ipv6 = set.ipv6[..(set.ipv6_count as usize).min(MAX_ADDRESSES)]
        .iter()
        .map(|address| IpAddr::from(address.bytes));
    SourceCheck::new(ipv4.chain(ipv6))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(addresses: &[&str]) -> SourceCheck {
        SourceCheck::new(addresses.iter().map(|text| text.parse::<IpAddr>().unwrap()))
    }

    #[test]
    fn a_stored_set_reads_back_as_the_check() {
        let own_check = check(&["10.22.0.2", "fd00::2", "fe80::1"]);
        let set = stored_set(7, &own_check, &own_check);
        assert_eq!((set.owner, set.ipv4_count, set.ipv6_count), (7, 1, 2));
        assert_eq!(admitted(&set), own_check);
        assert_eq!(own(&set), own_check);
    }

    #[test]
    fn a_set_admits_its_siblings_and_keeps_its_own_apart() {
        let eth0 = check(&["10.22.0.5", "fe80::5"]);
        let eth1 = check(&["10.22.0.6", "fe80::6"]);
        let set = stored_set(7, &eth0, &eth0.admitting([&eth1]));
        assert_eq!(admitted(&set), eth0.admitting([&eth1]));
        assert_eq!(own(&set), eth0, "its own, for the siblings to rebuild from");
        let older = SourceSet {
            flags: FLAG_RECORDED,
            ..stored_set(7, &eth0, &eth0)
        };
        assert_eq!(
            own(&older),
            eth0,
            "a set of an older build holds only its own"
        );
    }

    #[test]
    fn more_addresses_than_a_set_holds_are_refused() {
        let many: Vec<String> = (0..=MAX_ADDRESSES)
            .map(|host| format!("10.22.0.{host}"))
            .collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert!(fits_a_source_check("c", &check(&many[..MAX_ADDRESSES])).is_ok());
        assert!(fits_a_source_check("c", &check(&many)).is_err());
    }
}
