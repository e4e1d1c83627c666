//! What is pinned under `pinPath`, and whether this build can use it: the layout stamp
//! (`cnibpf_common::datapath::layout`) and, when the stamp names another build's programs (an
//! upgrade or a rollback), the maps' versions (`map_versions`, see
//! `cnibpf_common::datapath::versions`). A stamp naming this build's object says every map is
//! at this build's version, so an ordinary call reads the stamp alone.
//!
//! A map at an older version with a migration for each step to this build's is migrated alone,
//! its entries converted as a resize carries them over (`sizes`); one at a newer version (a
//! rollback), or older than any migration this build has, makes the state one this build
//! neither writes nor migrates, drained as another layout is (`compat`).

use std::{collections::BTreeMap, io};

use aya::maps::{Array, Map, MapData, MapError};
use cnibpf_common::{
    datapath::{LayoutInfo, MAP_VERSIONS, MapName, layout},
    map_spec::MapSpec,
};

use super::{
    batch,
    compat::{MAP_MIGRATIONS, MapMigration},
    pins::{Found, map_pinned, object_id, open_versions},
};
use crate::{backend::BackendError, paths::PinLayout};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PinnedState {
    /// Nothing usable pinned (or a load that died before stamping the layout).
    Absent,
    /// Maps of this layout with programs of another build of the datapath; `migrate`: some
    /// maps are of an older version, which the next load migrates.
    OtherPrograms {
        migrate: bool,
    },
    Current,
    /// The layout, or a map's version, of an older cnibpf.
    Older(Found),
    /// The layout, or a map's version, of a newer cnibpf (a downgrade).
    Newer(Found),
}

/// What is pinned under `pins`. An error names its real cause: a lack of privilege, or a
/// directory that holds something else than cnibpf's state.
pub(super) fn check_layout(pins: &PinLayout) -> Result<PinnedState, BackendError> {
    let path = pins.map(layout::LAYOUT.name);
    if !map_pinned(pins, &path)? {
        return Ok(PinnedState::Absent);
    }
    let unreadable = |error: MapError| match os_error(&error) {
        Some(source) => BackendError::UnreadableState {
            path: pins.root().to_owned(),
            source,
        },
        None => BackendError::ForeignState {
            path: pins.root().to_owned(),
            reason: format!("its layout map is unreadable: {error}"),
        },
    };
    let data = MapData::from_pin(&path).map_err(unreadable)?;
    let map = Map::from_map_data(data).map_err(unreadable)?;
    let array: Array<MapData, LayoutInfo> =
        Array::try_from(map).map_err(|error| BackendError::ForeignState {
            path: pins.root().to_owned(),
            reason: format!("its layout map has another shape: {error}"),
        })?;
    let info = array.get(&0, 0).map_err(unreadable)?;
    if info == LayoutInfo::default() {
        return Ok(PinnedState::Absent);
    }
    if info.magic != layout::MAGIC {
        return Err(BackendError::ForeignState {
            path: pins.root().to_owned(),
            reason: "its layout map was not written by cnibpf".to_owned(),
        });
    }
    if info.version < layout::VERSION {
        return Ok(PinnedState::Older(Found::Layout(info.version)));
    }
    if info.version > layout::VERSIONED {
        return Ok(PinnedState::Newer(Found::Layout(info.version)));
    }
    if info.object_id == object_id() {
        return Ok(PinnedState::Current);
    }
    Ok(match compare(pins)? {
        Verdict::Migrate(maps) => PinnedState::OtherPrograms {
            migrate: !maps.is_empty(),
        },
        Verdict::Foreign(found) if found.is_newer() => PinnedState::Newer(found),
        Verdict::Foreign(found) => PinnedState::Older(found),
    })
}

/// The operating-system error under a map error, if that is what it is.
fn os_error(error: &MapError) -> Option<io::Error> {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(current) = cause {
        if let Some(io) = current.downcast_ref::<io::Error>()
            && let Some(code) = io.raw_os_error()
        {
            return Some(io::Error::from_raw_os_error(code));
        }
        cause = current.source();
    }
    None
}

/// A pinned map to migrate: its spec and the steps from its pinned version to this build's.
#[derive(Clone)]
pub(super) struct Migration {
    pub spec: &'static MapSpec,
    pub from: u32,
    steps: Vec<&'static MapMigration>,
}

impl Migration {
    /// An entry of the pinned version as this build's version has it.
    pub fn convert(&self, key: &[u8], value: &[u8]) -> (Vec<u8>, Vec<u8>) {
        self.steps
            .iter()
            .fold((key.to_vec(), value.to_vec()), |(key, value), step| {
                (step.convert)(&key, &value)
            })
    }
}

/// What the pinned maps' versions make of the state.
#[derive(Clone)]
pub(super) enum Verdict {
    /// These maps are to be migrated (none: every map is at this build's version).
    Migrate(Vec<Migration>),
    /// A map this build neither writes nor migrates.
    Foreign(Found),
}

/// Compares each map of this build pinned under `pins` with the version recorded for it.
pub(super) fn compare(pins: &PinLayout) -> Result<Verdict, BackendError> {
    let recorded = recorded(pins)?;
    let mut pinned = Vec::new();
    for spec in cnibpf_common::maps() {
        if map_pinned(pins, &pins.map(spec.name))? {
            // fail-closed: an Option of a read that succeeded; a map it does not name was
            // pinned by a build before per-map versions, at version 1.
            pinned.push((spec, recorded.get(spec.name).copied().unwrap_or(1)));
        }
    }
    Ok(verdict(&pinned, MAP_MIGRATIONS))
}

/// The maps of an older version the next load migrates, as a message names them.
pub(super) fn older_maps(pins: &PinLayout) -> Result<String, BackendError> {
    Ok(match compare(pins)? {
        Verdict::Migrate(maps) => maps
            .iter()
            .map(|migration| format!("{} (version {})", migration.spec.name, migration.from))
            .collect::<Vec<_>>()
            .join(", "),
        Verdict::Foreign(found) => found.to_string(),
    })
}

/// The verdict on maps pinned at these versions, given these migrations: a newer map first
/// (a rollback drains whatever else it holds), then one no chain of migrations reaches.
fn verdict(pinned: &[(&'static MapSpec, u32)], migrations: &'static [MapMigration]) -> Verdict {
    let found = |(spec, version): &(&'static MapSpec, u32)| Found::Map {
        name: spec.name,
        version: *version,
    };
    if let Some(newer) = pinned
        .iter()
        .find(|(spec, version)| *version > spec.version)
    {
        return Verdict::Foreign(found(newer));
    }
    let mut planned = Vec::new();
    for entry @ (spec, version) in pinned {
        if *version == spec.version {
            continue;
        }
        let steps: Option<Vec<_>> = (*version..spec.version)
            .map(|from| {
                migrations
                    .iter()
                    .find(|step| step.map == spec.name && step.from == from)
            })
            .collect();
        match steps {
            Some(steps) => planned.push(Migration {
                spec,
                from: *version,
                steps,
            }),
            None => return Verdict::Foreign(found(entry)),
        }
    }
    Verdict::Migrate(planned)
}

/// The versions `map_versions` records, by map name (none when it is not pinned: state of a
/// build before per-map versions, every map at version 1).
fn recorded(pins: &PinLayout) -> Result<BTreeMap<String, u32>, BackendError> {
    let path = pins.map(MAP_VERSIONS.name);
    if !map_pinned(pins, &path)? {
        return Ok(BTreeMap::new());
    }
    let versions = open_versions(pins)?;
    Ok(batch::entries(&versions)
        .map_err(|source| BackendError::MapRead {
            name: MAP_VERSIONS.name,
            source,
        })?
        .into_iter()
        .map(|(name, version): (MapName, u32)| (name_of(&name), version))
        .collect())
}

fn name_of(key: &MapName) -> String {
    let length = key
        .name
        .iter()
        .position(|byte| *byte == 0)
        // fail-closed: an Option of a search; a name of the key's full length has no NUL.
        .unwrap_or(key.name.len());
    String::from_utf8_lossy(&key.name[..length]).into_owned()
}

#[cfg(test)]
mod tests {
    use cnibpf_common::map_spec::MapKind;

    use super::*;

    const MAPPINGS_V3: MapSpec = MapSpec {
        version: 3,
        ..MapSpec::new::<u64, u64>("portmap", MapKind::Hash, 16)
    };
    const OWNERS_V1: MapSpec = MapSpec::new::<u64, u64>("owners", MapKind::Hash, 16);

    fn widen(key: &[u8], value: &[u8]) -> (Vec<u8>, Vec<u8>) {
        let mut value = value.to_vec();
        value.push(0xaa);
        (key.to_vec(), value)
    }

    static STEPS: [MapMigration; 2] = [
        MapMigration {
            map: "portmap",
            from: 1,
            convert: widen,
        },
        MapMigration {
            map: "portmap",
            from: 2,
            convert: widen,
        },
    ];

    #[test]
    fn maps_at_their_version_need_nothing() {
        let verdict = verdict(&[(&MAPPINGS_V3, 3), (&OWNERS_V1, 1)], &STEPS);
        assert!(matches!(verdict, Verdict::Migrate(maps) if maps.is_empty()));
    }

    #[test]
    fn an_older_map_migrates_alone_through_each_step() {
        let Verdict::Migrate(maps) = verdict(&[(&MAPPINGS_V3, 1), (&OWNERS_V1, 1)], &STEPS) else {
            panic!("version 1 of portmap has steps to 3");
        };
        assert_eq!(maps.len(), 1, "owners is at its version");
        assert_eq!((maps[0].spec.name, maps[0].from), ("portmap", 1));
        assert_eq!(maps[0].convert(&[1], &[2]), (vec![1], vec![2, 0xaa, 0xaa]));
    }

    #[test]
    fn a_map_no_chain_of_steps_reaches_or_a_newer_one_is_foreign() {
        let older = verdict(&[(&MAPPINGS_V3, 1)], &STEPS[1..]);
        let older_found = Found::Map {
            name: "portmap",
            version: 1,
        };
        assert!(matches!(older, Verdict::Foreign(found) if found == older_found));
        let newer = verdict(&[(&MAPPINGS_V3, 2), (&OWNERS_V1, 2)], &STEPS);
        assert!(
            matches!(
                newer,
                Verdict::Foreign(Found::Map {
                    name: "owners",
                    version: 2
                })
            ),
            "a rollback drains, whatever else could migrate"
        );
    }

    #[test]
    fn map_names_round_trip_through_their_keys() {
        for spec in cnibpf_common::maps() {
            assert_eq!(name_of(&MapName::of(spec.name)), spec.name);
        }
    }
}
