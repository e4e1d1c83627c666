//! Masquerade (SNAT of container traffic leaving through an uplink to the uplink's address),
//! with its own connection tracking in `masq_flows` / `masq_replies`.
//!
//! A container's packet is masqueraded when its source is in `masq_sources`, its destination is
//! not excluded (`masq_excludes`) and the FIB sends it out of an uplink (`uplinks`); anything
//! for the host itself or for another local interface is never an uplink's. At the container's
//! veth it is done and the packet sent straight out of the uplink; at the uplink's egress for
//! packets the host stack forwarded instead. Replies, and ICMP errors about masqueraded
//! packets, are translated back at the uplink's ingress for the hook to hand over.
//!
//! State is reclaimed without a daemon: an entry expires after its state's timeout
//! (`masq_flow::timeout_ns`); the packet that meets an expired entry replaces it, the CNI
//! plugin's DEL and GC sweep expired entries away, and the LRU maps evict the least recently
//! used entries when full.

use aya_ebpf::{
    EbpfContext as _,
    bindings::{BPF_ANY, BPF_CSUM_LEVEL_RESET, BPF_F_CURRENT_NETNS, BPF_NOEXIST, bpf_sock_tuple},
    cty::c_void,
    helpers::{
        bpf_csum_level, bpf_get_prandom_u32, bpf_loop, bpf_sk_lookup_udp, bpf_sk_release,
        bpf_skc_lookup_tcp,
    },
    programs::TcContext,
};
use cnibpf_common::{
    FAMILY_IPV4, PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP,
    drop_stats::DropReason,
    endpoint::{FLAG_MASQUERADED, FLAG_UNMASQUERADED},
    masq_exclude::{MasqExcludeKey, OWNER_FAMILY_BITS},
    masq_flow::{MasqFlow, STATE_ESTABLISHED, STATE_OPENING},
    masq_reply::MasqReply,
    masq_source::{MasqSource, MasqSourceKey},
    masq_stats::MasqStats,
    nat_flow::NatFlowKey,
    uplink::UplinkInfo,
};

mod icmp;

use crate::{
    clock,
    conntrack::{self, SIDE_ORIGIN, SIDE_REPLY},
    drops,
    maps::{
        self,
        scratch::{SOURCE_FOUND, SOURCE_NOT_LOOKED_UP, SOURCE_NOT_MASQUERADED},
    },
    packet::{
        DROP, DatapathError, Flow, Fragment, Handover, NEXT, NOT_MINE, TO_CONTAINER, ifindex,
        or_verdict, widen, words,
    },
    route::{Route, forward, route},
};

/// Candidate ports tried before a new flow is given up (the first is its own source port).
const PORT_ATTEMPTS: u32 = 24;

/// A container's packet at its host-side veth that `established` did not send on, nor the
/// hostPort checks: masqueraded and sent out of the uplink the FIB chooses when its source is
/// masqueraded (as `established` found it), or left alone. Not inlined (nor are the functions
/// it calls): the verifier caps the stack of a whole call chain at 512 bytes.
#[inline(never)]
pub fn from_container(ctx: &TcContext, flow: &mut Flow) -> Result<i32, DatapathError> {
    let Some(found) = maps::masquerade_scratch.get_ptr(0) else {
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
    if is_excluded(source.owner, flow) {
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

/// Whether `masq_flows` holds live state of the packet's flow for the attachment `owner`.
fn is_live(flow: &Flow, owner: u64) -> bool {
    let now = clock::now_ns();
    maps::masq_flows
        .get_ptr(&flow_key(flow))
        .is_some_and(|state| {
            // SAFETY: points into `masq_flows`, read at once.
            let state = unsafe { &*state };
            state.owner == owner && !state.is_expired(flow.protocol, now)
        })
}

/// A container's packet at its host-side veth, of a flow `masq_flows` tracks for the
/// attachment its source is masqueraded for: masqueraded with the flow's translation and sent
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
/// neither, and the source is looked up.
#[inline(never)]
pub fn established(ctx: &TcContext, flow: &mut Flow, flags: u32, owner: u64) -> i32 {
    let Some(found) = maps::masquerade_scratch.get_ptr_mut(0) else {
        return NOT_MINE;
    };
    // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
    let found = unsafe { &mut *found };
    found.found = SOURCE_NOT_MASQUERADED;
    if flags & FLAG_UNMASQUERADED != 0 {
        return NOT_MINE;
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
            None => return NOT_MINE,
        }
    };
    if flow.fragment != Fragment::Whole {
        return NOT_MINE;
    }
    let Some(state) = maps::masq_flows.get_ptr_mut(&flow_key(flow)) else {
        return NOT_MINE;
    };
    // SAFETY: points into `masq_flows`; racing writers only refresh the same fields.
    let state = unsafe { &mut *state };
    let now = clock::now_ns();
    let flags = or_verdict!(ctx, flow.tcp_flags(ctx));
    // Another attachment's flow (its address was given to this one since), a new connection
    // on the tuple, or expired state: the full path.
    if state.owner != owner || conntrack::is_opening(flags) || state.is_expired(flow.protocol, now)
    {
        return NOT_MINE;
    }
    let next_hop = route(ctx, flow, true);
    let uplink_ifindex = match next_hop {
        Route::Neighbour { ifindex, .. } | Route::Unresolved { ifindex } => ifindex,
        Route::Other => return NOT_MINE,
    };
    let routed_from_nat_addr = maps::route_source
        .get_ptr(0)
        // SAFETY: this CPU's slot, written by the lookup just made.
        .is_some_and(|source| unsafe { *source } == state.nat_addr);
    if uplink_ifindex != state.uplink_ifindex || !routed_from_nat_addr {
        return NOT_MINE;
    }
    let (nat_addr, nat_port) = (state.nat_addr, state.nat_port);
    if !or_verdict!(
        ctx,
        flow.rewrite_forwarded_source(ctx, &nat_addr, nat_port.to_be())
    ) {
        return NEXT;
    }
    conntrack::advance(state, flow.protocol, flags, SIDE_ORIGIN, now);
    or_verdict!(ctx, forward(ctx, &next_hop)).unwrap_or(NEXT)
}

/// A packet the host stack sends out of an uplink: masqueraded when it comes from a container
/// that `from_container` did not forward itself. The verdicts of this function, `reply`,
/// `later_fragment_reply` and `icmp_error` are final (the packets are not anyone else's), returned as plain integers:
/// LLVM returns an `Option` from a BPF call with bits the verifier sees uninitialised.
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
    if is_excluded(source.owner, flow) && !is_live(flow, source.owner) {
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

/// The `masq_replies` entry of a packet (a whole datagram or a first fragment) that is a reply
/// to a masqueraded flow. The pointer is into the map; see `reply`.
#[inline(always)]
pub fn lookup_reply(flow: &Flow) -> Option<*const MasqReply> {
    maps::masq_replies.get_ptr(&flow_key(flow))
}

/// A reply to a masqueraded flow at the uplink's ingress, translated back towards its container
/// (`TO_CONTAINER`, `container` filled in), or `NEXT` when the flow's state has expired;
/// `entry` is its `masq_replies` entry (`lookup_reply`). An LRU map may recycle an entry under
/// a reader; the worst that does is misdirect the packet at hand.
#[inline(never)]
pub fn translate_reply(
    ctx: &TcContext,
    flow: &mut Flow,
    entry: &MasqReply,
    container: &mut Handover,
) -> i32 {
    try_translate_reply(ctx, flow, entry, container).unwrap_or_else(|error| error.verdict(ctx))
}

fn try_translate_reply(
    ctx: &TcContext,
    flow: &mut Flow,
    entry: &MasqReply,
    container: &mut Handover,
) -> Result<i32, DatapathError> {
    if !track_reply(ctx, flow, entry)? {
        let _ = maps::masq_replies.remove(&flow_key(flow));
        return Ok(NEXT);
    }
    if flow.fragment == Fragment::First {
        let _ = maps::masq_fragments.insert(&flow.fragment_key(), entry, u64::from(BPF_ANY));
    }
    flow.rewrite_destination(ctx, &entry.container_addr, entry.container_port.to_be())?;
    hand_over_to(entry, container);
    Ok(TO_CONTAINER)
}

/// A later fragment of a reply, translated towards where its first fragment went
/// (`TO_CONTAINER`), or `NOT_MINE`.
#[inline(never)]
pub fn translate_later_fragment(ctx: &TcContext, flow: &mut Flow, container: &mut Handover) -> i32 {
    try_translate_later_fragment(ctx, flow, container).unwrap_or_else(|error| error.verdict(ctx))
}

fn try_translate_later_fragment(
    ctx: &TcContext,
    flow: &mut Flow,
    container: &mut Handover,
) -> Result<i32, DatapathError> {
    let Some(reply) = maps::masq_fragments.get_ptr(&flow.fragment_key()) else {
        return Ok(NOT_MINE);
    };
    // SAFETY: points into `masq_fragments`; see `try_translate_reply` on reading LRU entries.
    let reply = unsafe { &*reply };
    flow.rewrite_destination(ctx, &reply.container_addr, flow.dport)?;
    hand_over_to(reply, container);
    Ok(TO_CONTAINER)
}

/// Where a reply goes: the container of its `masq_replies` entry.
fn hand_over_to(reply: &MasqReply, container: &mut Handover) {
    container.host_ifindex = reply.host_ifindex;
    container.container_mac = reply.container_mac;
    container.gateway_mac = reply.gateway_mac;
}

/// Moves the state of the flow a reply belongs to on; `false` when that state has expired
/// (it is removed, and the reply is not translated).
#[inline(never)]
fn track_reply(ctx: &TcContext, flow: &Flow, reply: &MasqReply) -> Result<bool, DatapathError> {
    let forward_key = NatFlowKey {
        src_addr: reply.container_addr,
        dst_addr: flow.saddr,
        src_port: reply.container_port,
        dst_port: u16::from_be(flow.sport),
        protocol: flow.protocol,
        family: flow.family,
        _pad: [0; 2],
    };
    let now = clock::now_ns();
    let flags = flow.tcp_flags(ctx)?;
    let Some(state) = maps::masq_flows.get_ptr_mut(&forward_key) else {
        // Evicted under pressure while its reverse entry survived: rebuild it, the reply
        // proves the flow alive.
        count(|stats| &mut stats.state_lost);
        let state = MasqFlow {
            nat_addr: flow.daddr,
            owner: reply.owner,
            last_seen_ns: now,
            uplink_ifindex: ifindex(ctx),
            nat_port: u16::from_be(flow.dport),
            state: STATE_ESTABLISHED,
            fin: 0,
        };
        let _ = maps::masq_flows.insert(&forward_key, &state, u64::from(BPF_ANY));
        return Ok(true);
    };
    // SAFETY: points into `masq_flows`; racing writers only refresh the same fields.
    let state = unsafe { &mut *state };
    if state.is_expired(flow.protocol, now) {
        count(|stats| &mut stats.expired);
        let _ = maps::masq_flows.remove(&forward_key);
        return Ok(false);
    }
    conntrack::advance(state, flow.protocol, flags, SIDE_REPLY, now);
    Ok(true)
}

/// What `masquerade` translates a packet with.
struct Plan {
    source: MasqSource,
    uplink_ifindex: u32,
    nat_addr: [u8; 16],
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
            maps::route_source.get_ptr(0)
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
        // No ports, no state: the first fragment's translation covers the datagram's
        // checksum; the later ones need only the source address.
        flow.rewrite_source(ctx, &plan.nat_addr, flow.sport)?;
        return Ok(true);
    }
    let key = flow_key(flow);
    let now = clock::now_ns();
    let flags = flow.tcp_flags(ctx)?;
    let opens = conntrack::is_opening(flags);
    let mut known_port = None;
    if let Some(state) = maps::masq_flows.get_ptr_mut(&key) {
        // SAFETY: points into `masq_flows`; racing writers only refresh the same fields.
        let state = unsafe { &mut *state };
        // Expired, or made with an uplink address that has changed since: replaced.
        if state.is_expired(flow.protocol, now) || state.nat_addr != plan.nat_addr {
            count(|stats| &mut stats.expired);
        } else {
            conntrack::advance(state, flow.protocol, flags, SIDE_ORIGIN, now);
            known_port = Some(state.nat_port);
        }
    } else if flow.protocol == PROTO_TCP && !opens {
        // A connection in the middle of its life without state: its state was evicted.
        count(|stats| &mut stats.state_lost);
    }
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
            record_flow(flow, plan, port, now, opens);
            port
        }
    };
    flow.rewrite_source(ctx, &plan.nat_addr, nat_port.to_be())?;
    Ok(true)
}

/// Whether a socket of the host holds the flow's own source port on the masquerade address
/// for its remote address and port (a connection, or a listener or unconnected socket on the
/// port): its replies would be taken for the container's. The masquerade state knows only
/// masqueraded flows; the host's own connections are the kernel's.
#[inline(never)]
fn host_socket_holds(ctx: &TcContext, flow: &Flow, nat_addr: &[u8; 16]) -> bool {
    if flow.protocol != PROTO_TCP && flow.protocol != PROTO_UDP {
        return false;
    }
    // SAFETY: bpf_sock_tuple is plain old data; all-zero is a valid value.
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    // The tuple as a reply would carry it: from the remote side to the masquerade address.
    let size = if flow.family == FAMILY_IPV4 {
        tuple.__bindgen_anon_1.ipv4.saddr =
            u32::from_ne_bytes([flow.daddr[0], flow.daddr[1], flow.daddr[2], flow.daddr[3]]);
        tuple.__bindgen_anon_1.ipv4.daddr =
            u32::from_ne_bytes([nat_addr[0], nat_addr[1], nat_addr[2], nat_addr[3]]);
        tuple.__bindgen_anon_1.ipv4.sport = flow.dport;
        tuple.__bindgen_anon_1.ipv4.dport = flow.sport;
        12
    } else {
        tuple.__bindgen_anon_1.ipv6.saddr = words(&flow.daddr);
        tuple.__bindgen_anon_1.ipv6.daddr = words(nat_addr);
        tuple.__bindgen_anon_1.ipv6.sport = flow.dport;
        tuple.__bindgen_anon_1.ipv6.dport = flow.sport;
        36
    };
    let skb = ctx.as_ptr();
    let netns = BPF_F_CURRENT_NETNS as u64;
    // SAFETY: skb is this program's context and tuple a correctly sized, initialised struct;
    // a socket found is released below.
    let socket = unsafe {
        if flow.protocol == PROTO_TCP {
            bpf_skc_lookup_tcp(skb, &raw mut tuple, size, netns, 0)
        } else {
            bpf_sk_lookup_udp(skb, &raw mut tuple, size, netns, 0)
        }
    };
    if socket.is_null() {
        return false;
    }
    // SAFETY: a socket the lookup returned, released exactly once.
    unsafe { bpf_sk_release(socket.cast()) };
    true
}

/// Records a new flow whose port `claim_port` claimed. Called after `claim_port` rather than
/// from it, so that their stack frames are not stacked on each other.
#[inline(never)]
fn record_flow(flow: &Flow, plan: &Plan, nat_port: u16, now: u64, opens: bool) {
    let state = MasqFlow {
        nat_addr: plan.nat_addr,
        owner: plan.source.owner,
        last_seen_ns: now,
        uplink_ifindex: plan.uplink_ifindex,
        nat_port,
        // A TCP connection met mid-stream (state evicted) is taken as established, like the
        // kernel's nf_conntrack_tcp_loose.
        state: if flow.protocol == PROTO_TCP && !opens {
            STATE_ESTABLISHED
        } else {
            STATE_OPENING
        },
        fin: 0,
    };
    let _ = maps::masq_flows.insert(&flow_key(flow), &state, u64::from(BPF_ANY));
    count(|stats| &mut stats.flows_created);
}

/// Finds and claims a free masquerade port for a new flow in at most `PORT_ATTEMPTS` tries:
/// its own source port when free, else random ones of the same class, as the kernel's NAT
/// does.
///
/// The search state lives in the per-CPU `port_search` map: on the stack it would push the
/// call chain past the verifier's 512 bytes.
#[inline(never)]
fn claim_port(flow: &Flow, plan: &Plan, keep_own_port: bool) -> Option<u16> {
    let search = maps::port_search.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
    let search = unsafe { &mut *search };
    let original = u16::from_be(flow.sport);
    let (low, span) = port_range(flow.protocol, original);
    search.reverse = NatFlowKey {
        src_addr: flow.daddr,
        dst_addr: plan.nat_addr,
        src_port: u16::from_be(flow.dport),
        // Port 0 is never claimed: the search goes straight to random ports.
        dst_port: if keep_own_port { original } else { 0 },
        protocol: flow.protocol,
        family: flow.family,
        _pad: [0; 2],
    };
    search.reply = MasqReply {
        container_addr: flow.saddr,
        owner: plan.source.owner,
        host_ifindex: plan.source.host_ifindex,
        container_port: original,
        _pad: [0; 2],
        container_mac: plan.source.container_mac,
        gateway_mac: plan.source.gateway_mac,
        _pad2: [0; 4],
    };
    search.span = span;
    search.low = low;
    search.claimed = 0;
    // bpf_loop: the verifier checks the callback once instead of every iteration.
    // SAFETY: the callback has the signature bpf_loop expects and takes no context.
    unsafe {
        bpf_loop(
            PORT_ATTEMPTS,
            try_port as *mut c_void,
            core::ptr::null_mut(),
            0,
        )
    };
    (search.claimed != 0).then_some(search.reverse.dst_port)
}

/// One attempt of the port search (`bpf_loop` callback): the flow's own port first, then
/// random ones; returns 1 to stop.
extern "C" fn try_port(attempt: u64, _context: *mut c_void) -> i64 {
    let Some(search) = maps::port_search.get_ptr_mut(0) else {
        return 1;
    };
    // SAFETY: this CPU's slot, filled by `claim_port` before the loop.
    let search = unsafe { &mut *search };
    if attempt > 0 {
        // SAFETY: bpf_get_prandom_u32 has no preconditions.
        let random = unsafe { bpf_get_prandom_u32() };
        let offset = random.checked_rem(search.span).unwrap_or(0);
        search.reverse.dst_port = search.low.wrapping_add(offset as u16);
    }
    if claim(&search.reverse, &search.reply) {
        search.claimed = 1;
        return 1;
    }
    count(|stats| &mut stats.port_collisions);
    0
}

/// Takes the reply tuple `reverse` for the flow: free, or held by this very flow or by one
/// whose state is gone or expired. A hostPort of the masquerade address is never taken.
fn claim(reverse: &NatFlowKey, reply: &MasqReply) -> bool {
    if reverse.dst_port == 0
        || maps::is_host_port(
            &reverse.dst_addr,
            reverse.dst_port,
            reverse.protocol,
            reverse.family,
        )
    {
        return false;
    }
    if maps::masq_replies
        .insert(reverse, reply, u64::from(BPF_NOEXIST))
        .is_ok()
    {
        return true;
    }
    let Some(holder) = maps::masq_replies.get_ptr(reverse) else {
        return maps::masq_replies
            .insert(reverse, reply, u64::from(BPF_NOEXIST))
            .is_ok();
    };
    // SAFETY: points into `masq_replies`, read at once.
    let holder = unsafe { &*holder };
    let reusable = if holder.container_addr == reply.container_addr
        && holder.container_port == reply.container_port
    {
        true
    } else {
        let holder_key = NatFlowKey {
            src_addr: holder.container_addr,
            dst_addr: reverse.src_addr,
            src_port: holder.container_port,
            dst_port: reverse.src_port,
            protocol: reverse.protocol,
            family: reverse.family,
            _pad: [0; 2],
        };
        let now = clock::now_ns();
        match maps::masq_flows.get_ptr(&holder_key) {
            // SAFETY: points into `masq_flows`, read at once.
            Some(state) => unsafe { &*state }.is_expired(reverse.protocol, now),
            None => true,
        }
    };
    reusable
        && maps::masq_replies
            .insert(reverse, reply, u64::from(BPF_ANY))
            .is_ok()
}

/// The first port and the number of ports a new flow's port is chosen from: the class of its
/// own (below 512, below 1024, the rest), any identifier for ICMP echo.
fn port_range(protocol: u8, original: u16) -> (u16, u32) {
    if protocol == PROTO_ICMP || protocol == PROTO_ICMPV6 {
        (1, 65_535)
    } else if original < 512 {
        (1, 511)
    } else if original < 1024 {
        (600, 424)
    } else {
        (1024, 64_512)
    }
}

fn masqueraded_source(flow: &Flow) -> Option<MasqSource> {
    let key = MasqSourceKey {
        addr: flow.saddr,
        family: flow.family,
        _pad: [0; 3],
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

/// Whether the destination is one the attachment's traffic is never masqueraded towards.
fn is_excluded(owner: u64, flow: &Flow) -> bool {
    let key = aya_ebpf::btf_maps::lpm_trie::Key::new(
        OWNER_FAMILY_BITS + 128,
        MasqExcludeKey {
            owner: owner.to_be_bytes(),
            family: flow.family,
            addr: flow.daddr,
            _pad: [0; 3],
        },
    );
    maps::masq_excludes.get(&key).is_some()
}

fn uplink_address(uplink: &UplinkInfo, family: u8) -> Option<[u8; 16]> {
    let address = if family == FAMILY_IPV4 {
        widen(uplink.addr_v4)
    } else {
        uplink.addr_v6
    };
    (address != [0; 16]).then_some(address)
}

/// The `masq_flows` / `masq_replies` key of a packet's own tuple.
fn flow_key(flow: &Flow) -> NatFlowKey {
    NatFlowKey {
        src_addr: flow.saddr,
        dst_addr: flow.daddr,
        src_port: u16::from_be(flow.sport),
        dst_port: u16::from_be(flow.dport),
        protocol: flow.protocol,
        family: flow.family,
        _pad: [0; 2],
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

/// ICMP errors (destination unreachable, packet too big, time exceeded, parameter problem)
/// about a masqueraded packet, at the uplink's ingress: the quoted packet's source and the
/// error's destination become the container's again (`TO_CONTAINER`, `container` filled in),
/// so that "port unreachable" and path MTU discovery work through the NAT; `NOT_MINE` for
/// anything else.
#[inline(never)]
pub fn translate_icmp_error(ctx: &TcContext, container: &mut Handover) -> i32 {
    try_translate_icmp_error(ctx, container).unwrap_or_else(|error| error.verdict(ctx))
}

fn try_translate_icmp_error(
    ctx: &TcContext,
    container: &mut Handover,
) -> Result<i32, DatapathError> {
    let Some(error) = maps::icmp_error_scratch.get_ptr_mut(0) else {
        return Ok(NOT_MINE);
    };
    // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
    let error = unsafe { &mut *error };
    if !error.parse(ctx)? {
        return Ok(NOT_MINE);
    }
    let key = NatFlowKey {
        src_addr: error.inner_daddr,
        dst_addr: error.inner_saddr,
        src_port: u16::from_be(error.inner_dport),
        dst_port: u16::from_be(error.inner_sport),
        protocol: error.inner_protocol,
        family: error.family,
        _pad: [0; 2],
    };
    let Some(reply) = maps::masq_replies.get_ptr(&key) else {
        return Ok(NOT_MINE);
    };
    // SAFETY: points into `masq_replies`, read before the next map operation.
    let reply = unsafe { &*reply };
    error.translate(ctx, &reply.container_addr, reply.container_port.to_be())?;
    // The checksums are right; the hardware's verdict on the original packet no longer is.
    // SAFETY: the context pointer is this program's __sk_buff.
    unsafe { bpf_csum_level(ctx.as_ptr().cast(), u64::from(BPF_CSUM_LEVEL_RESET)) };
    count(|stats| &mut stats.icmp_errors);
    hand_over_to(reply, container);
    Ok(TO_CONTAINER)
}
