//! Masquerade (SNAT of container traffic leaving through an uplink to the uplink's address):
//! its part of a connection's `connections` entry, and `masq_replies` to find it by the tuple
//! its replies arrive with.
//!
//! A container's packet is masqueraded when its source is in `masq_sources`, its destination is
//! not excluded (`masq_excludes`) and it leaves through an uplink (`uplinks`). A connection's
//! first packet crosses the host stack, so that the node's netfilter sees it (a Service's
//! `dnat`, the host's firewall): at the uplink's egress it is masqueraded, its state created,
//! and the node's conntrack asked what netfilter did with it (`netfilter::view`). A connection
//! netfilter left alone takes the fast path from then on: at the container's veth its packets
//! are rewritten and sent straight out of the uplink (`established`). One it translated keeps
//! crossing the stack both ways ([`FLAG_THROUGH_STACK`]); one the container only answers is not
//! masqueraded. Replies, and ICMP errors about masqueraded packets, are translated back at the
//! uplink's ingress for the hook to hand over.
//!
//! The host's own flows (`host`) never share a tuple with a container's on the wire: a host
//! socket's connection that would leave with a masqueraded connection's address and port
//! towards the same remote is moved to another port and translated back, as conntrack does.
//!
//! State is reclaimed without a daemon: an entry expires after its state's timeout
//! (`conntrack::timeout_ns`); the packet that meets an expired entry replaces it, the CNI
//! plugin's DEL and GC sweep expired entries away, and the LRU maps evict the least recently
//! used entries when full.

use core::mem::MaybeUninit;

use aya_ebpf::programs::TcContext;
use cnibpf_common::{
    FAMILY_IPV4, PROTO_TCP,
    address::Address,
    connections::{Connection, FLAG_THROUGH_STACK, PART_SNAT, conntrack},
    drops::DropReason,
    endpoints::{FLAG_MASQUERADED, FLAG_UNMASQUERADED},
    filter::DIRECTION_EGRESS,
    masquerade::{
        MasqExcludeKey, MasqSource, MasqSourceKey, MasqStats, ReplyKey, UplinkInfo,
        excludes::OWNER_FAMILY_BITS,
    },
};

mod guard;
pub mod host;
mod icmp;
mod ports;
mod replies;

pub use guard::untranslated;
pub use replies::{lookup_reply, reply_connection, translate_icmp_error, translate_reply};

use crate::{
    connections, drops, maps, netfilter,
    packet::{Answer, DROP, DatapathError, Flow, Fragment, NEXT, ifindex, or_verdict},
    route::{Route, chosen_source, forward, route, route_source},
    zero::{Zeroable, zeroed},
};
use ports::{claim_port, host_socket_holds};

/// [`masquerade`]'s answers.
const MASQUERADED: u8 = 0;
/// No port was free: the packet is dropped.
const NO_PORT: u8 = 1;
/// The packet answers a connection the other side opened: not masqueraded.
const ANSWER: u8 = 2;

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
/// (`NOT_MINE` otherwise: the hostPort checks decide, then the host stack, whose forward
/// `uplink_egress` masquerades — replacing a translation whose address changed). An
/// established flow keeps its translation as a conntrack entry keeps its NAT binding: the
/// exclusions and hostPorts it was checked against when it began are not looked up again. A
/// connection netfilter translated ([`FLAG_THROUGH_STACK`]) is left to the stack.
///
/// `flags` and `owner` are from the interface's `endpoints` record: one that says whether the
/// container is masqueraded spares the `masq_sources` lookup (a flow of `owner` was begun by
/// `uplink_egress`, which checked the source against it); one of an older build says
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
    if flags & FLAG_UNMASQUERADED != 0 {
        return Answer::NOT_MINE;
    }
    let owner = if flags & FLAG_MASQUERADED != 0 {
        owner
    } else {
        match source_attached_here(ctx, flow) {
            Some(source) => source.owner,
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
    // attachment's (its address was given to this one since), one netfilter translated, a new
    // connection on the tuple, or expired state: the host stack.
    if !state.has(owner, PART_SNAT)
        || state.flags & FLAG_THROUGH_STACK != 0
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
/// — a connection's first packet, every packet of one netfilter translated, and what the fast
/// path left to the stack. Its verdict is final (the packet is no one else's), returned as a
/// plain integer: LLVM returns an `Option` from a BPF call with bits the verifier sees
/// uninitialised.
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
    // The address the host sends from on the route the container's packets take, as its
    // addresses are now (what `established` checks the flow against): an address added,
    // removed or changed takes effect at the next packet, as with MASQUERADE.
    let uplink_ifindex = ifindex(ctx);
    let routed = chosen_source(ctx, flow, source.host_ifindex) == uplink_ifindex;
    let plan = match Plan::new(ctx, flow, source, uplink_ifindex, routed) {
        Ok(Some(plan)) => plan,
        Ok(None) => return Ok(NEXT),
        Err(verdict) => return Ok(verdict),
    };
    Ok(match masquerade(ctx, flow, &plan)? {
        NO_PORT => DROP,
        _ => NEXT,
    })
}

/// What `masquerade` translates a packet with.
struct Plan {
    source: MasqSource,
    uplink_ifindex: u32,
    nat_addr: Address,
}

impl Plan {
    /// The plan for `flow`'s packet from `source` leaving through `uplink_ifindex`, from
    /// the address the FIB chose for it (`routed`: in `route_source`) or else the uplink's
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
        // SAFETY: both point into maps, read at once. A link-local address the FIB chose where
        // the host has no other is no source for what leaves the link.
        let Some(nat_addr) = chosen
            .map(|slot| unsafe { *slot })
            .filter(|chosen| !chosen.is_ipv6_link_local())
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
/// flow's state when it has none (or only an expired one): [`MASQUERADED`], [`NO_PORT`] when no
/// port was free, [`ANSWER`] (left alone) when the packet answers a connection the other side
/// opened, as the node's conntrack says. A new flow's state says whether netfilter translated
/// it, which keeps it off the fast path.
#[inline(never)]
fn masquerade(ctx: &TcContext, flow: &mut Flow, plan: &Plan) -> Result<u8, DatapathError> {
    if flow.fragment == Fragment::Later {
        // No transport header, no state: the first fragment's translation covers the
        // datagram's checksum; the later ones need only the source address.
        flow.rewrite_source(ctx, &plan.nat_addr, flow.sport)?;
        return Ok(MASQUERADED);
    }
    let flags = flow.tcp_flags;
    let known_port = u16::try_from(masqueraded_port(flow, plan, flags)).ok();
    let nat_port = match known_port {
        Some(port) => port,
        None => {
            let seen = netfilter::view(ctx, flow);
            if seen == netfilter::ANSWER {
                return Ok(ANSWER);
            }
            let keep_own_port = !host_socket_holds(ctx, flow, &plan.nat_addr);
            let Some(port) = claim_port(flow, plan, keep_own_port) else {
                count(|stats| &mut stats.ports_exhausted);
                dropped(
                    ctx,
                    flow,
                    plan.source.owner,
                    DropReason::MasqueradePortsExhausted,
                );
                return Ok(NO_PORT);
            };
            let through_stack = if seen == netfilter::UNTRANSLATED {
                0
            } else {
                FLAG_THROUGH_STACK
            };
            record_flow(flow, plan, port, flags, through_stack);
            count(|stats| &mut stats.flows_created);
            port
        }
    };
    flow.rewrite_source(ctx, &plan.nat_addr, nat_port.to_be())?;
    Ok(MASQUERADED)
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
/// owner has (the filter's part may be there) or a new one, with its `FLAG_*` bits
/// `connection_flags`. Called after `claim_port` rather than from it, so that their stack
/// frames are not stacked on each other.
#[inline(never)]
fn record_flow(flow: &Flow, plan: &Plan, nat_port: u16, flags: u8, connection_flags: u8) {
    let now = flow.now;
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
    connection.flags = (connection.flags & !FLAG_THROUGH_STACK) | connection_flags;
    if fresh {
        connections::insert(&key, entry);
    }
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

/// A `masq_excludes` lookup key on a slot aligned to a word, so that it is zeroed a word at a
/// time: the key's own layout is the trie's, byte-aligned.
#[repr(C, align(8))]
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
