//! Pinned state of the previous layout, migrated in place, under the instance lock, while
//! its pods keep running.
//!
//! Layout 6 → 7 (and on to this one): `owners` gained the pod and `endpoints` the interface pods' hairpin enters by
//! and flags; `port_conditions` is new; a container's interface was hooked by cls_bpf filters
//! on its clsact qdisc, now by tcx links. Every other map keeps its type, so the new programs
//! take them over as they are — flows, translations, counters and all. The steps, each one
//! safe to run again after a crash at any point:
//!
//! 1. the two changed maps' pins move aside, into `layout-6-maps/` (bpffs renames in place; the
//!    running programs hold the maps, not their pins; bpffs takes no dot in a name);
//! 2. the new object loads beside the rest, creating the new maps and pinning its programs;
//! 3. every entry of the old `owners` and `endpoints` is converted into the new ones;
//! 4. every pinned link (uplinks, cgroup) moves to the new programs, atomically each, and every
//!    container interface gets its tcx links before its old filters go;
//! 5. the layout stamp says the current layout; `layout-6-maps/` goes.
//!
//! A run that finds `layout-6-maps/` resumes at 2; one that finds the current stamp with
//! `layout-6-maps/` still there only removes it.
//!
//! Layouts 7 and 8 → 9: a container's source set moved from a map of its own (`sources`,
//! absent from a layout-7 datapath made before source checks) into its interface's
//! `endpoints` record, so that a packet makes one lookup for both (and the maps' sizes became
//! the datapath's, set at load, in 8: a layout-7 datapath keeps the sizes it has). The steps
//! of layout 6's, on `endpoints` and `sources`, into `layout-8-maps/`: every other map — flows,
//! translations, counters — is taken over as it is; each old record is written again with its
//! interface's set, and a set without a record (an ADD that died between the two) gets one of
//! its own, as this build's ADD writes it.
//!
//! Layout 9 → 10: the connection tables of each feature (`masq_flows`, `nat_flows`,
//! `filter_flows`) became one, `connections`, each old entry its feature's part of its
//! connection's entry (`flows`). Every migration sets them aside with its changed maps; the
//! new object creates `connections` at the size of the flow tables (`masq_replies`, kept as it
//! is, measures it); the old entries are merged before the links move and once more after
//! (what the old programs recorded in between), a part added only where its connection lacks
//! it.

mod flows;

use std::{fs, io, path::Path};

use aya::maps::{HashMap, Map, MapData};
use cnibpf_common::{
    address::Address,
    datapath::layout,
    endpoints::{
        self, EndpointInfo, OwnerInfo,
        owners::{IFNAME_LEN, NAME_LEN},
    },
    sources::{FLAG_RECORDED, SourceSet},
};

use super::{
    EbpfBackend, found, map_error,
    pins::{load_object, relink, remove_tree, stamp},
    sizes,
};
use crate::{
    backend::BackendError,
    journal,
    model::Capacity,
    netlink::{self, TcFilterSlot},
    paths::PinLayout,
};

/// The oldest layout this build migrates from.
pub const FROM: u32 = 6;

/// The layouts whose source sets had a map of their own, `sources` (see the module's steps).
pub const SOURCES_APART: [u32; 2] = [7, 8];

/// The layout whose connection tables were one per feature, the last before this one.
pub const FLOWS_APART: u32 = 9;

/// The map of layouts 7 and 8 that held the source sets.
const SOURCES: &str = "sources";

/// Layout 6's `owners` value.
#[repr(C)]
#[derive(Clone, Copy)]
struct OwnerInfoV6 {
    network: [u8; NAME_LEN],
    container_id: [u8; NAME_LEN],
    ifname: [u8; IFNAME_LEN],
    host_ifname: [u8; IFNAME_LEN],
    host_ifindex: u32,
    port_count: u32,
}
const _: () = assert!(size_of::<OwnerInfoV6>() == 552);
// SAFETY: repr(C), integers and byte arrays only, no padding (asserted size).
unsafe impl aya::Pod for OwnerInfoV6 {}

/// Layout 6's `endpoints` value.
#[repr(C)]
#[derive(Clone, Copy)]
struct EndpointInfoV6 {
    gateway_v6: [u8; 16],
    owner: u64,
    gateway_v4: [u8; 4],
    container_mac: [u8; 6],
    gateway_mac: [u8; 6],
}
const _: () = assert!(size_of::<EndpointInfoV6>() == 40);
// SAFETY: as above.
unsafe impl aya::Pod for EndpointInfoV6 {}

/// Layout 8's (and 7's) `endpoints` value: layout 6's with the flags and the interface its
/// hairpin traffic enters by, this layout's without its source set.
#[repr(C)]
#[derive(Clone, Copy)]
struct EndpointInfoV8 {
    v6: EndpointInfoV6,
    flags: u32,
    gateway_ifindex: u32,
}
const _: () = assert!(size_of::<EndpointInfoV8>() == 48);
// SAFETY: as above.
unsafe impl aya::Pod for EndpointInfoV8 {}

impl EndpointInfoV8 {
    /// This layout's record of the same interface, without a source set.
    fn current(&self) -> EndpointInfo {
        let old = &self.v6;
        EndpointInfo {
            gateway_v6: Address::from_bytes(old.gateway_v6),
            owner: old.owner,
            gateway_v4: old.gateway_v4,
            container_mac: old.container_mac,
            gateway_mac: old.gateway_mac,
            flags: self.flags,
            gateway_ifindex: self.gateway_ifindex,
            sources: SourceSet::default(),
        }
    }
}

/// The maps whose types changed since layout 6.
const CHANGED: [&str; 2] = [endpoints::OWNERS.name, endpoints::ENDPOINTS.name];

/// Layout 6's container hooks: a cls_bpf filter in this slot of clsact ingress and egress.
const LEGACY_FILTER: TcFilterSlot = TcFilterSlot {
    priority: 0xcb1f,
    handle: 1,
};

/// Removes layout 6's filters from an interface, and the clsact qdisc they were on once
/// nothing else is (left behind, it would read as someone shaping the interface).
fn unhook_legacy(ifindex: u32) -> Result<(), netlink::NetlinkError> {
    for egress in [false, true] {
        netlink::delete_filter(ifindex, LEGACY_FILTER, egress)?;
    }
    if !netlink::clsact_has_filters(ifindex)? {
        netlink::delete_clsact(ifindex)?;
    }
    Ok(())
}

/// Whether something besides layout 6's clsact shapes the interface (one that is gone shapes
/// nothing).
fn shaped(ifindex: u32) -> Result<bool, BackendError> {
    let kinds = netlink::added_qdiscs(ifindex).map_err(|source| BackendError::Interface {
        action: format!("could not list the qdiscs of interface {ifindex}"),
        source: Box::new(source),
    })?;
    Ok(kinds.iter().any(|kind| kind != "clsact"))
}

/// The interface `ifindex`, `None` when the kernel says it is gone.
fn live_link(ifindex: u32) -> Result<Option<netlink::Link>, BackendError> {
    netlink::link_if_there(ifindex).map_err(|source| BackendError::Interface {
        action: format!("could not look up interface {ifindex}"),
        source: Box::new(source),
    })
}

/// Where the changed maps' old pins wait while a migration runs: `layout-6-maps/` from
/// layout 6, `layout-8-maps/` from layouts 7 and 8.
fn aside(pins: &PinLayout, named_after: u32) -> std::path::PathBuf {
    pins.root().join(format!("layout-{named_after}-maps"))
}

fn pin_error(action: String) -> impl FnOnce(io::Error) -> BackendError {
    move |source| BackendError::Pin {
        action,
        source: Box::new(source),
    }
}

/// Step 1: the pins of `changed` move into `aside` (those already there stay; one the state
/// does not have is `optional`, else an error).
fn move_aside(
    pins: &PinLayout,
    aside: &Path,
    changed: &[&str],
    optional: &[&str],
) -> Result<(), BackendError> {
    fs::create_dir_all(aside)
        .map_err(pin_error(format!("could not create {}", aside.display())))?;
    for name in changed {
        let old = aside.join(name);
        let moved = old
            .try_exists()
            .map_err(pin_error(format!("could not look for {}", old.display())))?;
        if moved {
            continue;
        }
        match fs::rename(pins.map(name), &old) {
            Ok(()) => {}
            Err(error) if error.kind() == io::ErrorKind::NotFound && optional.contains(name) => {}
            Err(error) => {
                return Err(pin_error(format!("could not move map {name} aside"))(error));
            }
        }
    }
    Ok(())
}

/// Migrates `pins` from layout 6 (see the module's steps).
pub fn from_6(pins: &PinLayout) -> Result<(), BackendError> {
    let aside = aside(pins, FROM);
    move_aside(pins, &aside, &CHANGED, &[])?;
    move_aside(pins, &aside, &flows::TABLES, &flows::TABLES)?;
    journal::note(journal::Change::Migrated(format!(
        "eBPF layout {FROM}: changed maps moved aside"
    )));
    load_object(pins, &sizes::for_load(pins, &Capacity::default())?)?;
    journal::note(journal::Change::Migrated(
        "this build's programs and maps loaded".to_owned(),
    ));
    let mut backend = EbpfBackend::open_maps(pins)?;
    backend.convert(&aside)?;
    backend.merge_flows(&aside)?;
    journal::note(journal::Change::Migrated(
        "owners, endpoints and connections converted".to_owned(),
    ));
    relink(pins)?;
    backend.merge_flows(&aside)?;
    backend.rehook_endpoints()?;
    journal::note(journal::Change::Migrated(
        "links moved to the new programs, endpoints hooked with tcx".to_owned(),
    ));
    stamp(pins)?;
    journal::note(journal::Change::Migrated(format!(
        "stamped layout {}",
        layout::VERSION
    )));
    fs::remove_dir_all(&aside).map_err(pin_error(format!("could not remove {}", aside.display())))
}

/// Migrates `pins` from layout 7 or 8, `found` (see the module's steps).
pub fn from_sources_apart(pins: &PinLayout, found: u32) -> Result<(), BackendError> {
    let aside = aside(pins, SOURCES_APART[1]);
    move_aside(
        pins,
        &aside,
        &[endpoints::ENDPOINTS.name, SOURCES],
        &[SOURCES],
    )?;
    move_aside(pins, &aside, &flows::TABLES, &flows::TABLES)?;
    journal::note(journal::Change::Migrated(format!(
        "eBPF layout {found}: endpoints, sources and connection tables moved aside"
    )));
    convert_and_relink(
        pins,
        &aside,
        "source sets merged into the endpoints records, connections converted",
        EbpfBackend::merge_source_sets,
    )
}

/// Migrates `pins` from layout 9 (see the module's steps).
pub fn from_9(pins: &PinLayout) -> Result<(), BackendError> {
    let aside = aside(pins, FLOWS_APART);
    move_aside(pins, &aside, &flows::TABLES, &flows::TABLES)?;
    journal::note(journal::Change::Migrated(format!(
        "eBPF layout {FLOWS_APART}: connection tables moved aside"
    )));
    convert_and_relink(pins, &aside, "connections merged into one table", |_, _| {
        Ok(())
    })
}

/// Steps 2 to 5 of a migration whose maps moved `aside` need only `convert` besides the
/// connection tables' merge: this build's object loaded beside, `convert` and the merge, the
/// links moved, what the old programs recorded meanwhile merged too, the stamp, `aside` gone.
fn convert_and_relink(
    pins: &PinLayout,
    aside: &Path,
    converted: &str,
    convert: impl FnOnce(&mut EbpfBackend, &Path) -> Result<(), BackendError>,
) -> Result<(), BackendError> {
    load_object(pins, &sizes::for_load(pins, &Capacity::default())?)?;
    let mut backend = EbpfBackend::open_maps(pins)?;
    convert(&mut backend, aside)?;
    backend.merge_flows(aside)?;
    journal::note(journal::Change::Migrated(converted.to_owned()));
    relink(pins)?;
    backend.merge_flows(aside)?;
    stamp(pins)?;
    journal::note(journal::Change::Migrated(format!(
        "programs replaced, stamped layout {}",
        layout::VERSION
    )));
    fs::remove_dir_all(aside).map_err(pin_error(format!("could not remove {}", aside.display())))
}

/// Removes what a migration that stamped the new layout left behind.
pub fn finish(pins: &PinLayout) -> Result<(), BackendError> {
    for from in [FROM, SOURCES_APART[1], FLOWS_APART] {
        remove_tree(&aside(pins, from))?;
    }
    Ok(())
}

fn open_old<K: aya::Pod, V: aya::Pod>(path: &Path) -> Result<HashMap<MapData, K, V>, BackendError> {
    let error = |source| BackendError::Map {
        action: format!("could not open the old map {}", path.display()),
        source: Box::new(source),
    };
    let data = MapData::from_pin(path).map_err(error)?;
    HashMap::try_from(Map::from_map_data(data).map_err(error)?).map_err(error)
}

impl EbpfBackend {
    /// Step 3: every old `owners` and `endpoints` entry into the new maps (written again
    /// when a resumed run meets it twice).
    fn convert(&mut self, aside: &Path) -> Result<(), BackendError> {
        let old_owners = open_old::<u64, OwnerInfoV6>(&aside.join(endpoints::OWNERS.name))?;
        for entry in old_owners.iter() {
            let (id, old) = entry.map_err(map_error("could not read the old map owners"))?;
            let info = OwnerInfo {
                network: old.network,
                container_id: old.container_id,
                ifname: old.ifname,
                host_ifname: old.host_ifname,
                host_ifindex: old.host_ifindex,
                port_count: old.port_count,
                ..OwnerInfo::default()
            };
            self.endpoint
                .owners
                .insert(&id, &info, 0)
                .map_err(map_error("could not write map owners"))?;
        }
        let old_endpoints =
            open_old::<u32, EndpointInfoV6>(&aside.join(endpoints::ENDPOINTS.name))?;
        for entry in old_endpoints.iter() {
            let (ifindex, old) =
                entry.map_err(map_error("could not read the old map endpoints"))?;
            // Where its routed traffic enters the host: its bridge, else itself (also when it
            // is gone: DEL or a reclaim removes it).
            let gateway_ifindex = live_link(ifindex)?
                .and_then(|link| link.master)
                // fail-closed: `live_link` kept the errors; no bridge is the interface itself.
                .unwrap_or(ifindex);
            let info = EndpointInfoV8 {
                v6: old,
                // Layout 6 knew no `snat: false`. Its own clsact qdisc goes in step 4; any
                // other qdisc is shaping (as an ADD would find it).
                flags: if shaped(ifindex)? {
                    endpoints::FLAG_VIA_STACK
                } else {
                    0
                },
                gateway_ifindex,
            }
            .current();
            self.endpoint
                .endpoints
                .insert(&ifindex, &info, 0)
                .map_err(map_error("could not write map endpoints"))?;
        }
        Ok(())
    }

    /// Step 3 from layouts 7 and 8: every old `endpoints` record into the new map, with its
    /// interface's set from the old `sources` (written again when a resumed run meets it
    /// twice).
    fn merge_source_sets(&mut self, aside: &Path) -> Result<(), BackendError> {
        let old_endpoints =
            open_old::<u32, EndpointInfoV8>(&aside.join(endpoints::ENDPOINTS.name))?;
        for entry in old_endpoints.iter() {
            let (ifindex, old) =
                entry.map_err(map_error("could not read the old map endpoints"))?;
            if found(
                self.endpoint.endpoints.get(&ifindex, 0),
                endpoints::ENDPOINTS.name,
            )?
            .is_some_and(|current| current.sources.flags & FLAG_RECORDED != 0)
            {
                // Merged by the run this one resumes; the set is written again below.
                continue;
            }
            self.endpoint
                .endpoints
                .insert(&ifindex, &old.current(), 0)
                .map_err(map_error("could not write map endpoints"))?;
        }
        let sets = aside.join(SOURCES);
        let held = sets
            .try_exists()
            .map_err(pin_error(format!("could not look for {}", sets.display())))?;
        if !held {
            return Ok(());
        }
        for entry in open_old::<u32, SourceSet>(&sets)?.iter() {
            let (ifindex, set) = entry.map_err(map_error("could not read the old map sources"))?;
            self.endpoint.record_source_set(ifindex, &set)?;
        }
        Ok(())
    }

    /// Step 4 for containers: each live interface gets its tcx links, then loses its old
    /// filters (for a moment both run: the new programs pass on what is not cnibpf's, the old
    /// ones then find nothing of theirs either).
    fn rehook_endpoints(&self) -> Result<(), BackendError> {
        for entry in self.endpoint.owners.iter() {
            let (owner, info) = entry.map_err(map_error("could not read map owners"))?;
            let live = live_link(info.host_ifindex)?
                .is_some_and(|link| link.name == super::owner::read_name(&info.host_ifname));
            if !live {
                // Gone with its pod: DEL or a reclaim removes the rest.
                continue;
            }
            // Both hooks, as the layout it comes from had them: the next ADD of the
            // container drops one it does not need.
            self.hook_endpoint(owner, info.host_ifindex, true)?;
            unhook_legacy(info.host_ifindex).map_err(|source| BackendError::Pin {
                action: format!(
                    "could not remove the old filters of interface {}",
                    info.host_ifindex
                ),
                source: Box::new(source),
            })?;
        }
        Ok(())
    }
}
