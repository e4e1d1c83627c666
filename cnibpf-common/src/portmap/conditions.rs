//! `port_conditions`: who may reach an attachment's hostPorts (the reference portmap's
//! `conditionsV4` / `conditionsV6`).
//!
//! Key: [`PortConditionsKey`] — (owner id, family). Value: [`PortConditions`] — terms grouped
//! into clauses; a clause holds when any of its terms matches (or, negated, when none does),
//! and the hostPorts of the family are translated only when every clause holds. Written by the
//! CNI plugin (ADD, DEL, GC) for attachments whose configuration has conditions; read by
//! `uplink_ingress`, `from_container` (hairpin) and the socket hooks for mappings whose
//! `PortMapValue::flags` has [`crate::portmap::FLAG_CONDITIONED`].

use crate::map_spec::{Dimension, MapKind, MapSpec, Sizing};
use crate::{address::Address, impl_pod};

/// One entry per attachment and family at most.
pub const CONDITIONS: MapSpec =
    MapSpec::new::<PortConditionsKey, PortConditions>("port_conditions", MapKind::Hash, 8_192)
        .sized(Sizing::Times(Dimension::Attachments, 2));
/// Terms per entry (all clauses together).
pub const MAX_TERMS: usize = 16;

/// `ConditionTerm::kind`: the client's address is in `addr`/`mask`.
pub const KIND_SOURCE: u8 = 1;
/// The address the client sent to is in `addr`/`mask`.
pub const KIND_DESTINATION: u8 = 2;
/// The traffic came in on interface `ifindex` (host processes come in on none).
pub const KIND_IN_INTERFACE: u8 = 3;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PortConditionsKey {
    pub owner: u64,
    /// `FAMILY_IPV4` or `FAMILY_IPV6`.
    pub family: u8,
    pub _pad: u8,
    pub _pad2: u16,
    pub _pad3: u32,
}
const _: () = assert!(size_of::<PortConditionsKey>() == 16);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConditionTerm {
    /// Network address, already masked (IPv4 in the first four bytes).
    pub addr: Address,
    pub mask: Address,
    pub ifindex: u32,
    /// `KIND_*`.
    pub kind: u8,
    /// The clause the term belongs to (0 to 15).
    pub clause: u8,
    pub _pad: u16,
}
const _: () = assert!(size_of::<ConditionTerm>() == 40);

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortConditions {
    pub terms: [ConditionTerm; MAX_TERMS],
    /// Terms in use.
    pub term_count: u8,
    /// Clauses in use (bits `0..clause_count` of the masks below).
    pub clause_count: u8,
    /// Bit per clause: the clause holds when none of its terms matches.
    pub negated: u16,
    pub _pad: u32,
}
const _: () = assert!(size_of::<PortConditions>() == 648);

impl Default for PortConditions {
    fn default() -> Self {
        Self {
            terms: [ConditionTerm::default(); MAX_TERMS],
            term_count: 0,
            clause_count: 0,
            negated: 0,
            _pad: 0,
        }
    }
}

impl_pod!(PortConditionsKey, PortConditions);
