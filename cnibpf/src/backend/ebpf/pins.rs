//! What lives under `pinPath` besides the maps' contents: the object's programs, the layout
//! stamp, and the links. Loading pins a program instance per hook; an upgrade loads the new
//! object beside the old maps and moves every pinned link to the new programs atomically.

use std::{fmt, fs, io, path::Path};

use aya::{
    EbpfLoader,
    maps::{Array, HashMap, Map, MapData, MapError},
    programs::{
        CgroupSockAddr, Program, RawTracePoint, SchedClassifier,
        cgroup_sock_addr::{CgroupSockAddrAttachType, CgroupSockAddrLink},
        links::{FdLink, PinnedLink},
        tc::SchedClassifierLink,
    },
};
use cnibpf_common::datapath::{LayoutInfo, MAP_VERSIONS, MapName, Settings, layout, settings};
use nix::{
    mount::{MsFlags, mount},
    sys::statfs::statfs,
};

use super::{
    batch, kernel_btf,
    unpin::{detach_link, detach_links, remove_pin},
};
use crate::{
    backend::BackendError,
    netns,
    paths::{BPFFS_MOUNT_POINT, PinLayout},
    phases,
};

/// The programs, with the hook each attaches to.
pub(super) const UPLINK_INGRESS: &str = "uplink_ingress";
pub(super) const UPLINK_EGRESS: &str = "uplink_egress";
pub(super) const FROM_CONTAINER: &str = "from_container";
pub(super) const TO_CONTAINER: &str = "to_container";
const TC_PROGRAMS: [&str; 4] = [UPLINK_INGRESS, UPLINK_EGRESS, FROM_CONTAINER, TO_CONTAINER];
/// The program that answers what a REJECT rule refused: attached nowhere, the TC programs
/// tail-call it through `answer_programs`, which every load points at the program it loaded.
pub(super) const ANSWER_PROGRAM: &str = "reject_answer";

/// The qdisc watcher (see the eBPF crate's `hooks::qdisc`) and the raw tracepoint it runs at.
pub(super) const QDISC_WATCHER: &str = "qdisc_created";
pub(super) const QDISC_TRACEPOINT: &str = "qdisc_create";

/// The socket hooks of host processes, attached to the instance's cgroup.
pub(super) const SOCK_PROGRAMS: [(&str, CgroupSockAddrAttachType); 8] = [
    ("sock_connect4", CgroupSockAddrAttachType::Connect4),
    ("sock_connect6", CgroupSockAddrAttachType::Connect6),
    ("sock_sendmsg4", CgroupSockAddrAttachType::UDPSendMsg4),
    ("sock_sendmsg6", CgroupSockAddrAttachType::UDPSendMsg6),
    ("sock_recvmsg4", CgroupSockAddrAttachType::UDPRecvMsg4),
    ("sock_recvmsg6", CgroupSockAddrAttachType::UDPRecvMsg6),
    ("sock_peername4", CgroupSockAddrAttachType::GetPeerName4),
    ("sock_peername6", CgroupSockAddrAttachType::GetPeerName6),
];

/// The datapath object built by `cargo xtask build-ebpf`, embedded at compile time.
pub(super) static OBJECT: &[u8] = aya::include_bytes_aligned!(env!("CNIBPF_EBPF_OBJECT"));
/// Hash of [`OBJECT`] (computed by build.rs), recorded in the `layout` map with the programs.
const OBJECT_ID: &str = env!("CNIBPF_EBPF_OBJECT_ID");

/// `statfs` magic of bpffs.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

pub(super) fn all_programs() -> impl Iterator<Item = &'static str> {
    TC_PROGRAMS
        .into_iter()
        .chain([ANSWER_PROGRAM])
        .chain(SOCK_PROGRAMS.iter().map(|(name, _)| *name))
        .chain([QDISC_WATCHER])
}

/// Whether every program of this build is pinned under `pins`.
pub(super) fn all_programs_pinned(pins: &PinLayout) -> Result<bool, BackendError> {
    for name in all_programs() {
        let path = pins.program(name);
        let pinned = path.try_exists().map_err(|source| BackendError::Pin {
            action: format!("could not look for pinned program {}", path.display()),
            source: Box::new(source),
        })?;
        if !pinned {
            return Ok(false);
        }
    }
    Ok(true)
}

/// What the pinned state is, where this build neither writes nor migrates it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found {
    /// The layout the stamp names.
    Layout(u32),
    /// The version `map_versions` gives one map (the stamp being of this build's family).
    Map { name: &'static str, version: u32 },
}

impl Found {
    /// This build's counterpart, as messages name it.
    pub fn ours(self) -> String {
        match self {
            Self::Layout(_) => format!("v{}", layout::stamped()),
            Self::Map { name, .. } => format!(
                "version {}",
                // fail-closed: an Option of a lookup; the name is one of this build's specs.
                cnibpf_common::map(name).map_or(0, |spec| spec.version)
            ),
        }
    }

    /// Whether a newer cnibpf wrote it (a rollback).
    pub fn is_newer(self) -> bool {
        match self {
            Self::Layout(version) => version > layout::VERSIONED,
            Self::Map { name, version } => {
                cnibpf_common::map(name).is_some_and(|spec| version > spec.version)
            }
        }
    }
}

impl fmt::Display for Found {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Layout(version) => write!(formatter, "layout v{version}"),
            Self::Map { name, version } => write!(formatter, "map {name} at version {version}"),
        }
    }
}

pub(super) fn object_id() -> u64 {
    OBJECT_ID.parse().expect("build.rs emits a u64")
}

/// Whether a map of the instance is pinned at `path`.
pub(super) fn map_pinned(pins: &PinLayout, path: &Path) -> Result<bool, BackendError> {
    path.try_exists()
        .map_err(|source| BackendError::UnreadableState {
            path: pins.root().to_owned(),
            source,
        })
}

/// Points a pinned cgroup link at the socket hook now pinned under the same name.
fn relink_cgroup(pins: &PinLayout, path: &Path, program_name: &str) -> Result<(), BackendError> {
    let Some((name, attach_type)) = SOCK_PROGRAMS.iter().find(|(name, _)| *name == program_name)
    else {
        // A hook this build no longer has.
        return detach_link(path);
    };
    let link_error = |source: Box<dyn std::error::Error + Send + Sync>| BackendError::Pin {
        action: format!("could not move link {} to the new {name}", path.display()),
        source,
    };
    let mut program = CgroupSockAddr::from_pin(pins.program(name), *attach_type)
        .map_err(|error| link_error(Box::new(error)))?;
    let pinned = PinnedLink::from_pin(path).map_err(|error| link_error(Box::new(error)))?;
    let link = CgroupSockAddrLink::try_from(FdLink::from(pinned))
        .map_err(|error| link_error(Box::new(error)))?;
    let moved = program
        .attach_to_link(link)
        .map(|link_id| drop(program.take_link(link_id)));
    settle_relink(moved, path, link_error)
}

/// Moves a pinned raw tracepoint link to the program now pinned under its name. The kernel
/// cannot point such a link at another program: the old one is detached and the new one
/// attached (a qdisc added in between is seen by its container's next ADD).
fn relink_tracepoint(
    pins: &PinLayout,
    path: &Path,
    program_name: &str,
) -> Result<(), BackendError> {
    detach_link(path)?;
    if program_name == QDISC_WATCHER {
        attach_tracepoint(pins, QDISC_WATCHER, QDISC_TRACEPOINT)?;
    }
    Ok(())
}

/// Attaches the pinned program `program_name` to raw tracepoint `tracepoint` and pins its
/// link (`PinLayout::tracepoint_link`), unless a link is pinned there already.
pub(super) fn attach_tracepoint(
    pins: &PinLayout,
    program_name: &str,
    tracepoint: &str,
) -> Result<(), BackendError> {
    let link_pin = pins.tracepoint_link(program_name);
    let pinned = link_pin.try_exists().map_err(|source| BackendError::Pin {
        action: format!("could not look for link {}", link_pin.display()),
        source: Box::new(source),
    })?;
    if pinned {
        return Ok(());
    }
    let program_path = pins.program(program_name);
    let program_error = |action: String| {
        move |source| BackendError::Program {
            action,
            source: Box::new(source),
        }
    };
    let mut program = RawTracePoint::from_pin(&program_path).map_err(program_error(format!(
        "could not open pinned program {}",
        program_path.display()
    )))?;
    let link_id = program.attach(tracepoint).map_err(program_error(format!(
        "could not attach {program_name} to tracepoint {tracepoint}"
    )))?;
    let link = program.take_link(link_id).map_err(program_error(format!(
        "could not take the link of {program_name}"
    )))?;
    FdLink::from(link)
        .pin(&link_pin)
        .map_err(|source| BackendError::Pin {
            action: format!("could not pin link {}", link_pin.display()),
            source: Box::new(source),
        })?;
    Ok(())
}

/// The TC program a pinned tcx link (by its file name, see `PinLayout`) belongs to.
fn program_of_tc_link(file_name: &str) -> Option<&'static str> {
    if file_name.starts_with("uplink-") {
        Some(if file_name.ends_with("-ingress") {
            UPLINK_INGRESS
        } else {
            UPLINK_EGRESS
        })
    } else if file_name.starts_with("endpoint-") {
        Some(if file_name.ends_with("-from") {
            FROM_CONTAINER
        } else {
            TO_CONTAINER
        })
    } else {
        None
    }
}

/// What is left to do once `attach_to_link` moved (or failed to move) the link pinned at
/// `path`: nothing, unpin a link whose interface or cgroup is gone, or report the failure.
fn settle_relink(
    moved: Result<(), aya::programs::ProgramError>,
    path: &Path,
    link_error: impl Fn(Box<dyn std::error::Error + Send + Sync>) -> BackendError,
) -> Result<(), BackendError> {
    match moved {
        Ok(()) => Ok(()),
        Err(aya::programs::ProgramError::SyscallError(error))
            if error.io_error.raw_os_error() == Some(libc::ENOLINK) =>
        {
            remove_pin(path)
        }
        Err(error) => Err(link_error(Box::new(error))),
    }
}

/// Points every pinned link at the program now pinned for its hook (`bpf_link_update`, atomic
/// per link). Links whose interface is gone are unpinned instead. The qdisc watcher is attached
/// if it is not (state of a build that had none).
pub(super) fn relink(pins: &PinLayout) -> Result<(), BackendError> {
    let links_dir = pins.links_dir();
    let entries = fs::read_dir(&links_dir).map_err(|source| BackendError::Pin {
        action: format!("could not list {}", links_dir.display()),
        source: Box::new(source),
    })?;
    for entry in entries {
        let entry = entry.map_err(|source| BackendError::Pin {
            action: format!("could not list {}", links_dir.display()),
            source: Box::new(source),
        })?;
        let path = entry.path();
        let file_name = entry.file_name().to_string_lossy().into_owned();
        if let Some(program_name) = file_name.strip_prefix("cgroup-") {
            relink_cgroup(pins, &path, program_name)?;
            continue;
        }
        if let Some(program_name) = file_name.strip_prefix("tracepoint-") {
            relink_tracepoint(pins, &path, program_name)?;
            continue;
        }
        let Some(program_name) = program_of_tc_link(&file_name) else {
            continue;
        };
        let program_path = pins.program(program_name);
        let mut program =
            SchedClassifier::from_pin(&program_path).map_err(|source| BackendError::Program {
                action: format!("could not open pinned program {}", program_path.display()),
                source: Box::new(source),
            })?;
        let link_error = |source: Box<dyn std::error::Error + Send + Sync>| BackendError::Pin {
            action: format!(
                "could not move link {} to the new {program_name}",
                path.display()
            ),
            source,
        };
        let pinned = PinnedLink::from_pin(&path).map_err(|error| link_error(Box::new(error)))?;
        let link = SchedClassifierLink::try_from(FdLink::from(pinned))
            .map_err(|error| link_error(Box::new(error)))?;
        // Dropping the program would detach nothing (tcx links live on through their pin), but
        // taking the link out states that this process keeps no hold on it.
        let moved = program
            .attach_to_link(link)
            .map(|link_id| drop(program.take_link(link_id)));
        settle_relink(moved, &path, link_error)?;
    }
    attach_tracepoint(pins, QDISC_WATCHER, QDISC_TRACEPOINT)
}

/// The size a map is to be loaded with, and whether it is a resize's new map (pinned in
/// `resize/` until step 5).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct MapSize {
    pub name: &'static str,
    pub entries: u32,
    pub resized: bool,
}

/// Loads the embedded object, reusing maps already pinned under `pins` and pinning new ones,
/// then pins each program (the caller moves the links to them, then [`stamp`]s). `sizes` gives
/// each sized map's `max_entries` (a pinned map is reused only at its own size); `created_new`
/// names the maps a resize or a migration replaces, created in `resize/`.
pub(super) fn load_object(
    pins: &PinLayout,
    sizes: &[MapSize],
    created_new: &[&str],
) -> Result<(), BackendError> {
    let offsets = kernel_btf::device_offsets().map_err(|source| BackendError::Pin {
        action: "could not find the kernel's struct offsets the qdisc watcher reads".to_owned(),
        source: Box::new(source),
    })?;
    let mut loader = EbpfLoader::new();
    loader
        .default_map_pin_directory(pins.root())
        .override_global("NET_DEVICE_IFINDEX", &offsets.ifindex, true)
        .override_global("NET_DEVICE_NAMESPACE", &offsets.namespace, true)
        .override_global("NET_COOKIE", &offsets.namespace_cookie, true);
    for size in sizes {
        loader.map_max_entries(size.name, size.entries);
    }
    for name in created_new {
        loader.map_pin_path(name, pins.resized_map(name));
    }
    let mut ebpf = loader
        .load(OBJECT)
        .map_err(|error| BackendError::Load(Box::new(error)))?;
    phases::mark("object parse and maps");
    for (name, program) in ebpf.programs_mut() {
        let loaded = match program {
            Program::SchedClassifier(program) => program.load(),
            Program::CgroupSockAddr(program) => program.load(),
            Program::RawTracePoint(program) => program.load(),
            _ => Err(aya::programs::ProgramError::UnexpectedProgramType),
        };
        loaded.map_err(|source| BackendError::Program {
            action: format!("the kernel rejected program {name}"),
            source: Box::new(source),
        })?;
        phases::mark("verifier");
        let path = pins.program(name);
        remove_pin(&path)?;
        program.pin(&path).map_err(|source| BackendError::Pin {
            action: format!("could not pin program {}", path.display()),
            source: Box::new(source),
        })?;
        phases::mark("pins");
    }
    point_answer_programs(&mut ebpf)?;
    let host_netns_cookie = netns::current_cookie().map_err(|source| BackendError::Pin {
        action: "could not read the host's network namespace cookie".to_owned(),
        source: Box::new(source),
    })?;
    set_only_entry(
        &mut ebpf,
        settings::SETTINGS.name,
        &Settings { host_netns_cookie },
    )?;
    Ok(())
}

/// Points `answer_programs` at the answer program just loaded: until then the (pinned) array
/// holds the one an earlier load made, or nothing, when a refused packet is dropped unanswered.
fn point_answer_programs(ebpf: &mut aya::Ebpf) -> Result<(), BackendError> {
    let name = cnibpf_common::filter::ANSWER_PROGRAMS.name;
    let map_error = |source| BackendError::Map {
        action: format!("could not point map {name} at {ANSWER_PROGRAM}"),
        source: Box::new(source),
    };
    // Taken out of the object (its pin stays): the program is borrowed beside it.
    let mut array = ebpf
        .take_map(name)
        .ok_or_else(|| {
            map_error(MapError::InvalidName {
                name: name.to_owned(),
            })
        })
        .and_then(|map| aya::maps::ProgramArray::try_from(map).map_err(map_error))?;
    let program_error = |source| BackendError::Program {
        action: format!("could not open program {ANSWER_PROGRAM}"),
        source: Box::new(source),
    };
    let program: &SchedClassifier = ebpf
        .program(ANSWER_PROGRAM)
        .ok_or_else(|| aya::programs::ProgramError::InvalidName {
            name: ANSWER_PROGRAM.to_owned(),
        })
        .and_then(TryInto::try_into)
        .map_err(program_error)?;
    array
        .set(0, program.fd().map_err(program_error)?, 0)
        .map_err(map_error)
}

/// Maps earlier builds pinned that no program of this one uses: the later fragments of each
/// feature's datagrams, which follow their first fragment's ports in `fragments` now. Their
/// types are unchanged, so a build that has them (a rollback) creates them again.
const RETIRED_MAPS: [&str; 3] = ["masq_fragments", "nat_fragments", "filter_fragments"];

/// Writes the layout stamp: the state is this layout's, with this build's programs, and every
/// link runs them. Last of a load or a migration, so that a crash before it makes the next run
/// do it all again. The maps no program of this build uses go first (the links run this
/// build's programs by now).
pub(super) fn stamp(pins: &PinLayout) -> Result<(), BackendError> {
    for name in RETIRED_MAPS {
        remove_pin(&pins.map(name))?;
    }
    record_versions(pins)?;
    let path = pins.map(layout::LAYOUT.name);
    let error = |source| BackendError::Map {
        action: format!("could not stamp {}", path.display()),
        source: Box::new(source),
    };
    let data = MapData::from_pin(&path).map_err(error)?;
    let mut array: Array<MapData, LayoutInfo> =
        Array::try_from(Map::from_map_data(data).map_err(error)?).map_err(error)?;
    array
        .set(0, &LayoutInfo::current(object_id()), 0)
        .map_err(error)
}

/// Records every map of this build at its version (before the layout stamp, which says the
/// record is whole).
fn record_versions(pins: &PinLayout) -> Result<(), BackendError> {
    let versions = open_versions(pins)?;
    let entries: Vec<(MapName, u32)> = cnibpf_common::maps()
        .map(|spec| (MapName::of(spec.name), spec.version))
        .collect();
    batch::insert_all(&versions, &entries).map_err(|source| BackendError::MapWrite {
        name: MAP_VERSIONS.name,
        source,
    })
}

pub(super) fn open_versions(
    pins: &PinLayout,
) -> Result<HashMap<MapData, MapName, u32>, BackendError> {
    let path = pins.map(MAP_VERSIONS.name);
    let error = |source| BackendError::Map {
        action: format!("could not open map {}", path.display()),
        source: Box::new(source),
    };
    let data = MapData::from_pin(&path).map_err(error)?;
    HashMap::try_from(Map::HashMap(data)).map_err(error)
}

/// Writes the single entry of the one-entry array map `name` of the loaded object.
fn set_only_entry<T: aya::Pod>(
    ebpf: &mut aya::Ebpf,
    name: &str,
    value: &T,
) -> Result<(), BackendError> {
    let map = ebpf.map_mut(name).ok_or_else(|| {
        BackendError::Load(Box::new(aya::EbpfError::MapError(MapError::InvalidName {
            name: name.to_owned(),
        })))
    })?;
    let mut array: Array<&mut MapData, T> =
        Array::try_from(map).map_err(|source| BackendError::Map {
            action: format!("could not open map {name}"),
            source: Box::new(source),
        })?;
    array.set(0, value, 0).map_err(|source| BackendError::Map {
        action: format!("could not write map {name}"),
        source: Box::new(source),
    })
}

/// Mounts bpffs if the host has none at the usual place and creates the pin directories.
pub(super) fn prepare_pin_dir(pins: &PinLayout) -> Result<(), BackendError> {
    let root = pins.root();
    let error = |path: &Path| {
        let path = path.to_owned();
        move |source| BackendError::Bpffs { path, source }
    };
    if root.starts_with(BPFFS_MOUNT_POINT) {
        mount_bpffs(Path::new(BPFFS_MOUNT_POINT))?;
    }
    // Checked on the nearest existing ancestor, so that a wrong pinPath creates nothing.
    let mut existing = root;
    for ancestor in root.ancestors() {
        if ancestor.try_exists().map_err(error(ancestor))? {
            existing = ancestor;
            break;
        }
    }
    if !is_bpffs(existing).map_err(error(existing))? {
        return Err(error(root)(io::Error::other(
            "not on a bpf filesystem (mount -t bpf bpf <dir>)",
        )));
    }
    for dir in [pins.programs_dir(), pins.links_dir()] {
        fs::create_dir_all(&dir).map_err(error(&dir))?;
    }
    Ok(())
}

/// Removes every pinned object of the instance and its directory: links detached (tcx hooks,
/// socket hooks, the tracepoint), maps and programs freed once no process holds them.
/// What it removed, by kind; nothing when there was no instance.
pub fn remove_pinned(pins: &PinLayout) -> Result<Vec<String>, BackendError> {
    let root = pins.root();
    let error = |path: &Path| {
        let path = path.to_owned();
        move |source| BackendError::Unpin { path, source }
    };
    if !root.try_exists().map_err(error(root))? {
        return Ok(Vec::new());
    }
    // The entries of `dir` but its subdirectories of programs and links.
    let count = |dir: &Path| -> Result<usize, BackendError> {
        let entries = match fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(source) if source.kind() == io::ErrorKind::NotFound => return Ok(0),
            Err(source) => return Err(error(dir)(source)),
        };
        let mut pinned = 0;
        for entry in entries {
            let path = entry.map_err(error(dir))?.path();
            if path != pins.programs_dir() && path != pins.links_dir() {
                pinned += 1;
            }
        }
        Ok(pinned)
    };
    let (links, programs, maps) = (
        count(&pins.links_dir())?,
        count(&pins.programs_dir())?,
        count(root)?,
    );
    // Links first: a hook is detached before the program it runs is unpinned.
    detach_links(pins)?;
    for dir in [pins.links_dir(), pins.programs_dir()] {
        match fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(source) if source.kind() == io::ErrorKind::NotFound => {}
            Err(source) => return Err(error(&dir)(source)),
        }
    }
    fs::remove_dir_all(root).map_err(error(root))?;
    Ok(vec![format!(
        "eBPF datapath {}: {links} links (hooks detached), {programs} programs, {maps} maps",
        root.display()
    )])
}

/// Mounts a bpffs at `mount_point` unless one is mounted there; whether it mounted one.
pub fn mount_bpffs(mount_point: &Path) -> Result<bool, BackendError> {
    let error = |source| BackendError::Bpffs {
        path: mount_point.to_owned(),
        source,
    };
    if is_bpffs(mount_point).map_err(error)? {
        return Ok(false);
    }
    fs::create_dir_all(mount_point).map_err(error)?;
    mount(
        Some("bpf"),
        mount_point,
        Some("bpf"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("mode=0700"),
    )
    .map_err(|errno| error(io::Error::from(errno)))?;
    Ok(true)
}

/// Whether `path` is on bpffs; a path that does not exist is not. Any other failure of
/// `statfs` is an error: read as "not bpffs", it would mount a new bpffs over the old one.
pub(super) fn is_bpffs(path: &Path) -> io::Result<bool> {
    match statfs(path) {
        Ok(stats) => Ok(stats.filesystem_type().0 == BPF_FS_MAGIC),
        Err(nix::errno::Errno::ENOENT) => Ok(false),
        Err(errno) => Err(io::Error::from(errno)),
    }
}
