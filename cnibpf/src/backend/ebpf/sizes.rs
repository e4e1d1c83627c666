//! The sizes of the datapath's maps, set at load from the operator's [`Capacity`], and the
//! resize of a live datapath.
//!
//! Hash maps are preallocated: a map's `max_entries` is the kernel memory it locks, whatever it
//! holds. Each sized map follows one dimension of the capacity (flows, attachments, hostPorts),
//! scaled; every other map has the size the object declares. A dimension the operator does not
//! name keeps the sizes pinned (a network without the key never undoes what another network or
//! `cnibpf load` set), and a map the pinned state lacks follows its dimension's first map.
//!
//! A resize, under the instance lock, while the pods' traffic flows:
//!
//! 1. the object loads with each resized map created new, pinned in `resize/` (the maps kept
//!    are reused; the programs, pinned over the old ones, use the new maps);
//! 2. every entry of each old map is copied into its new one;
//! 3. every pinned link moves to the new programs (atomic per link);
//! 4. what the old programs wrote between 2 and 3 is copied too, never over what the new ones
//!    wrote since (`BPF_NOEXIST`);
//! 5. each new map's pin replaces the old one's; `resize/` goes; the layout is stamped (the
//!    programs may have been another build's).
//!
//! A run that finds `resize/` resumes at 1 with the maps pinned there (their sizes are the
//! record of what the interrupted run asked for); a map already moved in 5 is the new one.

use std::{fs, io, path::Path};

use aya::{
    Pod,
    maps::{HashMap, Map, MapData, MapError, PerCpuHashMap},
};
use cnibpf_common::{
    connection::{self, Connection, ConnectionKey},
    endpoint::{self, EndpointInfo},
    filter::{self, FilterSet},
    filter_hits::{self, FilterHits},
    fragment::{self, FirstFragment, FragmentKey},
    masq_reply::{self, MasqReply, ReplyKey},
    masq_source::{self, MasqSource, MasqSourceKey},
    owner::{self, OwnerInfo},
    owner_port::{self, OwnerPortKey},
    port_claim::{self, PortClaim, PortClaimKey},
    port_condition::{self, PortConditions, PortConditionsKey},
    portmap::{self, PortMapKey, PortMapValue},
    sock_rev::{self, SockRevKey, SockRevValue},
    source_drop::{self, SourceDrops},
};

use super::{
    EbpfBackend, batch, map_error,
    pins::{MapSize, load_object, map_pinned, relink, remove_tree, stamp},
};
use crate::{
    backend::{Backend as _, BackendError},
    journal,
    model::{Capacity, Dimension},
    paths::PinLayout,
};

/// How a map's size follows its dimension's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scale {
    Times(u32),
    /// A fraction, never below [`MIN_SCALED`].
    Over(u32),
}

/// The smallest size a fraction of a dimension gives.
const MIN_SCALED: u32 = 64;

impl Scale {
    fn entries(self, dimension_size: u32) -> u32 {
        match self {
            Self::Times(factor) => dimension_size.saturating_mul(factor),
            Self::Over(divisor) => (dimension_size / divisor).max(MIN_SCALED),
        }
    }
}

/// A map sized from the capacity, and how to count and carry over its entries.
struct SizedMap {
    name: &'static str,
    dimension: Dimension,
    scale: Scale,
    entries: fn(&Path) -> Result<usize, BackendError>,
    copy: fn(&Path, &Path) -> Result<(), BackendError>,
}

macro_rules! sized {
    ($module:ident, $dimension:ident, $scale:expr, hash < $key:ty, $value:ty >) => {
        SizedMap {
            name: $module::MAP_NAME,
            dimension: Dimension::$dimension,
            scale: $scale,
            entries: count_hash::<$key, $value>,
            copy: copy_hash::<$key, $value>,
        }
    };
    ($module:ident, $dimension:ident, $scale:expr, per_cpu < $key:ty, $value:ty >) => {
        SizedMap {
            name: $module::MAP_NAME,
            dimension: Dimension::$dimension,
            scale: $scale,
            entries: count_per_cpu::<$key, $value>,
            copy: copy_per_cpu::<$key, $value>,
        }
    };
}

/// Every sized map; the first of each dimension is its measure (`Times(1)`): `masq_replies`
/// for the flows, a map every layout has, so that a datapath migrated from one that had other
/// connection tables keeps its size. Fragments are
/// short-lived (a datagram's reassembly), socket translations a share of the flows; an
/// attachment has a masquerade source and a set of conditions per family.
const SIZED_MAPS: [SizedMap; 14] = [
    sized!(masq_reply, Flows, Scale::Times(1), hash<ReplyKey, MasqReply>),
    sized!(connection, Flows, Scale::Times(1), hash<ConnectionKey, Connection>),
    sized!(fragment, Flows, Scale::Over(8), hash<FragmentKey, FirstFragment>),
    sized!(sock_rev, Flows, Scale::Over(4), hash<SockRevKey, SockRevValue>),
    sized!(owner, Attachments, Scale::Times(1), hash<u64, OwnerInfo>),
    sized!(endpoint, Attachments, Scale::Times(1), hash<u32, EndpointInfo>),
    sized!(source_drop, Attachments, Scale::Times(1), per_cpu<u32, SourceDrops>),
    sized!(filter, Attachments, Scale::Times(1), hash<u32, FilterSet>),
    sized!(filter_hits, Attachments, Scale::Times(1), per_cpu<u32, FilterHits>),
    sized!(masq_source, Attachments, Scale::Times(2), hash<MasqSourceKey, MasqSource>),
    sized!(port_condition, Attachments, Scale::Times(2), hash<PortConditionsKey, PortConditions>),
    sized!(portmap, HostPorts, Scale::Times(1), hash<PortMapKey, PortMapValue>),
    sized!(owner_port, HostPorts, Scale::Times(1), hash<OwnerPortKey, PortMapKey>),
    sized!(port_claim, HostPorts, Scale::Times(1), hash<PortClaimKey, PortClaim>),
];

/// The map a dimension is measured by: its first, which holds one entry per unit.
fn measure(dimension: Dimension) -> &'static SizedMap {
    SIZED_MAPS
        .iter()
        .find(|map| map.dimension == dimension && map.scale == Scale::Times(1))
        .expect("every dimension has a map of scale 1 (see SIZED_MAPS)")
}

/// The dimension's size a datapath created with `capacity` has.
fn dimension_size(capacity: &Capacity, dimension: Dimension, pinned: &Pinned) -> u32 {
    capacity
        .get(dimension)
        .or_else(|| pinned.size(measure(dimension).name))
        // fail-closed: Options of sizes already read; neither asked nor pinned is the default.
        .unwrap_or_else(|| dimension.default_size())
}

/// The sizes of the maps as pinned (`None`: not pinned).
#[derive(Clone, Debug, Default)]
struct Pinned(Vec<(&'static str, Option<u32>)>);

impl Pinned {
    fn size(&self, name: &str) -> Option<u32> {
        self.0
            .iter()
            .find(|(pinned, _)| *pinned == name)
            .and_then(|(_, size)| *size)
    }
}

/// What each sized map is to be: its dimension's size, scaled, where the operator named the
/// dimension; else its pinned size; else (a map not pinned yet) its dimension's, scaled.
fn plan(capacity: &Capacity, pinned: &Pinned) -> Vec<MapSize> {
    SIZED_MAPS
        .iter()
        .map(|map| {
            let wanted = map
                .scale
                .entries(dimension_size(capacity, map.dimension, pinned));
            let entries = match (capacity.get(map.dimension), pinned.size(map.name)) {
                (None, Some(size)) => size,
                _ => wanted,
            };
            MapSize {
                name: map.name,
                entries,
                resized: pinned.size(map.name).is_some_and(|size| size != entries),
            }
        })
        .collect()
}

fn pin_error(action: String) -> impl FnOnce(io::Error) -> BackendError {
    move |source| BackendError::Pin {
        action,
        source: Box::new(source),
    }
}

/// The `max_entries` of the map pinned at `path`, `None` when nothing is.
fn pinned_size(pins: &PinLayout, path: &Path) -> Result<Option<u32>, BackendError> {
    if !map_pinned(pins, path)? {
        return Ok(None);
    }
    let data = MapData::from_pin(path).map_err(|source| BackendError::Map {
        action: format!("could not open map {}", path.display()),
        source: Box::new(source),
    })?;
    let info = data.info().map_err(|source| BackendError::Map {
        action: format!("could not read the size of map {}", path.display()),
        source: Box::new(source),
    })?;
    Ok(Some(info.max_entries()))
}

fn read_pinned(pins: &PinLayout) -> Result<Pinned, BackendError> {
    SIZED_MAPS
        .iter()
        .map(|map| Ok((map.name, pinned_size(pins, &pins.map(map.name))?)))
        .collect::<Result<_, _>>()
        .map(Pinned)
}

/// The sizes to load the object with: what is pinned, and `capacity` for what is not. For a
/// load that creates the datapath or adds to it (an upgrade), never one that resizes.
pub(super) fn for_load(
    pins: &PinLayout,
    capacity: &Capacity,
) -> Result<Vec<MapSize>, BackendError> {
    let pinned = read_pinned(pins)?;
    Ok(plan(capacity, &pinned)
        .into_iter()
        .map(|mut size| {
            if let Some(entries) = pinned.size(size.name) {
                size.entries = entries;
            }
            size.resized = false;
            size
        })
        .collect())
}

/// Resizes the pinned maps to what `capacity` asks, if any differs (see the module's steps):
/// whether it did. Refused, before anything changes, when a map holds more live entries than
/// its new size would.
pub(super) fn resize(pins: &PinLayout, capacity: &Capacity) -> Result<bool, BackendError> {
    if *capacity == Capacity::default() {
        return Ok(false);
    }
    let sizes = plan(capacity, &read_pinned(pins)?);
    if !sizes.iter().any(|size| size.resized) {
        return Ok(false);
    }
    // Expired flows are no reason to refuse a smaller table.
    EbpfBackend::open_maps(pins)?.sweep_expired()?;
    for (map, size) in SIZED_MAPS.iter().zip(&sizes) {
        if !size.resized {
            continue;
        }
        let held = (map.entries)(&pins.map(map.name))?;
        if held > size.entries as usize {
            return Err(BackendError::CapacityTooSmall {
                key: map.dimension.key(),
                // fail-closed: an Option of the request; a resized map's dimension was named.
                size: capacity.get(map.dimension).unwrap_or(size.entries),
                map: map.name,
                held,
                entries: size.entries,
            });
        }
    }
    let dir = pins.resize_dir();
    fs::create_dir_all(&dir).map_err(pin_error(format!("could not create {}", dir.display())))?;
    journal::note(journal::Change::Migrated(format!(
        "resizing maps: {}",
        describe(&sizes)
    )));
    carry_over(pins, &sizes)?;
    Ok(true)
}

/// Finishes a resize a crash interrupted, with the maps it left in `resize/`: whether there
/// was one (its programs are then this build's).
pub(super) fn resume(pins: &PinLayout) -> Result<bool, BackendError> {
    let dir = pins.resize_dir();
    if !dir
        .try_exists()
        .map_err(pin_error(format!("could not look for {}", dir.display())))?
    {
        return Ok(false);
    }
    let mut sizes = for_load(pins, &Capacity::default())?;
    for size in &mut sizes {
        if let Some(entries) = pinned_size(pins, &pins.resized_map(size.name))? {
            size.entries = entries;
            size.resized = true;
        }
    }
    journal::note(journal::Change::Migrated(format!(
        "resuming a resize: {}",
        describe(&sizes)
    )));
    carry_over(pins, &sizes).map(|()| true)
}

fn describe(sizes: &[MapSize]) -> String {
    let resized: Vec<String> = sizes
        .iter()
        .filter(|size| size.resized)
        .map(|size| format!("{} to {}", size.name, size.entries))
        .collect();
    if resized.is_empty() {
        "no map left to resize".to_owned()
    } else {
        resized.join(", ")
    }
}

/// Steps 1 to 5 for the maps marked `resized`.
fn carry_over(pins: &PinLayout, sizes: &[MapSize]) -> Result<(), BackendError> {
    load_object(pins, sizes)?;
    let copy_all = || -> Result<(), BackendError> {
        for (map, size) in SIZED_MAPS.iter().zip(sizes) {
            if size.resized {
                (map.copy)(&pins.map(map.name), &pins.resized_map(map.name))?;
            }
        }
        Ok(())
    };
    copy_all()?;
    relink(pins)?;
    copy_all()?;
    for size in sizes.iter().filter(|size| size.resized) {
        let (new, old) = (pins.resized_map(size.name), pins.map(size.name));
        fs::rename(&new, &old).map_err(pin_error(format!(
            "could not move map {} into place",
            size.name
        )))?;
    }
    journal::note(journal::Change::Migrated(
        "resized maps moved into place".to_owned(),
    ));
    remove_tree(&pins.resize_dir())?;
    stamp(pins)
}

fn open<T: TryFrom<Map, Error = MapError>>(path: &Path) -> Result<T, BackendError> {
    let error = |source| BackendError::Map {
        action: format!("could not open map {}", path.display()),
        source: Box::new(source),
    };
    let data = MapData::from_pin(path).map_err(error)?;
    T::try_from(Map::from_map_data(data).map_err(error)?).map_err(error)
}

/// An insert with `BPF_NOEXIST` into the map at `to`: meeting an entry already there (the new
/// programs wrote it, or a resumed run copied it) is no failure.
fn unless_there(inserted: Result<(), MapError>, to: &Path) -> Result<(), BackendError> {
    match inserted {
        Err(MapError::SyscallError(call)) if call.io_error.raw_os_error() == Some(libc::EEXIST) => {
            Ok(())
        }
        other => other.map_err(map_error(&format!("could not write map {}", to.display()))),
    }
}

/// `BPF_NOEXIST`: an insert that leaves an existing entry alone.
const NO_EXIST: u64 = 1;

fn count_hash<K: Pod + Default, V: Pod + Default>(path: &Path) -> Result<usize, BackendError> {
    let map: HashMap<MapData, K, V> = open(path)?;
    batch::entries(&map)
        .map(|entries| entries.len())
        .map_err(|source| BackendError::Pin {
            action: format!("could not read map {}", path.display()),
            source: Box::new(source),
        })
}

fn copy_hash<K: Pod + Default, V: Pod + Default>(
    from: &Path,
    to: &Path,
) -> Result<(), BackendError> {
    let old: HashMap<MapData, K, V> = open(from)?;
    let mut new: HashMap<MapData, K, V> = open(to)?;
    let entries = batch::entries(&old).map_err(|source| BackendError::Pin {
        action: format!("could not read map {}", from.display()),
        source: Box::new(source),
    })?;
    for (key, value) in entries {
        unless_there(new.insert(&key, &value, NO_EXIST), to)?;
    }
    Ok(())
}

fn count_per_cpu<K: Pod, V: Pod>(path: &Path) -> Result<usize, BackendError> {
    let map: PerCpuHashMap<MapData, K, V> = open(path)?;
    let mut held = 0;
    for key in map.keys() {
        key.map_err(map_error(&format!("could not read map {}", path.display())))?;
        held += 1;
    }
    Ok(held)
}

fn copy_per_cpu<K: Pod, V: Pod>(from: &Path, to: &Path) -> Result<(), BackendError> {
    let old: PerCpuHashMap<MapData, K, V> = open(from)?;
    let mut new: PerCpuHashMap<MapData, K, V> = open(to)?;
    for entry in old.iter() {
        let (key, values) =
            entry.map_err(map_error(&format!("could not read map {}", from.display())))?;
        unless_there(new.insert(&key, values, NO_EXIST), to)?;
    }
    Ok(())
}

/// What the pinned datapath holds room for, and the kernel memory its maps lock.
#[derive(Clone, Debug)]
pub struct Memory {
    /// Each dimension's size, as its first map has it.
    pub capacity: Capacity,
    pub maps: usize,
    pub bytes: u64,
}

/// The `memlock` the kernel reports for the map behind `fd` (what it charges for it).
fn memlock(fd: i32) -> io::Result<u64> {
    let info = fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))?;
    info.lines()
        .find_map(|line| line.strip_prefix("memlock:"))
        // fail-closed: a value that does not parse is reported below as missing.
        .and_then(|value| value.trim().parse().ok())
        .ok_or_else(|| io::Error::other("no memlock in the map's fdinfo"))
}

/// [`Memory`] of the datapath pinned under `pins`.
pub fn memory(pins: &PinLayout) -> Result<Memory, BackendError> {
    use std::os::fd::{AsFd as _, AsRawFd as _};

    let root = pins.root();
    let read_error = |source| BackendError::UnreadableState {
        path: root.to_owned(),
        source,
    };
    let pinned = read_pinned(pins)?;
    let size = |dimension| pinned.size(measure(dimension).name);
    let capacity = Capacity {
        flows: size(Dimension::Flows),
        attachments: size(Dimension::Attachments),
        host_ports: size(Dimension::HostPorts),
    };
    let (mut maps, mut bytes) = (0, 0);
    for entry in fs::read_dir(root).map_err(read_error)? {
        let entry = entry.map_err(read_error)?;
        // Maps are the files; programs, links and a resize's maps have directories.
        if !entry.file_type().map_err(read_error)?.is_file() {
            continue;
        }
        let path = entry.path();
        let data = MapData::from_pin(&path).map_err(|source| BackendError::Map {
            action: format!("could not open map {}", path.display()),
            source: Box::new(source),
        })?;
        bytes += memlock(data.fd().as_fd().as_raw_fd()).map_err(|source| BackendError::Pin {
            action: format!("could not read the memory of map {}", path.display()),
            source: Box::new(source),
        })?;
        maps += 1;
    }
    Ok(Memory {
        capacity,
        maps,
        bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sizes a datapath created with `capacity` has, by map.
    fn created_with(capacity: &Capacity) -> Vec<(&'static str, u32)> {
        plan(capacity, &Pinned::default())
            .into_iter()
            .map(|size| (size.name, size.entries))
            .collect()
    }

    fn pinned(sizes: &[(&'static str, u32)]) -> Pinned {
        Pinned(
            SIZED_MAPS
                .iter()
                .map(|map| {
                    let size = sizes
                        .iter()
                        .find(|(name, _)| *name == map.name)
                        .map(|(_, size)| *size);
                    (map.name, size)
                })
                .collect(),
        )
    }

    #[test]
    fn every_dimension_has_its_measure() {
        for dimension in Dimension::ALL {
            assert_eq!(measure(dimension).dimension, dimension);
        }
    }

    #[test]
    fn the_object_declares_the_default_sizes() {
        let declared = [
            (masq_reply::MAP_NAME, masq_reply::MAX_ENTRIES),
            (connection::MAP_NAME, connection::MAX_ENTRIES),
            (fragment::MAP_NAME, fragment::MAX_ENTRIES),
            (sock_rev::MAP_NAME, sock_rev::MAX_ENTRIES),
            (owner::MAP_NAME, owner::MAX_ENTRIES),
            (endpoint::MAP_NAME, endpoint::MAX_ENTRIES),
            (source_drop::MAP_NAME, source_drop::MAX_ENTRIES),
            (filter::MAP_NAME, filter::MAX_ENTRIES),
            (filter_hits::MAP_NAME, filter_hits::MAX_ENTRIES),
            (masq_source::MAP_NAME, masq_source::MAX_ENTRIES),
            (port_condition::MAP_NAME, port_condition::MAX_ENTRIES),
            (portmap::MAP_NAME, portmap::MAX_ENTRIES),
            (owner_port::MAP_NAME, owner_port::MAX_ENTRIES),
            (port_claim::MAP_NAME, port_claim::MAX_ENTRIES),
        ];
        assert_eq!(created_with(&Capacity::default()), declared);
    }

    #[test]
    fn a_named_dimension_sizes_its_maps_and_only_those_are_resized() {
        let pinned = pinned(&[
            (connection::MAP_NAME, 262_144),
            (masq_reply::MAP_NAME, 262_144),
            (sock_rev::MAP_NAME, 65_536),
            (owner::MAP_NAME, 16_384),
            (masq_source::MAP_NAME, 16_384),
        ]);
        let capacity = Capacity {
            flows: Some(65_536),
            ..Capacity::default()
        };
        let sizes = plan(&capacity, &pinned);
        let size = |name: &str| sizes.iter().find(|size| size.name == name).expect(name);
        assert_eq!(size(connection::MAP_NAME).entries, 65_536);
        assert!(size(connection::MAP_NAME).resized);
        assert_eq!(size(sock_rev::MAP_NAME).entries, 16_384);
        assert!(size(sock_rev::MAP_NAME).resized);
        assert_eq!(size(fragment::MAP_NAME).entries, 8_192);
        assert!(!size(fragment::MAP_NAME).resized, "not pinned: created");
        // Attachments were not named: pinned maps keep their size (even one that is not what
        // the scale says), a missing one follows the pinned measure.
        assert_eq!(size(owner::MAP_NAME).entries, 16_384);
        assert_eq!(size(masq_source::MAP_NAME).entries, 16_384);
        assert_eq!(size(port_condition::MAP_NAME).entries, 32_768);
        assert!(!sizes[4..].iter().any(|size| size.resized));
        // Host ports: nothing pinned, nothing named: the default.
        assert_eq!(size(portmap::MAP_NAME).entries, 16_384);
    }

    #[test]
    fn fractions_of_the_smallest_dimension_keep_a_floor() {
        let capacity = Capacity {
            flows: Some(256),
            ..Capacity::default()
        };
        let sizes = created_with(&capacity);
        let size = |name: &str| sizes.iter().find(|(map, _)| *map == name).expect(name).1;
        assert_eq!(size(fragment::MAP_NAME), MIN_SCALED);
        assert_eq!(size(sock_rev::MAP_NAME), 64);
    }
}
