//! The pinned maps. Key, value and writer of each are documented with its type in
//! `cnibpf-common`; all are pinned by name under the instance's `pinPath`, so every program
//! instance and every plugin run shares them.

use aya_ebpf::{
    btf_maps::{Array, HashMap, LruHashMap},
    macros::btf_map,
};
use cnibpf_common::{
    layout::{self, LayoutInfo},
    nat_flow::{self, NatFlowKey, NatFlowValue},
    owner::{self, OwnerInfo},
    portmap::{self, PortMapKey, PortMapValue},
};

/// Map names are the pin names users pass to bpftool, so they are lowercase like the files.
#[expect(
    non_upper_case_globals,
    reason = "the static's name is the map's pin name"
)]
#[btf_map(pin_by_name)]
pub static portmap: HashMap<PortMapKey, PortMapValue, { portmap::MAX_ENTRIES as usize }> =
    HashMap::new();

#[expect(
    non_upper_case_globals,
    reason = "the static's name is the map's pin name"
)]
#[btf_map(pin_by_name)]
pub static nat_flows: LruHashMap<NatFlowKey, NatFlowValue, { nat_flow::MAX_ENTRIES as usize }> =
    LruHashMap::new();

#[expect(
    non_upper_case_globals,
    reason = "the static's name is the map's pin name"
)]
#[btf_map(pin_by_name)]
pub static owners: HashMap<u64, OwnerInfo, { owner::MAX_ENTRIES as usize }> = HashMap::new();

#[expect(
    non_upper_case_globals,
    reason = "the static's name is the map's pin name"
)]
#[btf_map(pin_by_name)]
pub static layout: Array<LayoutInfo, { layout::MAX_ENTRIES as usize }> = Array::new();
