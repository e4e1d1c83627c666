//! Replies to masqueraded flows (a later fragment of one too, with its first fragment's ports)
//! and ICMP errors about them, at an uplink's ingress: translated back towards their container
//! for the hook to hand over.

use aya_ebpf::{
    EbpfContext as _, bindings::BPF_CSUM_LEVEL_RESET, helpers::bpf_csum_level, programs::TcContext,
};
use cnibpf_common::{
    connections::{
        Connection, ConnectionKey, FLAG_THROUGH_STACK, PART_SNAT,
        conntrack::{self, STATE_ESTABLISHED},
    },
    filter::{DIRECTION_EGRESS, DIRECTION_INGRESS},
    masquerade::{MasqReply, ReplyKey},
};

use super::{count, icmp::Quoted, reply_key};
use crate::{
    connections, maps,
    packet::{
        Answer, DatapathError, Flow, Handover, icmp::icmp_error_scratch, ifindex, mark_translated,
    },
};

/// The `masq_replies` entry of a packet that is a reply to a masqueraded flow. The pointer is into the map; see `reply`.
#[inline(always)]
pub fn lookup_reply(flow: &Flow) -> Option<*const MasqReply> {
    maps::masq_replies.get_ptr(&reply_key(flow))
}

/// The `connections` entry of the connection a reply belongs to (`reply`, its `masq_replies`
/// entry), null when there is none. Not inlined: the key's stack slot is then not held under
/// the caller's calls.
#[inline(never)]
pub fn reply_connection(flow: &Flow, reply: &MasqReply) -> *mut Connection {
    connections::find(&connection_key(flow, reply))
}

/// The `connections` key of the connection a reply belongs to: the container's side from its
/// `masq_replies` entry, the remote's from the reply.
#[inline(always)]
fn connection_key(flow: &Flow, reply: &MasqReply) -> ConnectionKey {
    ConnectionKey {
        container_addr: reply.container_addr,
        remote_addr: flow.saddr,
        container_port: reply.container_port,
        remote_port: u16::from_be(flow.sport),
        protocol: flow.protocol,
        family: flow.family,
        _pad: 0,
    }
}

/// A reply to a masqueraded flow at the uplink's ingress, translated back towards its container
/// (`TO_CONTAINER`, `container` filled in), or towards the host socket of a host flow moved
/// to another port (`NEXT`: the host stack delivers it), or `NEXT` untranslated when the
/// flow's state has expired;
/// `entry` is its `masq_replies` entry (`lookup_reply`), `connection` its connection's entry
/// ([`reply_connection`]). An LRU map may recycle an entry under a reader; the worst that does
/// is misdirect the packet at hand.
#[inline(never)]
pub fn translate_reply(
    ctx: &TcContext,
    flow: &mut Flow,
    entry: &MasqReply,
    container: &mut Handover,
    connection: *mut Connection,
) -> Answer {
    try_translate_reply(ctx, flow, entry, container, connection)
        .unwrap_or_else(|error| error.answer(ctx))
}

fn try_translate_reply(
    ctx: &TcContext,
    flow: &mut Flow,
    entry: &MasqReply,
    container: &mut Handover,
    connection: *mut Connection,
) -> Result<Answer, DatapathError> {
    if !track_reply(ctx, flow, entry, connection)? {
        let _ = maps::masq_replies.remove(&reply_key(flow));
        return Ok(Answer::NEXT);
    }
    flow.rewrite_destination(ctx, &entry.container_addr, entry.container_port.to_be())?;
    if entry.host_ifindex == 0 {
        return Ok(Answer::NEXT);
    }
    hand_over_to(entry, container);
    Ok(Answer::TO_CONTAINER)
}

/// Where a reply goes: the container of its `masq_replies` entry.
fn hand_over_to(reply: &MasqReply, container: &mut Handover) {
    container.host_ifindex = reply.host_ifindex;
    container.container_mac = reply.container_mac;
    container.gateway_mac = reply.gateway_mac;
}

/// Moves the state of the connection a reply belongs to (`connection`, its entry) on; `false`
/// when that state has expired (the connection is removed, and the reply is not translated).
#[inline(never)]
fn track_reply(
    ctx: &TcContext,
    flow: &Flow,
    reply: &MasqReply,
    connection: *mut Connection,
) -> Result<bool, DatapathError> {
    let now = flow.now;
    let flags = flow.tcp_flags;
    // SAFETY: points into `connections`; racing writers only refresh the same fields.
    let Some(state) =
        (unsafe { connection.as_mut() }).filter(|state| state.has(reply.owner, PART_SNAT))
    else {
        // Evicted under pressure while its reply entry survived: rebuilt, the reply proves
        // the connection alive.
        count(|stats| &mut stats.state_lost);
        rebuild(&connection_key(flow, reply), flow, reply, ifindex(ctx), now);
        return Ok(true);
    };
    if state.is_expired(flow.protocol, now) {
        count(|stats| &mut stats.expired);
        let _ = maps::connections.remove(&connection_key(flow, reply));
        return Ok(false);
    }
    let side = state.side(DIRECTION_INGRESS);
    conntrack::advance(state, flow.protocol, flags, side, now);
    Ok(true)
}

/// The masquerade of a connection whose entry was lost, from its reply and `masq_replies`
/// entry: established, and through the host stack (whether netfilter translated it is not
/// known any more; the stack is right either way).
#[inline(never)]
fn rebuild(key: &ConnectionKey, flow: &Flow, reply: &MasqReply, uplink_ifindex: u32, now: u64) {
    let (entry, fresh) =
        connections::for_part(key, reply.owner, flow.protocol, DIRECTION_EGRESS, 0, now);
    if entry.is_null() {
        return;
    }
    // SAFETY: points into `connections`, or this CPU's scratch for a new entry.
    let connection = unsafe { &mut *entry };
    connection.nat_addr = flow.daddr;
    connection.uplink_ifindex = uplink_ifindex;
    connection.nat_port = u16::from_be(flow.dport);
    connection.parts |= PART_SNAT;
    connection.flags |= FLAG_THROUGH_STACK;
    if fresh {
        connection.state = STATE_ESTABLISHED;
        connections::insert(key, entry);
    }
}

/// ICMP errors (destination unreachable, packet too big, time exceeded, parameter problem)
/// about a masqueraded packet, at the uplink's ingress: the quoted packet's source and the
/// error's destination become the container's again (`TO_CONTAINER`, `container` filled in),
/// so that "port unreachable" and path MTU discovery work through the NAT; those about a
/// connection that crosses the host stack (netfilter translated it, or a host flow moved to
/// another port) go on to the stack translated (`NEXT`); `NOT_MINE` for anything else.
#[inline(never)]
pub fn translate_icmp_error(ctx: &TcContext, container: &mut Handover) -> Answer {
    try_translate_icmp_error(ctx, container).unwrap_or_else(|error| error.answer(ctx))
}

fn try_translate_icmp_error(
    ctx: &TcContext,
    container: &mut Handover,
) -> Result<Answer, DatapathError> {
    let Some(error) = icmp_error_scratch.get_ptr_mut(0) else {
        return Ok(Answer::NOT_MINE);
    };
    // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
    let error = unsafe { &mut *error };
    if !error.parse(ctx)? {
        return Ok(Answer::NOT_MINE);
    }
    let key = ReplyKey {
        src_addr: error.inner_daddr,
        dst_addr: error.inner_saddr,
        src_port: u16::from_be(error.inner_dport),
        dst_port: u16::from_be(error.inner_sport),
        protocol: error.inner_protocol,
        family: error.family,
        _pad: 0,
    };
    let Some(reply) = maps::masq_replies.get_ptr(&key) else {
        return Ok(Answer::NOT_MINE);
    };
    // SAFETY: points into `masq_replies`, read before the next map operation.
    let reply = unsafe { &*reply };
    error.translate(
        ctx,
        Quoted::Source,
        &reply.container_addr,
        reply.container_port.to_be(),
    )?;
    // The checksums are right; the hardware's verdict on the original packet no longer is.
    // SAFETY: the context pointer is this program's __sk_buff.
    unsafe { bpf_csum_level(ctx.as_ptr().cast(), u64::from(BPF_CSUM_LEVEL_RESET)) };
    count(|stats| &mut stats.icmp_errors);
    let key = ConnectionKey {
        container_addr: reply.container_addr,
        remote_addr: error.inner_daddr,
        container_port: reply.container_port,
        remote_port: u16::from_be(error.inner_dport),
        protocol: error.inner_protocol,
        family: error.family,
        _pad: 0,
    };
    if reply.host_ifindex == 0 || crosses_stack(&key) {
        mark_translated(ctx);
        return Ok(Answer::NEXT);
    }
    hand_over_to(reply, container);
    Ok(Answer::TO_CONTAINER)
}

/// Whether the connection of `key` crosses the host stack ([`FLAG_THROUGH_STACK`]).
#[inline(never)]
fn crosses_stack(key: &ConnectionKey) -> bool {
    // SAFETY: points into `connections`, read at once.
    unsafe { connections::find(key).as_ref() }
        .is_some_and(|connection| connection.flags & FLAG_THROUGH_STACK != 0)
}
