//! Pinned eBPF state of a layout this build neither writes nor migrates: one older than the
//! supported window's (a node that skipped its releases), or a newer one (a rollback). This
//! build cannot read that layout's maps, so it adds no attachment to it — but DEL must keep
//! working (a runtime retries a failed DEL for ever, and its pod stays Terminating). What every
//! layout keeps (see `cnibpf_common::datapath::layout`) is enough to release an attachment:
//!
//! - its interface's links are unpinned, so its hooks go at once;
//! - in a newer layout, its `owners` entry is marked released (interface index 0, never a
//!   live interface): the cnibpf of that layout, when it comes back, reclaims the rest as it
//!   reclaims a vanished pod's; in an older one the entry stays as it is, and the release that
//!   migrates it reclaims it so once its interface is gone;
//! - once no attachment with a live interface is left, the whole state goes (links, programs,
//!   maps), and this build starts afresh at its own layout with the next ADD.

use std::{collections::BTreeSet, io, os::fd::AsFd as _, path::Path};

use aya::maps::MapData;
use cnibpf_common::{
    endpoints::{
        self,
        owners::{HOST_IFINDEX_OFFSET, HOST_IFNAME_OFFSET, IFNAME_LEN, NAME_LEN, STABLE_PREFIX},
    },
    filter,
};

use super::{
    batch,
    owner::read_name,
    pins::{Found, map_pinned},
    sys,
    unpin::{detach_link, detach_links, remove_tree},
};
use crate::{
    backend::{AttachmentRecord, BackendError, Draining, is_stale},
    model::Attachment,
    paths::PinLayout,
};

/// The eBPF state of a layout (or with a map of a version) this build neither writes nor
/// migrates, for DEL and GC only.
pub struct OtherLayout {
    pins: PinLayout,
    found: Found,
    /// `None` when the state has no `owners` map (a load that died before creating it): no
    /// attachment at all.
    owners: Option<RawMap>,
    /// Attachments this operation let go: none of them keeps the state in use, whatever its
    /// interface (the rest of their DEL removes it).
    leaving: BTreeSet<u64>,
}

impl OtherLayout {
    pub fn open(pins: &PinLayout, found: Found) -> Result<Self, BackendError> {
        let path = pins.map(endpoints::OWNERS.name);
        let owners = if map_pinned(pins, &path)? {
            Some(RawMap::open(&path).map_err(|source| BackendError::Pin {
                action: format!(
                    "could not open map {} of state with {found}",
                    endpoints::OWNERS.name
                ),
                source: Box::new(source),
            })?)
        } else {
            None
        };
        if let Some(owners) = &owners
            && (owners.key_size != size_of::<u64>() || owners.value_size < STABLE_PREFIX)
        {
            return Err(BackendError::ForeignState {
                path: pins.root().to_owned(),
                reason: format!(
                    "its map {} (state with {found}) has {}-byte keys and {}-byte values, not what every layout keeps",
                    endpoints::OWNERS.name,
                    owners.key_size,
                    owners.value_size
                ),
            });
        }
        Ok(Self {
            pins: pins.clone(),
            found,
            owners,
            leaving: BTreeSet::new(),
        })
    }

    fn map_error(&self, action: &str) -> impl Fn(io::Error) -> BackendError {
        let action = format!(
            "could not {action} map {} of state with {}",
            endpoints::OWNERS.name,
            self.found
        );
        move |source| BackendError::Pin {
            action: action.clone(),
            source: Box::new(source),
        }
    }

    /// Every attachment not released yet, read from the prefix every layout keeps.
    fn records(&self) -> Result<Vec<AttachmentRecord>, BackendError> {
        let mut records = Vec::new();
        let Some(owners) = &self.owners else {
            return Ok(records);
        };
        for key in owners.keys().map_err(self.map_error("list"))? {
            let Some(value) = owners.get(&key).map_err(self.map_error("read"))? else {
                continue;
            };
            let record = record_of(&key, &value);
            if record.host_ifindex != RELEASED {
                records.push(record);
            }
        }
        Ok(records)
    }

    /// Removes everything once no attachment has a live interface but those this operation let
    /// go: nothing uses the state. One that cannot be told gone counts as live.
    fn remove_if_unused(&self) -> Result<(), BackendError> {
        for record in self.records()? {
            if !self.leaving.contains(&record.owner) && !is_stale(&record)? {
                return Ok(());
            }
        }
        // The hooks go first, so that they are gone even if removing the rest fails.
        detach_links(&self.pins)?;
        remove_tree(self.pins.root())
    }
}

/// `host_ifindex` of a released attachment.
const RELEASED: u32 = 0;

fn record_of(key: &[u8], value: &[u8]) -> AttachmentRecord {
    let field = |offset: usize, length: usize| read_name(&value[offset..offset + length]);
    let mut owner = [0; 8];
    owner.copy_from_slice(key);
    let mut ifindex = [0; 4];
    ifindex.copy_from_slice(&value[HOST_IFINDEX_OFFSET..HOST_IFINDEX_OFFSET + 4]);
    AttachmentRecord {
        owner: u64::from_ne_bytes(owner),
        attachment: Attachment {
            network: field(0, NAME_LEN),
            container_id: field(NAME_LEN, NAME_LEN),
            ifname: field(2 * NAME_LEN, IFNAME_LEN),
        },
        pod: None,
        host_ifname: field(HOST_IFNAME_OFFSET, IFNAME_LEN),
        host_ifindex: u32::from_ne_bytes(ifindex),
    }
}

/// The attachments the state under `pins` records, whatever its layout: from what every
/// layout keeps of them (`found` names the state in messages).
pub(super) fn recorded_attachments(
    pins: &PinLayout,
    found: Found,
) -> Result<Vec<AttachmentRecord>, BackendError> {
    OtherLayout::open(pins, found)?.records()
}

impl Draining for OtherLayout {
    fn backend_name(&self) -> &'static str {
        "ebpf"
    }

    fn refused(&self) -> BackendError {
        let (path, found) = (self.pins.root().to_owned(), self.found);
        if found.is_newer() {
            BackendError::NewerState { path, found }
        } else {
            BackendError::OlderState { path, found }
        }
    }

    fn held(&self) -> Result<Vec<AttachmentRecord>, BackendError> {
        self.records()
    }

    /// Unhooks the attachment and, in a newer layout, marks its entry released.
    fn release(&mut self, owner: u64) -> Result<(), BackendError> {
        let key = owner.to_ne_bytes();
        let Some(owners) = &self.owners else {
            return Ok(());
        };
        let Some(mut value) = owners.get(&key).map_err(self.map_error("read"))? else {
            return Ok(());
        };
        for hook in ["from", "to"] {
            detach_link(&self.pins.endpoint_link(owner, hook))?;
        }
        self.leaving.insert(owner);
        if !self.found.is_newer() {
            // The release that takes an older layout over (the window's, which migrates it)
            // knows no released mark: it reclaims the entry as a vanished pod's once the
            // interface is gone, which the rest of this DEL sees to.
            return Ok(());
        }
        value[HOST_IFINDEX_OFFSET..HOST_IFINDEX_OFFSET + 4]
            .copy_from_slice(&RELEASED.to_ne_bytes());
        owners.set(&key, &value).map_err(self.map_error("write"))
    }

    fn commit_releases(&mut self) -> Result<(), BackendError> {
        self.remove_if_unused()
    }
}

/// A pinned hash map read and written as bytes, for a layout this build has no types for.
struct RawMap {
    data: MapData,
    key_size: usize,
    value_size: usize,
    max_entries: usize,
}

impl RawMap {
    fn open(path: &Path) -> io::Result<Self> {
        let data = MapData::from_pin(path).map_err(io::Error::other)?;
        let info = data.info().map_err(io::Error::other)?;
        Ok(Self {
            key_size: info.key_size() as usize,
            value_size: info.value_size() as usize,
            max_entries: info.max_entries() as usize,
            data,
        })
    }

    fn call(&self, command: libc::c_long, key: *const u8, value: *mut u8) -> io::Result<()> {
        // SAFETY: `key` and `value` point at buffers of the map's key and value sizes
        // (checked by the callers).
        unsafe { batch::element_command(self.data.fd().as_fd(), command, key, value, 0) }
    }

    fn keys(&self) -> io::Result<Vec<Vec<u8>>> {
        let mut keys: Vec<Vec<u8>> = Vec::new();
        // Bounded: a key removed meanwhile would restart the walk from the first.
        while keys.len() <= self.max_entries {
            let mut next = vec![0; self.key_size];
            // fail-closed: an Option (the walk's start), no error to lose.
            let current = keys.last().map_or(std::ptr::null(), |key| key.as_ptr());
            match self.call(sys::BPF_MAP_GET_NEXT_KEY, current, next.as_mut_ptr()) {
                Ok(()) => keys.push(next),
                Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(keys),
                Err(error) => return Err(error),
            }
        }
        Ok(keys)
    }

    fn get(&self, key: &[u8]) -> io::Result<Option<Vec<u8>>> {
        assert_eq!(key.len(), self.key_size, "key of the map's size");
        let mut value = vec![0; self.value_size];
        match self.call(sys::BPF_MAP_LOOKUP_ELEM, key.as_ptr(), value.as_mut_ptr()) {
            Ok(()) => Ok(Some(value)),
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(error) => Err(error),
        }
    }

    fn set(&self, key: &[u8], value: &[u8]) -> io::Result<()> {
        assert!(
            key.len() == self.key_size && value.len() == self.value_size,
            "key and value of the map's sizes"
        );
        self.call(
            sys::BPF_MAP_UPDATE_ELEM,
            key.as_ptr(),
            value.as_ptr().cast_mut(),
        )
    }
}

/// A change of one map's key or value types: an entry of map `map` at version `from` becomes
/// one of version `from + 1` (`cnibpf_common::map_spec::MapSpec::version`). Entries come as the
/// kernel has them: a per-CPU map's value is every CPU's, each rounded up to 8 bytes.
pub struct MapMigration {
    pub map: &'static str,
    pub from: u32,
    pub convert: ConvertEntry,
}

/// An entry's key and value of one version as the next version has them.
pub type ConvertEntry = fn(key: &[u8], value: &[u8]) -> (Vec<u8>, Vec<u8>);

/// The migrations of the maps whose types changed since the supported window's releases: a
/// chain from each version those releases pinned to this build's. A release before per-map
/// versions pinned every map at version 1 (layout v10). Once a map is past version 1 the stamp
/// is `layout::VERSIONED`, which such a release takes for a newer layout: a rollback to it
/// drains the state rather than misreading the map. A step goes with the window that no longer
/// needs it.
pub const MAP_MIGRATIONS: &[MapMigration] = &[MapMigration {
    map: filter::FILTERS.name,
    from: 1,
    convert: filters_with_networks,
}];

/// `filters` version 1 → 2: each rule gains the networks its source and destination must
/// belong to (none) between its masks and its index, and flags (none) in its last padding.
fn filters_with_networks(key: &[u8], value: &[u8]) -> (Vec<u8>, Vec<u8>) {
    const HEADER: usize = core::mem::offset_of!(filter::FilterSet, rules);
    const ADDRESSES: usize = core::mem::offset_of!(filter::FilterRule, src_network);
    const NETWORKS: usize = core::mem::offset_of!(filter::FilterRule, index) - ADDRESSES;
    let rule = size_of::<filter::FilterRule>();
    let mut converted = value[..HEADER].to_vec();
    for old in value[HEADER..].as_chunks::<{ filter::RULE_V1_SIZE }>().0 {
        converted.extend_from_slice(&old[..ADDRESSES]);
        converted.extend_from_slice(&[0; NETWORKS]);
        converted.extend_from_slice(&old[ADDRESSES..]);
        converted.resize(converted.len() + rule - filter::RULE_V1_SIZE - NETWORKS, 0);
    }
    (key.to_vec(), converted)
}

/// Removes what a release of the supported window left of a migration it stamped but did not
/// finish: the old maps it set aside (`layout-6-maps/`, `layout-8-maps/`, `layout-9-maps/`),
/// which the kernel keeps while they are pinned.
pub fn remove_migration_leftovers(pins: &PinLayout) -> Result<(), BackendError> {
    for from in [6, 8, 9] {
        remove_tree(&pins.root().join(format!("layout-{from}-maps")))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use cnibpf_common::endpoints::OwnerInfo;

    use super::*;
    use crate::{backend::ebpf::owner::owner_info, netlink::Link};

    #[test]
    fn a_longer_value_of_a_newer_layout_reads_by_the_stable_prefix() {
        let attachment = Attachment::new("mynet", "0123456789abcdef", "eth0");
        let host = Link {
            index: 42,
            name: "veth0a1b2c3d".to_owned(),
            kind: None,
            peer_index: None,
            master: None,
            mac: None,
        };
        let info = owner_info(&attachment, &host, None);
        // SAFETY: OwnerInfo is repr(C) plain bytes (it is aya::Pod).
        let bytes = unsafe {
            std::slice::from_raw_parts((&raw const info).cast::<u8>(), size_of::<OwnerInfo>())
        };
        let mut newer = bytes.to_vec();
        newer.extend([0xee; 64]);
        let record = record_of(&attachment.owner_id().to_ne_bytes(), &newer);
        assert_eq!(record.owner, attachment.owner_id());
        assert_eq!(record.attachment, attachment);
        assert_eq!(record.host_ifname, "veth0a1b2c3d");
        assert_eq!(record.host_ifindex, 42);
    }

    #[test]
    fn a_version_1_filter_set_converts_rule_by_rule() {
        let mut set = filter::FilterSet {
            owner: 7,
            generation: 9,
            rule_count: 2,
            default_target: filter::TARGET_DROP,
            ..filter::FilterSet::default()
        };
        for (position, rule) in set.rules.iter_mut().take(2).enumerate() {
            rule.src_addr.bytes = [position as u8 + 1; 16];
            rule.dst_mask.bytes = [0xff; 16];
            rule.index = 10 * (position as u32 + 1);
            rule.dport_low = 80;
            rule.dport_high = 90;
            rule.target = filter::TARGET_DROP;
            rule.src_prefix = 24;
            rule.dst_prefix = filter::NO_PREFIX;
        }
        // The same set as version 1 laid it out: each rule without its networks and flags.
        // SAFETY: FilterSet is repr(C) plain bytes (it is aya::Pod).
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&raw const set).cast::<u8>(),
                size_of::<filter::FilterSet>(),
            )
        };
        let header = core::mem::offset_of!(filter::FilterSet, rules);
        let mut v1 = bytes[..header].to_vec();
        for rule in bytes[header..]
            .as_chunks::<{ size_of::<filter::FilterRule>() }>()
            .0
        {
            v1.extend_from_slice(&rule[..64]);
            v1.extend_from_slice(&rule[80..100]);
        }
        assert_eq!(v1.len(), header + filter::RULE_V1_SIZE * filter::MAX_RULES);
        let (key, converted) = filters_with_networks(&[1, 0, 0, 0], &v1);
        assert_eq!(key, [1, 0, 0, 0]);
        assert_eq!(converted, bytes, "every field where version 2 has it");
    }
}
