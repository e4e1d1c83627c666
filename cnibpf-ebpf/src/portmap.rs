//! Port mapping (DNAT of hostIP:hostPort to containerIP:containerPort).
//!
//! Every packet towards a hostPort is looked up in `portmap`, never in a cached flow, so a
//! hostPort that changed owner takes effect on the very next packet — also for a UDP client
//! that keeps its source port. Only a reply to a masqueraded connection, matched by its exact
//! 5-tuple, comes before it. Translated packets are handed straight to the container
//! (`bpf_redirect_peer`) and replies straight to their next hop, so neither direction crosses
//! the bridge or the host's IP stack; the flow entry only serves to reverse the translation.

use aya_ebpf::{bindings::BPF_ANY, helpers::bpf_ktime_get_ns, programs::TcContext};
use cnibpf_common::{
    FAMILY_IPV4, PROTO_TCP,
    endpoint::{EndpointInfo, FLAG_NO_HAIRPIN_SNAT, FLAG_VIA_STACK},
    filter::{DIRECTION_EGRESS, DIRECTION_INGRESS},
    host_addr::HostAddrKey,
    nat_flow::{NatFlowKey, NatFlowValue},
    portmap::{PortMapKey, PortMapValue},
};

use crate::{
    conditions,
    delivery::{endpoint_flags, hand_over, mark_translated, take_translated_mark},
    filter, maps, masquerade,
    packet::{DROP, DatapathError, Flow, Fragment, NEXT, Route, forward, ifindex, route},
};

/// How often a flow's `last_seen_ns` is refreshed: writing it on every packet would turn each
/// packet's lookup into a write that bounces the cache line between CPUs.
const FLOW_REFRESH_NS: u64 = 1_000_000_000;

/// Traffic from outside, at an uplink's ingress.
pub fn try_uplink_ingress(ctx: &TcContext) -> Result<i32, DatapathError> {
    let Some(mut flow) = Flow::parse(ctx)? else {
        return Ok(masquerade::icmp_error(ctx));
    };
    Ok(from_outside(ctx, &mut flow))
}

/// A TCP, UDP, SCTP or ICMP echo packet from outside: to a hostPort, or a reply to a
/// masqueraded flow. Not inlined, so that its stack is not under `masquerade::icmp_error`'s.
#[inline(never)]
fn from_outside(ctx: &TcContext, flow: &mut Flow) -> i32 {
    try_from_outside(ctx, flow).unwrap_or_else(DatapathError::verdict)
}

fn try_from_outside(ctx: &TcContext, flow: &mut Flow) -> Result<i32, DatapathError> {
    if flow.fragment == Fragment::Later {
        return Ok(masquerade::later_fragment_reply(ctx, flow));
    }
    // A reply to a masqueraded flow first, by its exact tuple: as conntrack matches an
    // existing connection before a DNAT rule, a hostPort added on a port such a flow already
    // uses does not take its replies.
    if let Some(entry) = masquerade::lookup_reply(flow) {
        // SAFETY: points into `masq_replies`; see `masquerade::reply`.
        return Ok(masquerade::reply(ctx, flow, unsafe { &*entry }));
    }
    // Port mapping does not translate fragments (later ones carry no ports to find a mapping
    // by).
    if flow.fragment != Fragment::Whole {
        return Ok(NEXT);
    }
    let Some(mapping) = lookup_mapping(flow) else {
        return Ok(NEXT);
    };
    // SAFETY: mapping points into portmap and is read at once; see `lookup_mapping`.
    let mapping = unsafe { &*mapping };
    if !conditions::admit(mapping, &flow.saddr, &flow.daddr, ifindex(ctx), flow.family) {
        return Ok(NEXT);
    }
    let origin = Origin {
        original_addr: flow.daddr,
        client_addr: flow.saddr,
        original_port: flow.dport,
        client_port: flow.sport,
        reply_ifindex: 0,
        client_mac: [0; 6],
        gateway_mac: [0; 6],
    };
    flow.rewrite_destination(ctx, &mapping.container_addr, mapping.container_port.to_be())?;
    let verdict = hand_over(
        ctx,
        Some(flow),
        mapping.host_ifindex,
        &mapping.container_mac,
        &mapping.gateway_mac,
    )?;
    if verdict != DROP {
        remember_flow(flow, mapping.owner, &origin);
    }
    Ok(verdict)
}

/// Replies that the host stack routed out of an uplink untranslated (when `from_container`
/// could not route them itself) get the hostPort address back here; container traffic the
/// stack forwarded is masqueraded here.
pub fn try_uplink_egress(ctx: &TcContext) -> Result<i32, DatapathError> {
    let Some(mut flow) = Flow::parse(ctx)? else {
        return Ok(NEXT);
    };
    let entry = if flow.fragment == Fragment::Whole {
        lookup_flow(&flow)
    } else {
        None
    };
    let Some(entry) = entry else {
        return Ok(masquerade::uplink_egress(ctx, &mut flow));
    };
    // SAFETY: entry points into nat_flows; the fields are copied out before any rewrite.
    let (orig_addr, orig_port) = unsafe { ((*entry).orig_addr, (*entry).orig_port) };
    flow.rewrite_source(ctx, &orig_addr, orig_port.to_be())?;
    Ok(NEXT)
}

/// Packets a container sends, at its host-side veth's ingress: replies of translated flows, and
/// hairpin traffic to a hostPort of this host.
pub fn try_from_container(ctx: &TcContext) -> Result<i32, DatapathError> {
    let Some(mut flow) = Flow::parse(ctx)? else {
        return Ok(filter::verdict(filter::allows_other(
            ctx,
            ifindex(ctx),
            DIRECTION_EGRESS,
        )));
    };
    if !filter::allows(ctx, &flow, ifindex(ctx), DIRECTION_EGRESS) {
        return Ok(DROP);
    }
    // A container whose traffic is shaped on its veth: what it sends must pass the qdiscs
    // that follow this hook (the `bandwidth` plugin's redirect to its ifb), so nothing is sent
    // on from here; `uplink_egress` translates it on its way out.
    let via_stack = endpoint_flags(ifindex(ctx)) & FLAG_VIA_STACK != 0;
    if flow.fragment == Fragment::Whole {
        if let Some(verdict) = reply(ctx, &flow, via_stack)? {
            return Ok(verdict);
        }
        let verdict = hairpin(ctx, &flow, via_stack);
        if verdict != NOT_HAIRPIN {
            return Ok(verdict);
        }
    }
    if via_stack {
        return Ok(NEXT);
    }
    masquerade::from_container(ctx, &mut flow)
}

/// Packets towards the container that did not come through a hostPort: filtered, and a TCP
/// connection opening, or any UDP datagram, on a 5-tuple that has a translation remembered
/// means that translation is stale (the client now talks to the container directly with the
/// same ports), and its replies must not be rewritten. Returns the verdict itself: with the
/// filter's early drop inside a `Result`, LLVM reads a register the verifier sees unset.
pub fn to_container(ctx: &TcContext) -> i32 {
    let flow = match Flow::parse(ctx) {
        Ok(Some(flow)) => flow,
        Ok(None) => {
            return filter::verdict(filter::allows_other(ctx, ifindex(ctx), DIRECTION_INGRESS));
        }
        Err(error) => return error.verdict(),
    };
    let translated = take_translated_mark(ctx);
    if !filter::allows(ctx, &flow, ifindex(ctx), DIRECTION_INGRESS) {
        return DROP;
    }
    if !translated {
        forget_stale_translation(ctx, &flow);
    }
    NEXT
}

fn forget_stale_translation(ctx: &TcContext, flow: &Flow) {
    let opens = match flow.protocol {
        PROTO_TCP => flow.is_tcp_syn(ctx).unwrap_or(false),
        _ => true,
    };
    if flow.fragment != Fragment::Whole || !opens {
        return;
    }
    let reply = flow_key(flow, Direction::Reply);
    if maps::nat_flows.get_ptr(&reply).is_some() {
        let _ = maps::nat_flows.remove(&reply);
    }
}

/// The reverse translation of a reply, sent on to its next hop; `None` when the packet is not
/// the reply of a translated flow. Not inlined: the verifier caps the stack of a call chain at
/// 512 bytes, and the reply and hairpin paths each need much of it.
#[inline(never)]
fn reply(ctx: &TcContext, flow: &Flow, via_stack: bool) -> Result<Option<i32>, DatapathError> {
    let Some(entry) = maps::nat_flows.get_ptr_mut(&flow_key(flow, Direction::Packet)) else {
        return Ok(None);
    };
    // SAFETY: entry points into nat_flows; it is copied out field by field before any rewrite,
    // and only its refresh time is written (racing writers write the same).
    let entry = unsafe { &mut *entry };
    // Replies keep the flow alive too (GC sweeps idle ones), at most one write a second.
    // SAFETY: bpf_ktime_get_ns has no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    if now.wrapping_sub(entry.last_seen_ns) >= FLOW_REFRESH_NS {
        entry.last_seen_ns = now;
    }
    let (orig_addr, orig_port) = (entry.orig_addr, entry.orig_port.to_be());
    let mut flow = *flow;
    if entry.peer_ifindex != 0 {
        let (peer_addr, peer_port) = (entry.peer_addr, entry.peer_port.to_be());
        let (peer_mac, gateway_mac, peer_ifindex) =
            (entry.peer_mac, entry.gateway_mac, entry.peer_ifindex);
        flow.rewrite_source(ctx, &orig_addr, orig_port)?;
        flow.rewrite_destination(ctx, &peer_addr, peer_port)?;
        // Also from a container marked via-stack: with a local source address the reply
        // could not cross the host stack (it would be dropped as martian).
        return hand_over(ctx, Some(&flow), peer_ifindex, &peer_mac, &gateway_mac).map(Some);
    }
    if via_stack {
        // Untranslated through the stack (and the container's qdiscs); `uplink_egress` gives
        // it the hostPort address on its way out.
        return Ok(Some(NEXT));
    }
    let (reply_addr, reply_port) = (flow.saddr, flow.sport);
    flow.rewrite_source(ctx, &orig_addr, orig_port)?;
    let next_hop = route(ctx, &flow);
    if !matches!(next_hop, Route::Other)
        && flow.decrement_hop_limit(ctx)?
        && let Some(verdict) = forward(ctx, &next_hop)?
    {
        return Ok(Some(verdict));
    }
    // The datapath cannot route it: undo, and leave it to the host stack untranslated (a local
    // source address would be dropped as martian); uplink_egress translates it on the way out.
    flow.rewrite_source(ctx, &reply_addr, reply_port)?;
    Ok(Some(NEXT))
}

/// How a translated flow was addressed originally, and where its replies go.
struct Origin {
    /// The hostIP the client sent to.
    original_addr: [u8; 16],
    /// The client's own address.
    client_addr: [u8; 16],
    /// The hostPort, network byte order.
    original_port: u16,
    /// The client's own port, network byte order.
    client_port: u16,
    /// For hairpin traffic, the client container's host-side veth; zero: replies are routed.
    reply_ifindex: u32,
    client_mac: [u8; 6],
    gateway_mac: [u8; 6],
}

/// Hairpin traffic: a container to a hostPort of this host, handed straight to the target;
/// `None` when the packet is not for a hostPort.
#[inline(never)]
fn hairpin(ctx: &TcContext, flow: &Flow, via_stack: bool) -> i32 {
    try_hairpin(ctx, flow, via_stack).unwrap_or_else(DatapathError::verdict)
}

/// [`hairpin`]'s answer for a packet that is not for a hostPort. A plain integer rather than
/// an `Option`: LLVM returns an `Option` from a BPF call with bits the verifier sees unset.
const NOT_HAIRPIN: i32 = i32::MIN;

#[inline(always)]
fn try_hairpin(ctx: &TcContext, flow: &Flow, via_stack: bool) -> Result<i32, DatapathError> {
    let Some(mapping) = lookup_mapping(flow) else {
        return Ok(NOT_HAIRPIN);
    };
    let ifindex = ifindex(ctx);
    let Some(client) = maps::endpoints.get_ptr(&ifindex) else {
        return Ok(NEXT);
    };
    // SAFETY: both point into maps and are read right away; see `lookup_mapping`.
    let (mapping, client) = unsafe { (&*mapping, &*client) };
    if !conditions::admit(
        mapping,
        &flow.saddr,
        &flow.daddr,
        client.gateway_ifindex,
        flow.family,
    ) {
        return Ok(NEXT);
    }
    let origin = Origin {
        original_addr: flow.daddr,
        client_addr: flow.saddr,
        original_port: flow.dport,
        client_port: flow.sport,
        reply_ifindex: ifindex,
        client_mac: client.container_mac,
        gateway_mac: client.gateway_mac,
    };
    // A container reaching its own hostPort would receive a packet from its own address, which
    // its stack drops as martian: the source becomes its gateway instead.
    let to_itself = mapping.container_addr == flow.saddr;
    let source = if to_itself && client.flags & FLAG_NO_HAIRPIN_SNAT == 0 {
        match gateway(client, flow.family) {
            Some(gateway) => gateway,
            None => return Ok(NEXT),
        }
    } else {
        flow.saddr
    };
    let mut flow = *flow;
    flow.rewrite_destination(ctx, &mapping.container_addr, mapping.container_port.to_be())?;
    flow.rewrite_source(ctx, &source, flow.sport)?;
    if via_stack && !to_itself {
        // Through this container's qdiscs, then routed to the target by the host stack.
        remember_flow(&flow, mapping.owner, &origin);
        mark_translated(ctx);
        return Ok(NEXT);
    }
    let verdict = hand_over(
        ctx,
        Some(&flow),
        mapping.host_ifindex,
        &mapping.container_mac,
        &mapping.gateway_mac,
    )?;
    if verdict != DROP {
        remember_flow(&flow, mapping.owner, &origin);
    }
    Ok(verdict)
}

fn gateway(endpoint: &EndpointInfo, family: u8) -> Option<[u8; 16]> {
    let address = if family == FAMILY_IPV4 {
        crate::packet::widen(endpoint.gateway_v4)
    } else {
        endpoint.gateway_v6
    };
    (address != [0; 16]).then_some(address)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// The packet's own tuple.
    Packet,
    /// The tuple of the packet's replies.
    Reply,
}

/// The `nat_flows` key of a packet's tuple, or of its replies' tuple.
fn flow_key(flow: &Flow, direction: Direction) -> NatFlowKey {
    let (src, dst) = match direction {
        Direction::Packet => ((flow.saddr, flow.sport), (flow.daddr, flow.dport)),
        Direction::Reply => ((flow.daddr, flow.dport), (flow.saddr, flow.sport)),
    };
    NatFlowKey {
        src_addr: src.0,
        dst_addr: dst.0,
        src_port: u16::from_be(src.1),
        dst_port: u16::from_be(dst.1),
        protocol: flow.protocol,
        family: flow.family,
        _pad: [0; 2],
    }
}

fn lookup_flow(flow: &Flow) -> Option<*const NatFlowValue> {
    maps::nat_flows.get_ptr(&flow_key(flow, Direction::Packet))
}

/// The mapping for the packet's destination: an exact host address first, then the wildcard,
/// which applies only when the destination is an address of this host (`host_addrs`), as `-m
/// addrtype --dst-type LOCAL` does for the reference portmap: routed traffic is never captured.
/// (The FIB cannot tell: `bpf_fib_lookup` answers "not forwarded" for local addresses and for
/// destinations without a route alike.)
///
/// The pointer is into `portmap`; callers read what they need at once. Userspace replaces
/// values whole, and a value freed under a reader can at worst misdirect the packet at hand.
fn lookup_mapping(flow: &Flow) -> Option<*const PortMapValue> {
    let mut key = PortMapKey {
        host_addr: flow.daddr,
        host_port: u16::from_be(flow.dport),
        protocol: flow.protocol,
        family: flow.family,
    };
    if let Some(value) = maps::portmap.get_ptr(&key) {
        return Some(value);
    }
    key.host_addr = [0; 16];
    let wildcard = maps::portmap.get_ptr(&key)?;
    is_host_address(&flow.daddr, flow.family).then_some(wildcard)
}

/// Whether `port` (host byte order) of host address `addr` is a hostPort.
pub fn is_host_port(addr: &[u8; 16], port: u16, protocol: u8, family: u8) -> bool {
    let mut key = PortMapKey {
        host_addr: *addr,
        host_port: port,
        protocol,
        family,
    };
    if maps::portmap.get_ptr(&key).is_some() {
        return true;
    }
    key.host_addr = [0; 16];
    maps::portmap.get_ptr(&key).is_some()
}

pub fn is_host_address(addr: &[u8; 16], family: u8) -> bool {
    let key = HostAddrKey {
        addr: *addr,
        family,
        _pad: [0; 3],
    };
    maps::host_addrs.get_ptr(&key).is_some()
}

/// Records how to reverse the translation of `flow` (already translated) for its replies;
/// refreshed at most once a second per flow unless what it records changed.
#[inline(never)]
fn remember_flow(flow: &Flow, owner: u64, origin: &Origin) {
    let key = flow_key(flow, Direction::Reply);
    // SAFETY: bpf_ktime_get_ns has no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let orig_port = u16::from_be(origin.original_port);
    if let Some(entry) = maps::nat_flows.get_ptr(&key) {
        // SAFETY: read right after the lookup; a stale read only causes one extra update.
        let current = unsafe { &*entry };
        if current.owner == owner
            && current.orig_port == orig_port
            && current.orig_addr == origin.original_addr
            && current.peer_ifindex == origin.reply_ifindex
            && now.wrapping_sub(current.last_seen_ns) < FLOW_REFRESH_NS
        {
            return;
        }
    }
    let value = NatFlowValue {
        orig_addr: origin.original_addr,
        peer_addr: origin.client_addr,
        owner,
        last_seen_ns: now,
        peer_ifindex: origin.reply_ifindex,
        orig_port,
        peer_port: u16::from_be(origin.client_port),
        peer_mac: origin.client_mac,
        gateway_mac: origin.gateway_mac,
        _pad: [0; 4],
    };
    // A full LRU map evicts; an insert failure leaves the previous entry, which still reverses
    // this flow correctly unless the mapping changed, so there is nothing better to do here.
    let _ = maps::nat_flows.insert(&key, &value, u64::from(BPF_ANY));
}
