//! The host's own flows at an uplink's egress: what a local socket sends, or what leaves from
//! the uplink's address (netfilter's own translations). A container's masqueraded connection
//! holds its address and port towards its remote in `masq_replies`; a host flow that would
//! leave with that very tuple — a socket bound to the port after the container's flow took it,
//! or given it by the kernel, which does not know the masquerade — is moved to another port
//! and its replies translated back (`replies`), as conntrack moves the later of two clashing
//! connections. Its state is a `connections` entry of owner `HOST`; `masq_host_clashes`
//! counts the moves.
//!
//! Only a TCP connection's opening or a UDP datagram can begin a clash, and the host's packets
//! of a moved flow are looked up only once any flow has been moved since the datapath was
//! loaded: the host's traffic pays a parse and one `masq_replies` lookup per SYN and datagram,
//! and the other packets of its TCP sockets a look at the socket.

use core::mem::MaybeUninit;

use aya_ebpf::{
    EbpfContext as _,
    bindings::{__sk_buff, BPF_TCP_SYN_SENT as SYN_SENT},
    helpers::bpf_sk_fullsock,
    programs::TcContext,
};
use cnibpf_common::{
    PROTO_TCP, PROTO_UDP,
    connections::{ConnectionKey, HOST, PART_SNAT, conntrack},
    filter::DIRECTION_EGRESS,
    masquerade::MasqSource,
};

use super::{Plan, claim_port, record_flow, reply_key};
use crate::{
    connections, maps,
    packet::{DatapathError, Flow, Fragment, NEXT, ifindex},
};

/// The verdict for a host packet leaving an uplink: on, moved to another port if its flow
/// was (or must be now).
#[inline(never)]
pub fn egress(ctx: &TcContext) -> i32 {
    // A TCP socket that is not opening a connection begins no clash: while no flow was ever
    // moved, its packets go on unread.
    if !any_moved() && socket_state(ctx).is_some_and(|state| state != SYN_SENT) {
        return NEXT;
    }
    let mut slot = MaybeUninit::uninit();
    let flow = match Flow::parse(ctx, &mut slot) {
        Ok(Some(flow)) => flow,
        Ok(None) | Err(_) => return NEXT,
    };
    try_egress(ctx, flow).unwrap_or_else(|error| error.verdict(ctx))
}

fn try_egress(ctx: &TcContext, flow: &mut Flow) -> Result<i32, DatapathError> {
    if flow.protocol != PROTO_TCP && flow.protocol != PROTO_UDP || flow.fragment == Fragment::Later
    {
        return Ok(NEXT);
    }
    let plan = Plan {
        source: MasqSource {
            owner: HOST,
            host_ifindex: 0,
            container_mac: [0; 6],
            gateway_mac: [0; 6],
        },
        uplink_ifindex: ifindex(ctx),
        nat_addr: flow.saddr,
    };
    let flags = flow.tcp_flags;
    if any_moved()
        && let Ok(port) = u16::try_from(moved_port(flow))
    {
        flow.rewrite_source(ctx, &plan.nat_addr, port.to_be())?;
        return Ok(NEXT);
    }
    let opens = flow.protocol == PROTO_UDP || conntrack::is_opening(flags);
    if !opens || !held_by_a_container(flow) {
        return Ok(NEXT);
    }
    // The container's flow was there first: the host's moves, as conntrack moves the later
    // of two connections that would share a tuple.
    let Some(port) = claim_port(flow, &plan, false) else {
        // Every candidate taken: it leaves as it is, as it did before cnibpf.
        return Ok(NEXT);
    };
    record_flow(flow, &plan, port, flags, 0);
    count_move();
    flow.rewrite_source(ctx, &plan.nat_addr, port.to_be())?;
    Ok(NEXT)
}

/// The port the flow was moved to (its state moved on), or -1 when it was not moved or its
/// state expired.
#[inline(never)]
fn moved_port(flow: &Flow) -> i32 {
    let now = flow.now;
    let entry = connections::find(&connections::key_of(flow, DIRECTION_EGRESS));
    // SAFETY: points into `connections`; racing writers only refresh the same fields.
    match unsafe { entry.as_mut() } {
        Some(state) if state.has(HOST, PART_SNAT) && !state.is_expired(flow.protocol, now) => {
            let side = state.side(DIRECTION_EGRESS);
            conntrack::advance(state, flow.protocol, flow.tcp_flags, side, now);
            i32::from(state.nat_port)
        }
        _ => -1,
    }
}

/// Whether a live masqueraded connection of a container holds the flow's own address and port
/// towards its remote (the tuple its replies would arrive with).
#[inline(never)]
fn held_by_a_container(flow: &Flow) -> bool {
    let mut reverse = reply_key(flow);
    (reverse.src_addr, reverse.dst_addr) = (reverse.dst_addr, reverse.src_addr);
    (reverse.src_port, reverse.dst_port) = (reverse.dst_port, reverse.src_port);
    let Some(holder) = maps::masq_replies.get_ptr(&reverse) else {
        return false;
    };
    // SAFETY: points into `masq_replies`, read at once.
    let holder = unsafe { &*holder };
    if holder.host_ifindex == 0 {
        return false;
    }
    let key = ConnectionKey {
        container_addr: holder.container_addr,
        remote_addr: reverse.src_addr,
        container_port: holder.container_port,
        remote_port: reverse.src_port,
        protocol: reverse.protocol,
        family: reverse.family,
        _pad: 0,
    };
    let now = flow.now;
    let connection = connections::find(&key);
    // SAFETY: points into `connections`, read at once.
    unsafe { connection.as_ref() }.is_some_and(|connection| {
        connection.has(holder.owner, PART_SNAT) && !connection.is_expired(reverse.protocol, now)
    })
}

/// The TCP state of the full socket that sent the packet, if a TCP socket did.
#[inline(always)]
fn socket_state(ctx: &TcContext) -> Option<u32> {
    // SAFETY: the context is this program's __sk_buff; TC programs may read its socket pointer
    // and a full socket's protocol and state.
    unsafe {
        let socket = (*ctx.as_ptr().cast::<__sk_buff>()).__bindgen_anon_2.sk;
        if socket.is_null() {
            return None;
        }
        let full = bpf_sk_fullsock(socket);
        (!full.is_null() && (*full).protocol == u32::from(PROTO_TCP)).then(|| (*full).state)
    }
}

/// Whether any host flow was moved since the datapath was loaded.
#[inline(always)]
fn any_moved() -> bool {
    maps::masq_host_clashes
        .get(0)
        .is_some_and(|clashes| clashes.moved != 0)
}

/// Counts a move in the one entry every CPU shares, with the instruction set's atomic add
/// (core has no atomic read-modify-write for this target).
fn count_move() {
    if let Some(clashes) = maps::masq_host_clashes.get_ptr_mut(0) {
        // SAFETY: points into the map's value, a u64 the add changes in place.
        unsafe {
            core::arch::asm!(
                "lock *(u64 *)({at} + 0) += {one}",
                at = in(reg) &raw mut (*clashes).moved,
                one = in(reg) 1_u64,
                options(nostack, preserves_flags),
            );
        }
    }
}
