//! Masquerade (SNAT of container traffic leaving through an uplink to the uplink's address):
//! its part of a connection's `connections` entry, and `masq_replies` to find it by the tuple
//! its replies arrive with.
//!
//! A container's packet is masqueraded when its source is in `masq_sources`, its destination is
//! not excluded (`masq_excludes`) and the FIB sends it out of an uplink (`uplinks`); anything
//! for the host itself or for another local interface is never an uplink's. At the container's
//! veth it is done and the packet sent straight out of the uplink; at the uplink's egress for
//! packets the host stack forwarded instead. Replies, and ICMP errors about masqueraded
//! packets, are translated back at the uplink's ingress for the hook to hand over.
//!
//! State is reclaimed without a daemon: an entry expires after its state's timeout
//! (`conntrack::timeout_ns`); the packet that meets an expired entry replaces it, the CNI
//! plugin's DEL and GC sweep expired entries away, and the LRU maps evict the least recently
//! used entries when full.

use core::mem::MaybeUninit;

use aya_ebpf::{btf_maps::PerCpuArray, macros::btf_map, programs::TcContext};
use cnibpf_common::{
    FAMILY_IPV4, PROTO_TCP,
    address::Address,
    connections::{Connection, PART_SNAT, conntrack},
    drops::DropReason,
    endpoints::{FLAG_MASQUERADED, FLAG_UNMASQUERADED},
    filter::DIRECTION_EGRESS,
    masquerade::{
        MasqExcludeKey, MasqSource, MasqSourceKey, MasqStats, ReplyKey, UplinkInfo,
        excludes::OWNER_FAMILY_BITS,
    },
};

mod guard;
mod icmp;
mod ports;
mod replies;

pub use guard::untranslated;
pub use replies::{lookup_reply, reply_connection, translate_icmp_error, translate_reply};

use crate::{
    connections, drops, maps,
    packet::{Answer, DROP, DatapathError, Flow, Fragment, NEXT, ifindex, or_verdict},
    route::{Route, forward, route, route_source},
    zero::{Zeroable, zeroed},
};
use ports::{claim_port, host_socket_holds};

/// What `masquerade::established` found of a container packet's source, for
/// `masquerade::from_container`, which runs after the hostPort checks ([`masquerade_scratch`]):
/// carried by the hook, the answer would make the verifier walk those checks once for each.
pub struct MasqueradedSource {
    /// The `masq_sources` entry of the source address, when `found` is [`SOURCE_FOUND`].
    pub source: MasqSource,
    /// `SOURCE_*`.
    pub found: u32,
}

/// [`MasqueradedSource::found`]: the source is not masqueraded through the interface at hand.
pub const SOURCE_NOT_MASQUERADED: u32 = 0;
/// It is, as `source` says.
pub const SOURCE_FOUND: u32 = 1;
/// The endpoint's record says its traffic is masqueraded, and `masq_sources` was not asked.
pub const SOURCE_NOT_LOOKED_UP: u32 = 2;

/// What masquerade found of the packet's source (see [`MasqueradedSource`]); private to each
/// loaded object, not pinned.
#[expect(
    non_upper_case_globals,
    reason = "the static's name is the map's name, like the pinned ones"
)]
#[btf_map]
pub static masquerade_scratch: PerCpuArray<MasqueradedSource, 1> = PerCpuArray::new();

/// A container's packet at its host-side veth that `established` did not send on, nor the
/// hostPort checks: masqueraded and sent out of the uplink the FIB chooses when its source is
/// masqueraded (as `established` found it), or left alone. Not inlined (nor are the functions
/// it calls): the verifier caps the stack of a whole call chain at 512 bytes.
#[inline(never)]
pub fn from_container(ctx: &TcContext, flow: &mut Flow) -> Result<i32, DatapathError> {
    let Some(found) = masquerade_scratch.get_ptr(0) else {
        return Ok(NEXT);
    };
    // SAFETY: this CPU's slot, written by `established` for this very packet.
    let state = unsafe { (*found).found };
    let source = match state {
        // SAFETY: as above.
        SOURCE_FOUND => unsafe { (*found).source },
        SOURCE_NOT_LOOKED_UP => match source_attached_here(ctx, flow) {
            Some(source) => source,
            None => return Ok(NEXT),
        },
        _ => return Ok(NEXT),
    };
    if is_excluded(source.owner, flow.family, &flow.daddr) {
        return Ok(NEXT);
    }
    // With the address the host sends from on that route, as its addresses are now: an
    // address added, removed or changed takes effect at the next packet, as with MASQUERADE.
    let next_hop = route(ctx, flow, true);
    let uplink_ifindex = match next_hop {
        Route::Neighbour { ifindex, .. } | Route::Unresolved { ifindex } => ifindex,
        // Local, unroutable, too big for the route, or no source address the FIB could
        // choose: the host stack decides, and `uplink_egress` masquerades what it forwards
        // out of an uplink.
        Route::Other => return Ok(NEXT),
    };
    let plan = match Plan::new(ctx, flow, source, uplink_ifindex, true) {
        Ok(Some(plan)) => plan,
        Ok(None) => return Ok(NEXT),
        Err(verdict) => return Ok(verdict),
    };
    if !flow.decrement_hop_limit(ctx)? {
        return Ok(NEXT);
    }
    if !masquerade(ctx, flow, &plan)? {
        return Ok(DROP);
    }
    Ok(forward(ctx, &next_hop)?.unwrap_or(NEXT))
}

/// Whether the packet's connection is live and masqueraded for the attachment `owner`.
fn is_live(flow: &Flow, owner: u64) -> bool {
    let now = flow.now;
    let entry = connections::find(&connections::key_of(flow, DIRECTION_EGRESS));
    // SAFETY: points into `connections`, read at once.
    !entry.is_null()
        && unsafe { (*entry).has(owner, PART_SNAT) && !(*entry).is_expired(flow.protocol, now) }
}

/// A container's packet at its host-side veth, of a connection masqueraded for the attachment
/// its source is masqueraded for: masqueraded with the flow's translation and sent
/// out of its uplink, when the FIB still sends it there from the address that translation uses
/// (`NOT_MINE` otherwise: the hostPort checks and `from_container` decide, the latter replacing
/// a translation whose address changed). An established flow keeps its translation as a
/// conntrack entry keeps its NAT binding: the exclusions and hostPorts it was checked against
/// when it began are not looked up again. What it finds of the source is left in
/// `masquerade_scratch` for `from_container`.
///
/// `flags` and `owner` are from the interface's `endpoints` record: one that says whether the
/// container is masqueraded spares the `masq_sources` lookup (a flow of `owner` was begun by
/// `from_container`, which checked the source against it); one of an older build says
/// neither, and the source is looked up. `connection` is the packet's `connections` entry as
/// the hook found it.
#[inline(never)]
pub fn established(
    ctx: &TcContext,
    flow: &mut Flow,
    flags: u32,
    owner: u64,
    connection: *mut Connection,
) -> Answer {
    let Some(found) = masquerade_scratch.get_ptr_mut(0) else {
        return Answer::NOT_MINE;
    };
    // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
    let found = unsafe { &mut *found };
    found.found = SOURCE_NOT_MASQUERADED;
    if flags & FLAG_UNMASQUERADED != 0 {
        return Answer::NOT_MINE;
    }
    let owner = if flags & FLAG_MASQUERADED != 0 {
        found.found = SOURCE_NOT_LOOKED_UP;
        owner
    } else {
        match source_attached_here(ctx, flow) {
            Some(source) => {
                (found.source, found.found) = (source, SOURCE_FOUND);
                source.owner
            }
            None => return Answer::NOT_MINE,
        }
    };
    if flow.fragment != Fragment::Whole {
        return Answer::NOT_MINE;
    }
    // SAFETY: points into `connections`; racing writers only refresh the same fields.
    let Some(state) = (unsafe { connection.as_mut() }) else {
        return Answer::NOT_MINE;
    };
    let now = flow.now;
    let flags = flow.tcp_flags;
    // Not masqueraded (a hostPort's connection, one only the filter tracks), another
    // attachment's (its address was given to this one since), a new connection on the tuple,
    // or expired state: the full path.
    if !state.has(owner, PART_SNAT)
        || conntrack::is_opening(flags)
        || state.is_expired(flow.protocol, now)
    {
        return Answer::NOT_MINE;
    }
    let next_hop = route(ctx, flow, true);
    let uplink_ifindex = match next_hop {
        Route::Neighbour { ifindex, .. } | Route::Unresolved { ifindex } => ifindex,
        Route::Other => return Answer::NOT_MINE,
    };
    let routed_from_nat_addr = route_source
        .get_ptr(0)
        // SAFETY: this CPU's slot, written by the lookup just made.
        .is_some_and(|source| unsafe { *source } == state.nat_addr);
    if uplink_ifindex != state.uplink_ifindex || !routed_from_nat_addr {
        return Answer::NOT_MINE;
    }
    let (nat_addr, nat_port) = (state.nat_addr, state.nat_port);
    if !or_verdict!(
        ctx,
        flow.rewrite_forwarded_source(ctx, &nat_addr, nat_port.to_be())
    ) {
        return Answer::NEXT;
    }
    let side = state.side(DIRECTION_EGRESS);
    conntrack::advance(state, flow.protocol, flags, side, now);
    Answer::verdict(or_verdict!(ctx, forward(ctx, &next_hop)).unwrap_or(NEXT))
}

/// A packet the host stack sends out of an uplink: masqueraded when it comes from a container
/// that `from_container` did not forward itself. Its verdict is final (the packet is no one
/// else's), returned as a plain integer: LLVM returns an `Option` from a BPF call with bits the
/// verifier sees uninitialised.
#[inline(never)]
pub fn uplink_egress(ctx: &TcContext, flow: &mut Flow) -> i32 {
    try_uplink_egress(ctx, flow).unwrap_or_else(|error| error.verdict(ctx))
}

fn try_uplink_egress(ctx: &TcContext, flow: &mut Flow) -> Result<i32, DatapathError> {
    let Some(source) = masqueraded_source(flow) else {
        return Ok(NEXT);
    };
    // A flow that began before its destination was excluded keeps its translation, as in
    // `established`.
    if is_excluded(source.owner, flow.family, &flow.daddr) && !is_live(flow, source.owner) {
        return Ok(NEXT);
    }
    let plan = match Plan::new(ctx, flow, source, ifindex(ctx), false) {
        Ok(Some(plan)) => plan,
        Ok(None) => return Ok(NEXT),
        Err(verdict) => return Ok(verdict),
    };
    if !masquerade(ctx, flow, &plan)? {
        return Ok(DROP);
    }
    Ok(NEXT)
}

/// What `masquerade` translates a packet with.
struct Plan {
    source: MasqSource,
    uplink_ifindex: u32,
    nat_addr: Address,
}

impl Plan {
    /// The plan for `flow`'s packet from `source` leaving through `uplink_ifindex`, from
    /// the address the FIB chose for it (`routed`: see `packet::route`) or else the uplink's
    /// address as the plugin recorded it;
    /// `None` when that interface is not an uplink (the packet is not masqueraded), the
    /// verdict `DROP` (the drop recorded) when the uplink has no address of the family (as the
    /// kernel's MASQUERADE drops it).
    #[inline(always)]
    fn new(
        ctx: &TcContext,
        flow: &Flow,
        source: MasqSource,
        uplink_ifindex: u32,
        routed: bool,
    ) -> Result<Option<Self>, i32> {
        let Some(uplink) = maps::uplinks.get_ptr(&uplink_ifindex) else {
            return Ok(None);
        };
        let chosen = if routed {
            route_source.get_ptr(0)
        } else {
            None
        };
        // SAFETY: both point into maps, read at once.
        let Some(nat_addr) = chosen
            .map(|slot| unsafe { *slot })
            .or_else(|| uplink_address(unsafe { &*uplink }, flow.family))
        else {
            count(|stats| &mut stats.no_uplink_address);
            dropped(
                ctx,
                flow,
                source.owner,
                DropReason::MasqueradeNoUplinkAddress,
            );
            return Err(DROP);
        };
        Ok(Some(Self {
            source,
            uplink_ifindex,
            nat_addr,
        }))
    }
}

/// Rewrites the packet's source to the uplink's address and the flow's port, creating the
/// flow's state when it has none (or only an expired one); `false` when no port was free.
#[inline(never)]
fn masquerade(ctx: &TcContext, flow: &mut Flow, plan: &Plan) -> Result<bool, DatapathError> {
    if flow.fragment == Fragment::Later {
        // No transport header, no state: the first fragment's translation covers the
        // datagram's checksum; the later ones need only the source address.
        flow.rewrite_source(ctx, &plan.nat_addr, flow.sport)?;
        return Ok(true);
    }
    let flags = flow.tcp_flags;
    let known_port = u16::try_from(masqueraded_port(flow, plan, flags)).ok();
    let nat_port = match known_port {
        Some(port) => port,
        None => {
            let keep_own_port = !host_socket_holds(ctx, flow, &plan.nat_addr);
            let Some(port) = claim_port(flow, plan, keep_own_port) else {
                count(|stats| &mut stats.ports_exhausted);
                dropped(
                    ctx,
                    flow,
                    plan.source.owner,
                    DropReason::MasqueradePortsExhausted,
                );
                return Ok(false);
            };
            record_flow(flow, plan, port, flow.now, flags);
            port
        }
    };
    flow.rewrite_source(ctx, &plan.nat_addr, nat_port.to_be())?;
    Ok(true)
}

/// The port the packet's live connection is masqueraded to (its state moved on), or -1 when
/// it needs a new one: it has no masquerade, an expired one, or one made with an uplink
/// address that has changed since. Apart from `masquerade`, so that the key's stack slot is
/// not held under the rewrite's call chain (and with few arguments: a BPF call takes five
/// registers, and the compiler passes `plan` by its fields).
#[inline(never)]
fn masqueraded_port(flow: &Flow, plan: &Plan, flags: u8) -> i32 {
    let now = flow.now;
    let entry = connections::find(&connections::key_of(flow, DIRECTION_EGRESS));
    // SAFETY: points into `connections`; racing writers only refresh the same fields.
    match unsafe { entry.as_mut() } {
        Some(state) if state.has(plan.source.owner, PART_SNAT) => {
            if state.is_expired(flow.protocol, now) || state.nat_addr != plan.nat_addr {
                count(|stats| &mut stats.expired);
                return -1;
            }
            let side = state.side(DIRECTION_EGRESS);
            conntrack::advance(state, flow.protocol, flags, side, now);
            i32::from(state.nat_port)
        }
        // A connection in the middle of its life without state: its state was evicted.
        _ if flow.protocol == PROTO_TCP && !conntrack::is_opening(flags) => {
            count(|stats| &mut stats.state_lost);
            -1
        }
        _ => -1,
    }
}

/// Records the masquerade of a connection whose port `claim_port` claimed, in the entry its
/// owner has (the filter's part may be there) or a new one. Called after `claim_port` rather
/// than from it, so that their stack frames are not stacked on each other.
#[inline(never)]
fn record_flow(flow: &Flow, plan: &Plan, nat_port: u16, now: u64, flags: u8) {
    let key = connections::key_of(flow, DIRECTION_EGRESS);
    let (entry, fresh) = connections::for_part(
        &key,
        plan.source.owner,
        flow.protocol,
        DIRECTION_EGRESS,
        flags,
        now,
    );
    if entry.is_null() {
        return;
    }
    // SAFETY: points into `connections`, or this CPU's scratch for a new entry.
    let connection = unsafe { &mut *entry };
    connection.nat_addr = plan.nat_addr;
    connection.uplink_ifindex = plan.uplink_ifindex;
    connection.nat_port = nat_port;
    connection.parts |= PART_SNAT;
    if fresh {
        connections::insert(&key, entry);
    }
    count(|stats| &mut stats.flows_created);
}

fn masqueraded_source(flow: &Flow) -> Option<MasqSource> {
    masqueraded_address(flow.family, &flow.saddr)
}

/// The `masq_sources` entry of a container address, when its traffic is masqueraded.
fn masqueraded_address(family: u8, addr: &Address) -> Option<MasqSource> {
    let key = MasqSourceKey {
        addr: *addr,
        family,
        _pad: 0,
        _pad2: 0,
    };
    // SAFETY: points into `masq_sources`, copied at once.
    maps::masq_sources
        .get_ptr(&key)
        .map(|source| unsafe { *source })
}

/// The `masq_sources` entry of a container packet's source when it arrived by the interface
/// the container was attached with: a container is masqueraded only through that one, and
/// another one sending with its address is spoofing it.
#[inline(always)]
fn source_attached_here(ctx: &TcContext, flow: &Flow) -> Option<MasqSource> {
    masqueraded_source(flow).filter(|source| source.host_ifindex == ifindex(ctx))
}

/// Whether `destination` is one the attachment's traffic is never masqueraded towards.
fn is_excluded(owner: u64, family: u8, destination: &Address) -> bool {
    let mut slot = MaybeUninit::uninit();
    let key = zeroed::<ExcludeLookup>(&mut slot);
    key.0.prefix_len = OWNER_FAMILY_BITS + 128;
    key.0.data.owner = owner.to_be_bytes();
    key.0.data.family = family;
    key.0.data.addr = destination.bytes;
    maps::masq_excludes.get(&key.0).is_some()
}

/// A `masq_excludes` lookup key, zeroed a word at a time: its padding is a byte array (the
/// key's layout is the trie's, byte-aligned).
struct ExcludeLookup(aya_ebpf::btf_maps::lpm_trie::Key<MasqExcludeKey>);

// SAFETY: a prefix length and a key of byte arrays.
unsafe impl Zeroable for ExcludeLookup {}

fn uplink_address(uplink: &UplinkInfo, family: u8) -> Option<Address> {
    let address = if family == FAMILY_IPV4 {
        Address::ipv4(uplink.addr_v4)
    } else {
        uplink.addr_v6
    };
    (address != Address::UNSPECIFIED).then_some(address)
}

/// The `masq_replies` key of a packet's own tuple (a reply's, at the uplink).
fn reply_key(flow: &Flow) -> ReplyKey {
    ReplyKey {
        src_addr: flow.saddr,
        dst_addr: flow.daddr,
        src_port: u16::from_be(flow.sport),
        dst_port: u16::from_be(flow.dport),
        protocol: flow.protocol,
        family: flow.family,
        _pad: 0,
    }
}

/// Counts and reports a packet masquerade drops, on the interface of the hook that drops it.
#[inline(never)]
fn dropped(ctx: &TcContext, flow: &Flow, owner: u64, reason: DropReason) {
    drops::count(reason, ctx.len());
    drops::report(reason, |event| {
        event.owner = owner;
        event.ifindex = ifindex(ctx);
        event.src_addr = flow.saddr;
        event.dst_addr = flow.daddr;
        event.src_port = u16::from_be(flow.sport);
        event.dst_port = u16::from_be(flow.dport);
        event.protocol = flow.protocol;
        event.family = flow.family;
    });
}

fn count(field: impl FnOnce(&mut MasqStats) -> &mut u64) {
    if let Some(stats) = maps::masq_stats.get_ptr_mut(0) {
        // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
        *field(unsafe { &mut *stats }) += 1;
    }
}
