//! `layout`: a one-entry array describing the pinned state.
//!
//! Key: `u32` index 0. Value: [`LayoutInfo`]. Written by userspace when it creates the pinned
//! maps or pins new programs; read by userspace on every later load, to refuse pinned state of
//! another layout instead of silently misreading it, and to notice programs pinned by another
//! build of the datapath (which it then replaces in place). The eBPF programs never read it.
//!
//! What every layout keeps, so that any build can tell what it meets and a downgraded one can
//! still release attachments: this map's name and type, the key of `owners` and the prefix of
//! its value up to [`crate::endpoints::owners::STABLE_PREFIX`], and the link pin names of `PinLayout`.

use crate::impl_pod;
use crate::map_spec::{MapKind, MapSpec};

pub const LAYOUT: MapSpec = MapSpec::new::<u32, LayoutInfo>("layout", MapKind::Array, 1);

/// `"cnibpf\0\0"` read as a little-endian integer: marks a `layout` map written by cnibpf.
pub const MAGIC: u64 = u64::from_le_bytes(*b"cnibpf\0\0");

/// The layout of state whose maps are all at their first version
/// ([`crate::map_spec::MapSpec::version`]), which every build since 0.5.0 reads. A change of one
/// map's types bumps that map's version, not this: see [`stamped`].
pub const VERSION: u32 = 10;

/// The layout of state with a map past its first version. Builds before per-map versions
/// (which know [`VERSION`] only) take it for a newer layout and drain it rather than misread
/// the map; later builds compare the maps' versions (`map_versions`).
pub const VERSIONED: u32 = 11;

/// The layout this build stamps: [`VERSION`] while every map is at its first version, else
/// [`VERSIONED`].
pub fn stamped() -> u32 {
    if crate::maps().all(|spec| spec.version == 1) {
        VERSION
    } else {
        VERSIONED
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayoutInfo {
    pub magic: u64,
    /// [`VERSION`] or [`VERSIONED`].
    pub version: u32,
    pub _pad: u32,
    /// Identity (a hash) of the eBPF object whose programs are pinned.
    pub object_id: u64,
}
const _: () = assert!(size_of::<LayoutInfo>() == 24);

impl LayoutInfo {
    pub fn current(object_id: u64) -> Self {
        Self {
            magic: MAGIC,
            version: stamped(),
            _pad: 0,
            object_id,
        }
    }
}

impl_pod!(LayoutInfo);
