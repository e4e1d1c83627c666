//! `masq_stats`: per-CPU counters of the masquerade datapath.
//!
//! A per-CPU array. Key: `u32` index 0. Value: [`MasqStats`]. Written by the programs only;
//! `cnibpf inspect` sums the CPUs, `bpftool map dump pinned <pinPath>/masq_stats` shows each.

use crate::impl_pod;
use crate::map_spec::{MapKind, MapSpec};

pub const STATS: MapSpec = MapSpec::new::<u32, MasqStats>("masq_stats", MapKind::PerCpuArray, 1);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MasqStats {
    /// Flows whose state was created.
    pub flows_created: u64,
    /// Candidate ports found taken while choosing a masquerade port.
    pub port_collisions: u64,
    /// Packets dropped because no free port was found within the retry bound.
    pub ports_exhausted: u64,
    /// Packets of a flow whose state had been evicted (table pressure): the state is rebuilt.
    pub state_lost: u64,
    /// Packets that met their flow's state expired (or made with an uplink address that has
    /// changed since): a packet from the container replaces it, a reply removes it.
    pub expired: u64,
    /// ICMP errors about masqueraded packets translated back to their container.
    pub icmp_errors: u64,
    /// Masqueraded packets dropped because their uplink has no address of their family.
    pub no_uplink_address: u64,
}
const _: () = assert!(size_of::<MasqStats>() == 56);

impl_pod!(MasqStats);
