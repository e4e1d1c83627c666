//! The eBPF backend: TC programs attached with tcx links to the uplinks and to each
//! container's host-side interface, socket hooks on a cgroup, everything pinned under
//! `pinPath`. tcx links coexist with whatever else is on an interface — other programs, an
//! operator's qdiscs and filters, the `bandwidth` plugin's — and every packet cnibpf does not
//! take goes on to them.
//!
//! Layout of `pinPath`: the maps, pinned by name (see `cnibpf-common`); `programs/<name>`, one
//! pinned instance of each program shared by every attachment; `links/uplink-<if>-<hook>`,
//! `links/endpoint-<owner>-<from|to>` and `links/cgroup-<program>`, the links that keep the
//! hooks attached after the plugin exits (removing a link pin detaches it).

mod batch;
mod compat;
mod conditions;
mod connections;
mod endpoint;
mod filter;
mod hooks;
mod inspect;
mod kernel_btf;
mod layout;
mod masquerade;
mod namespace;
mod networks;
mod on_demand;
mod owner;
mod pins;
mod portmap;
mod probe;
mod sizes;
mod sources;
mod sys;
mod unpin;

use std::{fs, io, net::IpAddr};

use aya::maps::{HashMap, Map, MapData, MapError};

use self::layout::{PinnedState, check_layout};
use self::namespace::Owner;
pub use self::pins::Found;
use self::pins::{all_programs_pinned, load_object, prepare_pin_dir, relink, stamp};
pub use self::pins::{mount_bpffs, remove_pinned};
pub use self::sizes::{Memory, memory};
use self::{
    connections::ConnectionMaps, endpoint::EndpointMaps, filter::FilterMaps,
    masquerade::MasqueradeMaps, portmap::PortMapMaps, sources::SourceMaps,
};
use super::{Access, Backend, BackendError, Datapath, Drained};
use crate::{journal, model::Capacity, output::log_line, paths::PinLayout};

/// The pinned datapath, as one bundle of map handles per capability, each defined and opened
/// by the capability's own file (`endpoint.rs`, `portmap.rs`, `masquerade.rs`, `filter.rs`,
/// `sources.rs`), and the connection table they share (`connections.rs`). A capability works
/// on its own bundle; what it needs of another's goes through that one's methods (the owner
/// record, a connection's masquerade reply, its part of the connections). Only
/// `inspect`, `migrate` and `sizes`, which read or convert the whole datapath, read every
/// bundle's maps.
pub struct EbpfBackend {
    pins: PinLayout,
    endpoint: EndpointMaps,
    port_mapping: PortMapMaps,
    masquerade: MasqueradeMaps,
    filter: FilterMaps,
    source_check: SourceMaps,
    connections: ConnectionMaps,
    /// The node's addresses (interface index, address) as `sync_host_addresses` last read
    /// them.
    host_addresses: Vec<(u32, IpAddr)>,
    /// The attachment `setup_endpoint` found new to the node (no `owners` entry): it holds no
    /// entry in any other map (its teardowns go before its record), so nothing of it needs
    /// looking for.
    new_owner: Option<u64>,
}

impl std::fmt::Debug for EbpfBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EbpfBackend")
            .field("pins", &self.pins)
            .finish_non_exhaustive()
    }
}

impl EbpfBackend {
    /// Whether the eBPF backend can work on this host: the kernel loads a TC program and
    /// knows tcx (a kernel without BPF or tcx, or a sandbox that denies `bpf()`, fails here
    /// with `Unavailable`). A failure that says nothing about BPF (a transient one) is
    /// `ProbeFailed`: `auto` must not switch backends on it.
    pub fn probe() -> Result<(), BackendError> {
        probe::load_and_query()
            .and_then(|()| probe::bpffs_writable())
            .map_err(|refusal| {
                if refusal.transient {
                    BackendError::ProbeFailed {
                        backend: "ebpf",
                        reason: refusal.reason,
                    }
                } else {
                    BackendError::Unavailable {
                        backend: "ebpf",
                        reason: refusal.reason,
                    }
                }
            })
    }

    /// Whether a datapath's layout stamp is pinned under `pins` (one `stat`), whatever its
    /// layout and build: [`Self::load`] decides what to do with it.
    pub fn is_pinned(pins: &PinLayout) -> Result<bool, BackendError> {
        pins::map_pinned(
            pins,
            &pins.map(cnibpf_common::datapath::layout::LAYOUT.name),
        )
    }

    /// Opens the pinned state, loading and pinning the object first if it is not (all) there.
    /// Programs pinned by another build of the datapath are replaced, and every pinned link is
    /// switched to the new program atomically, so an upgrade takes effect without a packet
    /// passing unhooked. Maps are created at the sizes `capacity` asks (see `sizes`); pinned
    /// ones are resized to a dimension it names, their entries carried over.
    ///
    /// A datapath another network namespace set up is refused while it serves that namespace,
    /// and reclaimed once it serves nothing (see `namespace`).
    pub fn load(pins: &PinLayout, capacity: &Capacity) -> Result<Self, BackendError> {
        prepare_pin_dir(pins)?;
        match namespace::owner(pins)? {
            Owner::Caller => {}
            Owner::Gone { datapath, caller } => reclaim_abandoned(pins, datapath, caller)?,
            Owner::Other(other) => return Err(other.error()),
        }
        let state = check_layout(pins)?;
        let programs_current = match state {
            PinnedState::Older(found) => {
                return Err(BackendError::OlderState {
                    path: pins.root().to_owned(),
                    found,
                });
            }
            PinnedState::Newer(found) => {
                return Err(BackendError::NewerState {
                    path: pins.root().to_owned(),
                    found,
                });
            }
            PinnedState::Current => {
                compat::remove_migration_leftovers(pins)?;
                sizes::resume(pins)?;
                true
            }
            PinnedState::OtherPrograms { migrate: false } => sizes::resume(pins)?,
            // Before any resize, which reads the maps as this build's.
            PinnedState::OtherPrograms { migrate: true } => {
                if !sizes::resume(pins)? {
                    sizes::migrate(pins)?;
                }
                true
            }
            PinnedState::Absent => false,
        };
        if state != PinnedState::Absent && sizes::resize(pins, capacity)? {
            return Self::open_maps(pins);
        }
        if programs_current && all_programs_pinned(pins)? {
            return Self::open_maps(pins);
        }
        let loaded = sizes::for_load(pins, capacity)
            .and_then(|sizes| load_object(pins, &sizes, &[]))
            .and_then(|()| relink(pins))
            .and_then(|()| match state {
                PinnedState::Absent => Ok(()),
                _ => networks::backfill(pins),
            })
            .and_then(|()| stamp(pins));
        if let Err(error) = loaded {
            // Nothing of an attachment lives there yet: leave no half-loaded maps behind.
            if state == PinnedState::Absent {
                // fail-closed: unstamped state holds no attachment, and what a failed removal
                // leaves the next load takes over; the load's own error is the one to report.
                let _ = fs::remove_dir_all(pins.root());
            }
            return Err(error);
        }
        Self::open_maps(pins)
    }

    /// [`Self::load`] for changes (ADD).
    pub fn load_for_changes(pins: &PinLayout, capacity: &Capacity) -> Result<Self, BackendError> {
        Self::load(pins, capacity)
    }

    /// The pinned state if there is any, without loading anything.
    pub fn open_existing(pins: &PinLayout, access: Access) -> Result<Option<Self>, BackendError> {
        match check_layout(pins)? {
            PinnedState::Absent => return Ok(None),
            PinnedState::Older(found) => {
                return Err(BackendError::OlderState {
                    path: pins.root().to_owned(),
                    found,
                });
            }
            PinnedState::Newer(found) => {
                return Err(BackendError::NewerState {
                    path: pins.root().to_owned(),
                    found,
                });
            }
            // What a migration that stamped the new layout left behind goes with the next run
            // that may change the state, whichever verb it is.
            PinnedState::Current if access == Access::Changes => {
                compat::remove_migration_leftovers(pins)?;
                sizes::resume(pins)?;
            }
            PinnedState::OtherPrograms { migrate: false } if access == Access::Changes => {
                sizes::resume(pins)?;
            }
            // This build reads no map of an older version: the call that may change the state
            // migrates them first.
            PinnedState::OtherPrograms { migrate: true } if access == Access::Changes => {
                return Self::load(pins, &Capacity::default()).map(Some);
            }
            PinnedState::OtherPrograms { migrate: true } => {
                return Err(BackendError::MapsToMigrate {
                    path: pins.root().to_owned(),
                    maps: layout::older_maps(pins)?,
                });
            }
            PinnedState::Current | PinnedState::OtherPrograms { migrate: false } => {}
        }
        Self::open_maps(pins).map(Some)
    }

    /// [`Self::open_existing`] for DEL and GC: state of another layout (older than the
    /// supported window's, or newer: a rollback) is opened for releasing attachments, never
    /// refused (see `compat`).
    ///
    /// A datapath that serves another network namespace holds none of this one's attachments:
    /// DEL finds nothing there, everything else is refused (see `namespace`).
    pub fn open_for_removal(pins: &PinLayout) -> Result<Option<Box<dyn Backend>>, BackendError> {
        if let Owner::Other(other) = namespace::owner(pins)? {
            return Ok(Some(Box::new(Drained(other))));
        }
        if let PinnedState::Newer(found) | PinnedState::Older(found) = check_layout(pins)? {
            return Ok(Some(Box::new(Drained(compat::OtherLayout::open(
                pins, found,
            )?))));
        }
        Ok(Self::open_existing(pins, Access::Changes)?
            .map(|backend| Box::new(backend) as Box<dyn Backend>))
    }

    /// The layout of the state pinned under `pins` when it is one this build neither writes nor
    /// migrates (older than the supported window's, or newer): its attachments drain, and no
    /// ADD is served until the last is gone.
    pub fn unmigrated_layout(pins: &PinLayout) -> Result<Option<Found>, BackendError> {
        Ok(match check_layout(pins)? {
            PinnedState::Older(found) | PinnedState::Newer(found) => Some(found),
            PinnedState::Absent | PinnedState::Current | PinnedState::OtherPrograms { .. } => None,
        })
    }

    /// Whether the datapath pinned under `pins` is this build's, at this layout: `Ok(())`, or
    /// what it is instead (nothing loaded, another build's programs, another layout).
    pub fn loaded_by_this_build(pins: &PinLayout) -> Result<Result<(), String>, BackendError> {
        Ok(match check_layout(pins)? {
            PinnedState::Current if all_programs_pinned(pins)? => Ok(()),
            PinnedState::Current => Err("some of this build's programs are not pinned".to_owned()),
            PinnedState::Absent => Err("no datapath is loaded (`cnibpf load`)".to_owned()),
            PinnedState::OtherPrograms { .. } => Err(
                "the programs loaded are another build's (`cnibpf load` replaces them)".to_owned(),
            ),
            PinnedState::Older(found) => Err(format!(
                "the pinned state has {found}, older than this build's {} and than the releases it upgrades from (upgrade through {} first)",
                found.ours(),
                super::compat::PASS_THROUGH
            )),
            PinnedState::Newer(found) => Err(format!(
                "the pinned state has {found}, newer than this build's {}",
                found.ours()
            )),
        })
    }

    /// A pinned map a build before this one did not create: `None` when it is not there
    /// (the kernel's "not found"), for reading what such state does not count.
    fn optional_map<T: TryFrom<Map, Error = MapError>>(
        &self,
        name: &str,
    ) -> Result<Option<T>, BackendError> {
        if !pins::map_pinned(&self.pins, &self.pins.map(name))? {
            return Ok(None);
        }
        open_pinned(&self.pins, name).map(Some)
    }

    /// Whether `setup_endpoint` found attachment `owner` new to the node in this call: it
    /// holds no entry in any other map, so nothing of it needs looking for or comparing.
    fn is_new(&self, owner: u64) -> bool {
        self.new_owner == Some(owner)
    }

    /// What `cnibpf inspect` says of a datapath under `pins` that another network namespace
    /// set up than the caller's (see `namespace`); `None` for the caller's own.
    pub fn namespace_note(pins: &PinLayout) -> Result<Option<String>, BackendError> {
        Ok(match namespace::owner(pins)? {
            Owner::Caller => None,
            Owner::Gone { datapath, caller } => Some(format!(
                "the eBPF datapath was set up for network namespace cookie {datapath}, not this one (cookie {caller}), and none of its hooks attaches an interface any more: the next ADD or `cnibpf load` reclaims it"
            )),
            Owner::Other(other) => Some(format!(
                "{}; its interfaces are named as its links name them",
                other.error()
            )),
        })
    }

    /// The ring buffer of the datapath's drop events, for `cnibpf monitor`.
    pub fn drop_events(&self) -> Result<aya::maps::RingBuf<MapData>, BackendError> {
        open_pinned(&self.pins, cnibpf_common::drops::EVENTS.name)
    }

    /// The ring buffer of the `log` rules' events, for `cnibpf monitor --matches`.
    pub fn match_events(&self) -> Result<aya::maps::RingBuf<MapData>, BackendError> {
        open_pinned(&self.pins, cnibpf_common::filter::MATCH_EVENTS.name)
    }

    pub(super) fn open_maps(pins: &PinLayout) -> Result<Self, BackendError> {
        Ok(Self {
            pins: pins.clone(),
            endpoint: EndpointMaps::open(pins)?,
            port_mapping: PortMapMaps::open(pins)?,
            masquerade: MasqueradeMaps::open(pins)?,
            filter: FilterMaps::open(pins)?,
            source_check: SourceMaps::open(pins)?,
            connections: ConnectionMaps::open(pins)?,
            host_addresses: Vec::new(),
            new_owner: None,
        })
    }
}

impl Datapath for EbpfBackend {
    fn datapath_name(&self) -> &'static str {
        "ebpf"
    }

    fn sweep_expired_state(&mut self) -> Result<(), BackendError> {
        self.sweep_expired_connections()?;
        self.sweep_orphaned_source_checks()
    }

    fn commit_changes(&mut self) -> Result<(), BackendError> {
        Ok(())
    }
}

/// Removes a datapath whose network namespace no tcx link of it serves any more
/// ([`Owner::Gone`]), for a fresh load: every attachment it records is gone with its
/// interface, and is noted as reclaimed.
fn reclaim_abandoned(pins: &PinLayout, datapath: u64, caller: u64) -> Result<(), BackendError> {
    // Of whichever layout: what every layout keeps names them.
    let state = Found::Layout(cnibpf_common::datapath::layout::stamped());
    for record in compat::recorded_attachments(pins, state)? {
        journal::note(journal::Change::Reclaimed(format!(
            "{} (its network namespace, cookie {datapath}, no longer has its interface)",
            record.attachment
        )));
    }
    for removed in remove_pinned(pins)? {
        log_line!(
            "cnibpf: reclaimed {removed}: set up for network namespace cookie {datapath}, none of whose interfaces it hooks any more; set up again for this one (cookie {caller})"
        );
    }
    prepare_pin_dir(pins)
}

/// For a failed whole-map read (see `batch`).
fn read_error(name: &'static str) -> impl Fn(io::Error) -> BackendError {
    move |source| BackendError::MapRead { name, source }
}

/// For a failed batch write (see `batch`).
fn write_error(name: &'static str) -> impl Fn(io::Error) -> BackendError {
    move |source| BackendError::MapWrite { name, source }
}

fn map_error(action: &str) -> impl Fn(MapError) -> BackendError + '_ {
    move |source| BackendError::Map {
        action: action.to_owned(),
        source: Box::new(source),
    }
}

fn remove_entry<K: aya::Pod, V: aya::Pod>(
    map: &mut HashMap<MapData, K, V>,
    key: &K,
    name: &str,
) -> Result<(), BackendError> {
    removed(map.remove(key), name)
}

/// Removes every entry of map `name` whose value `stale` selects, from one whole-map read.
fn remove_where<K: aya::Pod + Default, V: aya::Pod + Default>(
    map: &mut HashMap<MapData, K, V>,
    name: &'static str,
    stale: impl Fn(&V) -> bool,
) -> Result<(), BackendError> {
    for (key, value) in batch::entries(map).map_err(read_error(name))? {
        if stale(&value) {
            remove_entry(map, &key, name)?;
        }
    }
    Ok(())
}

/// What a lookup in map `name` found: `None` only when the kernel says the key is not there
/// (ENOENT); every other failure is an error, never read as "absent".
fn found<V>(outcome: Result<V, MapError>, name: &str) -> Result<Option<V>, BackendError> {
    match outcome {
        Ok(value) => Ok(Some(value)),
        Err(MapError::KeyNotFound) => Ok(None),
        Err(MapError::SyscallError(error)) if error.io_error.kind() == io::ErrorKind::NotFound => {
            Ok(None)
        }
        Err(source) => Err(BackendError::Map {
            action: format!("could not read map {name}"),
            source: Box::new(source),
        }),
    }
}

/// The outcome of removing an entry from map `name`.
fn removed(outcome: Result<(), MapError>, name: &str) -> Result<(), BackendError> {
    match outcome {
        Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
        // Gone already (another DEL, an LRU eviction): what this removal wanted.
        Err(MapError::SyscallError(error)) if error.io_error.kind() == io::ErrorKind::NotFound => {
            Ok(())
        }
        Err(source) => Err(BackendError::Map {
            action: format!("could not delete from map {name}"),
            source: Box::new(source),
        }),
    }
}

fn open_pinned<T: TryFrom<Map, Error = MapError>>(
    pins: &PinLayout,
    name: &str,
) -> Result<T, BackendError> {
    let path = pins.map(name);
    let error = |source| BackendError::Map {
        action: format!("could not open pinned map {}", path.display()),
        source: Box::new(source),
    };
    let data = MapData::from_pin(&path).map_err(error)?;
    let map = Map::from_map_data(data).map_err(error)?;
    T::try_from(map).map_err(error)
}

/// CLOCK_MONOTONIC, the clock of the datapath's timestamps (coarse there; expiry times in the flow tables).
fn monotonic_now_ns() -> u64 {
    // fail-closed: a clock that cannot be read says 0, the boot, before which nothing expires.
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map_or(0, |now| {
        now.tv_sec().unsigned_abs() * 1_000_000_000 + now.tv_nsec().unsigned_abs()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn syscall_error(errno: i32) -> MapError {
        MapError::SyscallError(aya::sys::SyscallError {
            call: "bpf_map_lookup_elem",
            io_error: io::Error::from_raw_os_error(errno),
        })
    }

    #[test]
    fn only_the_kernels_not_found_reads_as_absent() {
        assert_eq!(found(Ok(7u32), "m").expect("found"), Some(7));
        assert_eq!(
            found::<u32>(Err(MapError::KeyNotFound), "m").expect("absent"),
            None
        );
        assert_eq!(
            found::<u32>(Err(syscall_error(libc::ENOENT)), "m").expect("absent"),
            None
        );
        for errno in [
            libc::EMFILE,
            libc::ENOMEM,
            libc::EINTR,
            libc::EPERM,
            libc::EAGAIN,
        ] {
            let error = found::<u32>(Err(syscall_error(errno)), "owners")
                .expect_err("an error is not an absence");
            assert!(
                error.to_string().contains("owners"),
                "names the map: {error}"
            );
        }
    }
}
