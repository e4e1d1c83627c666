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
//! 5. each new map's pin replaces the old one's; the layout is stamped (the programs may
//!    have been another build's); `resize/` goes.
//!
//! A run that finds `resize/` resumes at 1 with the maps pinned there (their sizes are the
//! record of what the interrupted run asked for); a map already moved in 5 is the new one.
//!
//! A map's migration to this build's version of its types (`layout`) is the same carry-over,
//! each entry converted as it is copied. `map_versions` keeps naming the versions the maps in
//! place had until step 5 is over, and `resize/moving` says step 5 began: a resumed run
//! converts every map of an older version before it, and after it those still in `resize/`
//! (the others are in place, converted).

use std::{fs, io, path::Path};

use aya::maps::MapData;
use cnibpf_common::map_spec::{MapSpec, Sizing};

use super::{
    EbpfBackend, batch,
    layout::{self, Migration, Verdict},
    pins::{MapSize, load_object, map_pinned, relink, stamp},
    unpin::remove_tree,
};
use crate::{
    backend::{Backend as _, BackendError},
    journal,
    model::{Capacity, Dimension},
    paths::PinLayout,
};

/// Every map sized from the capacity, by its spec's [`Sizing`].
fn sized_maps() -> impl Iterator<Item = &'static MapSpec> {
    cnibpf_common::maps().filter(|spec| spec.sizing != Sizing::Fixed)
}

/// The map a dimension is measured by (its spec's [`Sizing::Measure`]): one entry per unit,
/// in every layout, so that a datapath migrated from another keeps its size.
fn measure(dimension: Dimension) -> &'static MapSpec {
    sized_maps()
        .find(|spec| spec.sizing == Sizing::Measure(dimension))
        .expect("every dimension has a measure (see cnibpf_common::map_spec::Sizing)")
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
    sized_maps()
        .map(|map| {
            let dimension = sized_dimension(map);
            let wanted = map
                .sizing
                .entries(dimension_size(capacity, dimension, pinned))
                .expect("sized_maps() holds sized maps only");
            let entries = match (capacity.get(dimension), pinned.size(map.name)) {
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

/// The dimension a sized map follows.
fn sized_dimension(map: &MapSpec) -> Dimension {
    map.sizing
        .dimension()
        .expect("sized_maps() holds sized maps only")
}

fn read_pinned(pins: &PinLayout) -> Result<Pinned, BackendError> {
    sized_maps()
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
    for (map, size) in sized_maps().zip(&sizes) {
        if !size.resized {
            continue;
        }
        let held = entries(&pins.map(map.name), map)?.len();
        if held > size.entries as usize {
            let dimension = sized_dimension(map);
            return Err(BackendError::CapacityTooSmall {
                key: dimension.key(),
                // fail-closed: an Option of the request; a resized map's dimension was named.
                size: capacity.get(dimension).unwrap_or(size.entries),
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
    carry_over(pins, &sizes, &[])?;
    Ok(true)
}

/// Migrates the pinned maps of an older version to this build's (see the module's steps), at
/// their pinned sizes; the caller found some (`PinnedState::OtherPrograms { migrate: true }`).
pub(super) fn migrate(pins: &PinLayout) -> Result<(), BackendError> {
    let migrations = migrations(pins)?;
    let dir = pins.resize_dir();
    fs::create_dir_all(&dir).map_err(pin_error(format!("could not create {}", dir.display())))?;
    journal::note(journal::Change::Migrated(format!(
        "migrating maps: {}",
        describe_migrations(&migrations)
    )));
    carry_over(pins, &for_load(pins, &Capacity::default())?, &migrations)
}

/// The maps to migrate; state with a map this build neither writes nor migrates is refused
/// (`check_layout` said so before anything changed).
fn migrations(pins: &PinLayout) -> Result<Vec<Migration>, BackendError> {
    match layout::compare(pins)? {
        Verdict::Migrate(migrations) => Ok(migrations),
        Verdict::Foreign(found) if found.is_newer() => Err(BackendError::NewerState {
            path: pins.root().to_owned(),
            found,
        }),
        Verdict::Foreign(found) => Err(BackendError::OlderState {
            path: pins.root().to_owned(),
            found,
        }),
    }
}

fn describe_migrations(migrations: &[Migration]) -> String {
    migrations
        .iter()
        .map(|migration| {
            format!(
                "{} from version {} to {}",
                migration.spec.name, migration.from, migration.spec.version
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
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
    let mut migrations = migrations(pins)?;
    if exists(&pins.resize_dir().join(MOVING))? {
        // A map moved into place is this build's version already, whatever `map_versions`
        // says until step 5 is over.
        let mut waiting = Vec::new();
        for migration in migrations {
            if exists(&pins.resized_map(migration.spec.name))? {
                waiting.push(migration);
            }
        }
        migrations = waiting;
    }
    journal::note(journal::Change::Migrated(format!(
        "resuming a resize: {}; migrations: {}",
        describe(&sizes),
        describe_migrations(&migrations)
    )));
    carry_over(pins, &sizes, &migrations).map(|()| true)
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

/// Steps 1 to 5 for the maps marked `resized` and the maps migrated.
fn carry_over(
    pins: &PinLayout,
    sizes: &[MapSize],
    migrations: &[Migration],
) -> Result<(), BackendError> {
    let mut replaced: Vec<(&'static MapSpec, Option<&Migration>)> = migrations
        .iter()
        .map(|migration| (migration.spec, Some(migration)))
        .collect();
    for (map, size) in sized_maps().zip(sizes) {
        if size.resized && !replaced.iter().any(|(spec, _)| spec.name == map.name) {
            replaced.push((map, None));
        }
    }
    let created_new: Vec<&str> = replaced.iter().map(|(spec, _)| spec.name).collect();
    load_object(pins, sizes, &created_new)?;
    let copy_all = || -> Result<(), BackendError> {
        for (map, migration) in &replaced {
            copy(
                map,
                &pins.map(map.name),
                &pins.resized_map(map.name),
                *migration,
            )?;
        }
        Ok(())
    };
    copy_all()?;
    relink(pins)?;
    copy_all()?;
    // Before the stamp, as a load's: the attachments the replaced programs served.
    super::networks::backfill(pins)?;
    let moving = pins.resize_dir().join(MOVING);
    fs::create_dir_all(&moving)
        .map_err(pin_error(format!("could not create {}", moving.display())))?;
    for (map, _) in &replaced {
        let (new, old) = (pins.resized_map(map.name), pins.map(map.name));
        fs::rename(&new, &old).map_err(pin_error(format!(
            "could not move map {} into place",
            map.name
        )))?;
    }
    journal::note(journal::Change::Migrated(
        "resized maps moved into place".to_owned(),
    ));
    // The stamp (which records the maps' versions) before `resize/` goes: a run that finds
    // neither would take the maps, recorded at this build's versions under the older stamp,
    // for state with nothing left to do, and leave it unstamped (an older build would then
    // read the converted maps as its own). One that finds `resize/` finishes the step.
    stamp(pins)?;
    remove_tree(&pins.resize_dir())
}

/// Marks, in `resize/`, that step 5 began.
const MOVING: &str = "moving";

fn exists(path: &Path) -> Result<bool, BackendError> {
    path.try_exists()
        .map_err(pin_error(format!("could not look for {}", path.display())))
}

fn open(path: &Path) -> Result<MapData, BackendError> {
    MapData::from_pin(path).map_err(|source| BackendError::Map {
        action: format!("could not open map {}", path.display()),
        source: Box::new(source),
    })
}

/// Every entry of the map of `spec` pinned at `path`, as bytes.
fn entries(path: &Path, spec: &MapSpec) -> Result<batch::RawEntries, BackendError> {
    batch::raw_entries(&open(path)?, spec)
        .map_err(pin_error(format!("could not read map {}", path.display())))
}

/// Copies every entry of the map of `spec` pinned at `from` into the one at `to`, leaving
/// what is there alone (the new programs wrote it, or a resumed run copied it); a migrated
/// map's entries are read at the sizes of its pinned version and converted.
fn copy(
    spec: &MapSpec,
    from: &Path,
    to: &Path,
    migration: Option<&Migration>,
) -> Result<(), BackendError> {
    let new = open(to)?;
    let write_error = || pin_error(format!("could not write map {}", to.display()));
    let Some(migration) = migration else {
        for (key, value) in entries(from, spec)?.iter() {
            batch::insert_new(&new, key, value).map_err(write_error())?;
        }
        return Ok(());
    };
    let old = open(from)?;
    let read_error = || pin_error(format!("could not read map {}", from.display()));
    let info = old
        .info()
        .map_err(|source| read_error()(io::Error::other(source)))?;
    let pinned = MapSpec {
        key_size: info.key_size() as usize,
        value_size: info.value_size() as usize,
        ..*spec
    };
    for (key, value) in batch::raw_entries(&old, &pinned)
        .map_err(read_error())?
        .iter()
    {
        let (key, value) = migration.convert(key, value);
        batch::insert_new(&new, &key, &value).map_err(write_error())?;
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
    use aya_obj::{Object, maps::PinningType};
    use cnibpf_common::{connections, endpoints, map_spec::MIN_SCALED, masquerade, portmap};

    use super::{super::pins::OBJECT, *};

    /// The specs in `cnibpf_common` are the maps: every map the object pins by name is a spec,
    /// of the spec's kind, key and value sizes and declared entries, and every spec is pinned.
    #[test]
    fn every_pinned_map_of_the_object_is_declared_by_its_spec() {
        let object = Object::parse(OBJECT).expect("the embedded object parses");
        let mut pinned = 0;
        for (name, map) in &object.maps {
            if map.pinning() != PinningType::ByName {
                continue;
            }
            pinned += 1;
            let spec = cnibpf_common::map(name)
                .unwrap_or_else(|| panic!("map {name} is pinned but has no spec"));
            assert_eq!(
                (
                    map.map_type(),
                    map.key_size() as usize,
                    map.value_size() as usize,
                    map.max_entries()
                ),
                (
                    spec.kind.kernel_type(),
                    spec.key_size,
                    spec.value_size,
                    spec.max_entries
                ),
                "{name}: (type, key, value, entries) as the object declares it and as its spec does"
            );
        }
        assert_eq!(
            pinned,
            cnibpf_common::maps().count(),
            "every spec is pinned"
        );
    }

    /// The sizes a datapath created with `capacity` has, by map.
    fn created_with(capacity: &Capacity) -> Vec<(&'static str, u32)> {
        plan(capacity, &Pinned::default())
            .into_iter()
            .map(|size| (size.name, size.entries))
            .collect()
    }

    fn pinned(sizes: &[(&'static str, u32)]) -> Pinned {
        Pinned(
            sized_maps()
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
            assert_eq!(measure(dimension).sizing.dimension(), Some(dimension));
        }
    }

    #[test]
    fn the_object_declares_the_default_sizes() {
        for (name, entries) in created_with(&Capacity::default()) {
            let spec = cnibpf_common::map(name).expect("a spec");
            assert_eq!(entries, spec.max_entries, "{name}");
        }
    }

    #[test]
    fn a_named_dimension_sizes_its_maps_and_only_those_are_resized() {
        let pinned = pinned(&[
            (connections::CONNECTIONS.name, 262_144),
            (masquerade::REPLIES.name, 262_144),
            (portmap::HOST_SOCKETS.name, 65_536),
            (endpoints::OWNERS.name, 16_384),
            (masquerade::SOURCES.name, 16_384),
        ]);
        let capacity = Capacity {
            flows: Some(65_536),
            ..Capacity::default()
        };
        let sizes = plan(&capacity, &pinned);
        let size = |name: &str| sizes.iter().find(|size| size.name == name).expect(name);
        assert_eq!(size(connections::CONNECTIONS.name).entries, 65_536);
        assert!(size(connections::CONNECTIONS.name).resized);
        assert_eq!(size(portmap::HOST_SOCKETS.name).entries, 16_384);
        assert!(size(portmap::HOST_SOCKETS.name).resized);
        assert_eq!(size(connections::FRAGMENTS.name).entries, 8_192);
        assert!(
            !size(connections::FRAGMENTS.name).resized,
            "not pinned: created"
        );
        // Attachments were not named: pinned maps keep their size (even one that is not what
        // the scale says), a missing one follows the pinned measure.
        assert_eq!(size(endpoints::OWNERS.name).entries, 16_384);
        assert_eq!(size(masquerade::SOURCES.name).entries, 16_384);
        assert_eq!(size(portmap::CONDITIONS.name).entries, 32_768);
        assert!(
            sized_maps()
                .zip(&sizes)
                .filter(|(map, _)| sized_dimension(map) != Dimension::Flows)
                .all(|(_, size)| !size.resized)
        );
        // Host ports: nothing pinned, nothing named: the default.
        assert_eq!(size(portmap::MAPPINGS.name).entries, 16_384);
    }

    #[test]
    fn fractions_of_the_smallest_dimension_keep_a_floor() {
        let capacity = Capacity {
            flows: Some(256),
            ..Capacity::default()
        };
        let sizes = created_with(&capacity);
        let size = |name: &str| sizes.iter().find(|(map, _)| *map == name).expect(name).1;
        assert_eq!(size(connections::FRAGMENTS.name), MIN_SCALED);
        assert_eq!(size(portmap::HOST_SOCKETS.name), 64);
    }
}
