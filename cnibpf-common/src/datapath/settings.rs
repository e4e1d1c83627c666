//! `settings`: instance-wide facts the programs need.
//!
//! Key: `u32` index 0. Value: [`Settings`]. Written by the CNI plugin when it loads the
//! programs; read by the socket hooks.

use crate::impl_pod;
use crate::map_spec::{MapKind, MapSpec};

pub const SETTINGS: MapSpec = MapSpec::new::<u32, Settings>("settings", MapKind::Array, 1);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    /// Network namespace cookie of the host: only sockets of this namespace are translated, so
    /// a process in a container connecting to its own 127.0.0.1 is left alone.
    pub host_netns_cookie: u64,
}
const _: () = assert!(size_of::<Settings>() == 8);

impl_pod!(Settings);
