//! The pinned maps. Key, value and writer of each are documented with its type in
//! `cnibpf-common`; all are pinned by name under the instance's `pinPath`, so every program
//! instance and every plugin run shares them.
#![expect(
    non_upper_case_globals,
    reason = "each map static's name is the map's pin name"
)]

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::{
        Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, PerCpuHashMap, ProgramArray, RingBuf,
    },
    macros::btf_map,
};
use cnibpf_common::{
    address::Address,
    connections::{self, Connection, ConnectionKey, FirstFragment, FragmentKey},
    datapath::{LayoutInfo, MapName, Settings, layout, settings, versions},
    drops::{self, DropCount, DropEventBudget, FilterEvent},
    endpoints::{self, EndpointInfo, OwnerInfo},
    filter::{
        self, AnswerBudget, FilterHits, FilterSet, FilterStats, MatchEvent, MatchEventBudget,
        NetworkMember, NetworkMemberKey, NetworkName,
    },
    masquerade::{
        self, HostClashes, MasqExcludeKey, MasqReply, MasqSource, MasqSourceKey, MasqStats,
        ReplyKey, UplinkInfo,
    },
    portmap::{
        self, HostAddrKey, OwnerPortKey, PortClaim, PortClaimKey, PortConditions,
        PortConditionsKey, PortMapKey, PortMapValue, SockRevKey, SockRevValue,
    },
    sources::{self, SourceDrops},
};

/// Map names are the pin names users pass to bpftool, so they are lowercase like the files.
#[btf_map(pin_by_name)]
pub static portmap: HashMap<PortMapKey, PortMapValue, { portmap::MAPPINGS.max_entries as usize }> =
    HashMap::new();

#[btf_map(pin_by_name)]
pub static connections: LruHashMap<
    ConnectionKey,
    Connection,
    { connections::CONNECTIONS.max_entries as usize },
> = LruHashMap::new();

#[btf_map(pin_by_name)]
pub static owners: HashMap<u64, OwnerInfo, { endpoints::OWNERS.max_entries as usize }> =
    HashMap::new();

#[btf_map(pin_by_name)]
pub static layout: Array<LayoutInfo, { layout::LAYOUT.max_entries as usize }> = Array::new();

#[btf_map(pin_by_name)]
pub static map_versions: HashMap<MapName, u32, { versions::MAP_VERSIONS.max_entries as usize }> =
    HashMap::new();

/// Replaced whole by userspace, like `filters`.
#[btf_map(pin_by_name)]
pub static endpoints: HashMap<
    u32,
    EndpointInfo,
    { endpoints::ENDPOINTS.max_entries as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

#[btf_map(pin_by_name)]
pub static host_addrs: HashMap<HostAddrKey, u32, { portmap::HOST_ADDRS.max_entries as usize }> =
    HashMap::new();

#[btf_map(pin_by_name)]
pub static settings: Array<Settings, { settings::SETTINGS.max_entries as usize }> = Array::new();

#[btf_map(pin_by_name)]
pub static sock_rev: LruHashMap<
    SockRevKey,
    SockRevValue,
    { portmap::HOST_SOCKETS.max_entries as usize },
> = LruHashMap::new();

#[btf_map(pin_by_name)]
pub static masq_sources: HashMap<
    MasqSourceKey,
    MasqSource,
    { masquerade::SOURCES.max_entries as usize },
> = HashMap::new();

#[btf_map(pin_by_name)]
pub static masq_excludes: LpmTrie<
    MasqExcludeKey,
    u32,
    { masquerade::EXCLUDES.max_entries as usize },
> = LpmTrie::new();

#[btf_map(pin_by_name)]
pub static uplinks: HashMap<u32, UplinkInfo, { masquerade::UPLINKS.max_entries as usize }> =
    HashMap::new();

#[btf_map(pin_by_name)]
pub static masq_replies: LruHashMap<
    ReplyKey,
    MasqReply,
    { masquerade::REPLIES.max_entries as usize },
> = LruHashMap::new();

#[btf_map(pin_by_name)]
pub static fragments: LruHashMap<
    FragmentKey,
    FirstFragment,
    { connections::FRAGMENTS.max_entries as usize },
> = LruHashMap::new();

#[btf_map(pin_by_name)]
pub static masq_stats: PerCpuArray<MasqStats, { masquerade::STATS.max_entries as usize }> =
    PerCpuArray::new();

#[btf_map(pin_by_name)]
pub static masq_host_clashes: Array<
    HostClashes,
    { masquerade::HOST_CLASHES.max_entries as usize },
> = Array::new();

/// Replaced whole by userspace, like `filters`.
#[btf_map(pin_by_name)]
pub static port_conditions: HashMap<
    PortConditionsKey,
    PortConditions,
    { portmap::CONDITIONS.max_entries as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

/// Replaced whole by userspace: without preallocation, the old element is freed only after
/// every program that may still read it is done (RCU), so a reader never sees a mix.
#[btf_map(pin_by_name)]
pub static filters: HashMap<
    u32,
    FilterSet,
    { filter::FILTERS.max_entries as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

#[btf_map(pin_by_name)]
pub static filter_hits: PerCpuHashMap<
    u32,
    FilterHits,
    { filter::HITS.max_entries as usize },
    { BPF_F_NO_PREALLOC as usize },
> = PerCpuHashMap::new();

#[btf_map(pin_by_name)]
pub static filter_events: RingBuf<FilterEvent, { drops::EVENTS.max_entries as usize }> =
    RingBuf::new();

#[btf_map(pin_by_name)]
pub static network_members: HashMap<
    NetworkMemberKey,
    NetworkMember,
    { filter::NETWORK_MEMBERS.max_entries as usize },
> = HashMap::new();

/// Userspace-only bookkeeping, declared here so that it is created and pinned with the rest.
#[btf_map(pin_by_name)]
pub static network_names: HashMap<
    u64,
    NetworkName,
    { filter::NETWORK_NAMES.max_entries as usize },
> = HashMap::new();

#[btf_map(pin_by_name)]
pub static answer_budgets: PerCpuHashMap<
    u32,
    AnswerBudget,
    { filter::ANSWER_BUDGETS.max_entries as usize },
    { BPF_F_NO_PREALLOC as usize },
> = PerCpuHashMap::new();

#[btf_map(pin_by_name)]
pub static answer_programs: ProgramArray<{ filter::ANSWER_PROGRAMS.max_entries as usize }> =
    ProgramArray::new();

#[btf_map(pin_by_name)]
pub static filter_matches: RingBuf<MatchEvent, { filter::MATCH_EVENTS.max_entries as usize }> =
    RingBuf::new();

#[btf_map(pin_by_name)]
pub static match_event_budget: PerCpuArray<
    MatchEventBudget,
    { filter::MATCH_EVENT_BUDGET.max_entries as usize },
> = PerCpuArray::new();

#[btf_map(pin_by_name)]
pub static source_drops: PerCpuHashMap<
    u32,
    SourceDrops,
    { sources::DROPS.max_entries as usize },
    { BPF_F_NO_PREALLOC as usize },
> = PerCpuHashMap::new();

#[btf_map(pin_by_name)]
pub static filter_stats: PerCpuArray<FilterStats, { filter::STATS.max_entries as usize }> =
    PerCpuArray::new();

#[btf_map(pin_by_name)]
pub static drop_stats: PerCpuArray<DropCount, { drops::DROP_STATS.max_entries as usize }> =
    PerCpuArray::new();

#[btf_map(pin_by_name)]
pub static drop_event_budget: PerCpuArray<
    DropEventBudget,
    { drops::EVENT_BUDGET.max_entries as usize },
> = PerCpuArray::new();

/// Userspace-only bookkeeping, declared here so that it is created and pinned with the rest.
#[btf_map(pin_by_name)]
pub static owner_ports: HashMap<
    OwnerPortKey,
    PortMapKey,
    { portmap::OWNER_PORTS.max_entries as usize },
> = HashMap::new();

/// Written by userspace; the sendmsg hooks read whether a port has any address-specific
/// mapping.
#[btf_map(pin_by_name)]
pub static port_claims: HashMap<PortClaimKey, PortClaim, { portmap::CLAIMS.max_entries as usize }> =
    HashMap::new();

/// Whether `port` (host byte order) of host address `addr` is a hostPort.
pub fn is_host_port(addr: &Address, port: u16, protocol: u8, family: u8) -> bool {
    let mut key = PortMapKey {
        host_addr: *addr,
        host_port: port,
        protocol,
        family,
    };
    if portmap.get_ptr(&key).is_some() {
        return true;
    }
    key.host_addr = Address::UNSPECIFIED;
    portmap.get_ptr(&key).is_some()
}

/// Whether a host socket bound to `addr` (all zero: the wildcard) and `port` (host byte order)
/// may receive what comes to a hostPort: a mapping of that address or the wildcard one, and
/// for the wildcard socket a mapping of any address (`port_claims`, which counts them and is
/// never lower than `portmap` holds).
pub fn is_host_port_number(addr: &Address, port: u16, protocol: u8, family: u8) -> bool {
    if *addr != Address::UNSPECIFIED {
        return is_host_port(addr, port, protocol, family);
    }
    let wildcard = PortMapKey {
        host_addr: Address::UNSPECIFIED,
        host_port: port,
        protocol,
        family,
    };
    if portmap.get_ptr(&wildcard).is_some() {
        return true;
    }
    let claim = PortClaimKey {
        host_port: port,
        protocol,
        family,
    };
    port_claims
        .get_ptr(&claim)
        // SAFETY: points into `port_claims`, read at once.
        .is_some_and(|claim| unsafe { (*claim).specific } != 0)
}

/// Whether `addr` is an address of an attachment of network `network` (`network_members`).
#[inline(always)]
pub fn is_network_member(network: u64, addr: &Address, family: u8) -> bool {
    let key = NetworkMemberKey {
        network,
        addr: *addr,
        family,
        _pad: 0,
        _pad2: 0,
        _pad3: 0,
    };
    network_members.get_ptr(&key).is_some()
}

/// Whether `addr` is one of the host's own addresses (`host_addrs`).
pub fn is_host_address(addr: &Address, family: u8) -> bool {
    let key = HostAddrKey {
        addr: *addr,
        family,
        _pad: 0,
        _pad2: 0,
    };
    host_addrs.get_ptr(&key).is_some()
}

/// Counts a drop event that found `filter_events` full.
pub fn count_lost_event() {
    if let Some(stats) = filter_stats.get_ptr_mut(0) {
        // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
        unsafe { (*stats).events_lost += 1 };
    }
}

/// The `endpoints` flags of a container's host-side veth (zero for an unknown one).
#[inline(always)]
pub fn endpoint_flags(host_ifindex: u32) -> u32 {
    let endpoint = endpoint(host_ifindex);
    if endpoint.is_null() {
        return 0;
    }
    // SAFETY: points into `endpoints`, read at once.
    unsafe { (*endpoint).flags }
}

/// The `endpoints` record of a container's host-side veth, null for an unknown one. Not
/// inlined: its lookup key would otherwise sit in its callers' frames, under the filter's. (A
/// raw pointer: an `Option` returned from a BPF call comes back in a form the verifier
/// rejects.)
#[inline(never)]
pub fn endpoint(host_ifindex: u32) -> *const EndpointInfo {
    endpoints
        .get_ptr(&host_ifindex)
        .unwrap_or(core::ptr::null())
}
