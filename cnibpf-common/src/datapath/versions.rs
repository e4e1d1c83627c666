//! `map_versions`: the version of each pinned map's key and value types
//! ([`crate::map_spec::MapSpec::version`]), so that a build meeting maps of another version
//! migrates those maps alone.
//!
//! Key: [`MapName`], a map's pin name. Value: `u32`, its version. Written by userspace with
//! the layout stamp, for every map of the build (a pinned map without an entry was pinned by
//! a build before per-map versions: version 1); read by userspace when the stamp names
//! another build's programs. The eBPF programs never read it.

use crate::impl_pod;
use crate::map_spec::{MapKind, MapSpec};

pub const MAP_VERSIONS: MapSpec = MapSpec::new::<MapName, u32>("map_versions", MapKind::Hash, 64);

/// The longest pin name [`MapName`] holds.
pub const MAX_NAME_LEN: usize = 31;

/// A map's pin name, NUL-padded.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MapName {
    pub name: [u8; 32],
}
const _: () = assert!(size_of::<MapName>() == 32);

impl MapName {
    /// The key of the map named `name` (at most [`MAX_NAME_LEN`] bytes, which a unit test
    /// holds every spec to).
    pub const fn of(name: &str) -> Self {
        let bytes = name.as_bytes();
        let mut padded = [0u8; 32];
        let mut index = 0;
        while index < bytes.len() && index < MAX_NAME_LEN {
            padded[index] = bytes[index];
            index += 1;
        }
        Self { name: padded }
    }
}

impl_pod!(MapName);
