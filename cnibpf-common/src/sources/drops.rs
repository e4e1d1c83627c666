//! `source_drops`: what each source-checked container sent from an address not its own.
//!
//! A per-CPU hash map (`BPF_F_NO_PREALLOC`). Key: `u32` ifindex of the host-side veth, as
//! `endpoints`. Value: [`SourceDrops`]. Created zeroed by the CNI plugin with the record's
//! source set and removed with it; incremented by `from_container` for every packet it drops for
//! its source. `cnibpf inspect` sums the CPUs.

use crate::impl_pod;
use crate::map_spec::{Dimension, MapKind, MapSpec, Sizing};

pub const DROPS: MapSpec =
    MapSpec::new::<u32, SourceDrops>("source_drops", MapKind::PerCpuHash, 4_096)
        .sized(Sizing::Times(Dimension::Attachments, 1));

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SourceDrops {
    pub packets: u64,
    pub bytes: u64,
}
const _: () = assert!(size_of::<SourceDrops>() == 16);

impl_pod!(SourceDrops);
