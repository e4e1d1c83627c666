//! An uplink. Ingress: ICMP errors about masqueraded packets, a reply to a masqueraded flow
//! (matched by its exact tuple before any hostPort, as conntrack matches a connection before a
//! DNAT rule), then traffic to a hostPort — each translated and handed to its container (a
//! later fragment goes where its first went, by the ports the parser recovered); replies of a
//! host flow moved off a container's port go back to the host stack, translated. Egress: the
//! host's own traffic (a local socket's, or from the uplink's address) goes on, moved to
//! another port where a container's masqueraded flow holds its tuple; then
//! replies of translated flows the host stack routed, and container traffic it forwarded to be
//! masqueraded; what carries no flow the parser could read goes through masquerade's guard
//! (`masquerade::untranslated`): nothing leaves with a masqueraded container's own address.

use core::mem::MaybeUninit;

use aya_ebpf::programs::TcContext;
use cnibpf_common::address::Address;

use super::hand_over;
use crate::{
    filter, maps, masquerade,
    packet::{
        Answer, DatapathError, Flow, NEXT, SourceAddress, from_local_socket, ifindex,
        source_address, take_translated_mark,
    },
    portmap,
    zero::zeroed,
};

pub fn ingress(ctx: &TcContext) -> i32 {
    try_ingress(ctx).unwrap_or_else(|error| error.verdict(ctx))
}

fn try_ingress(ctx: &TcContext) -> Result<i32, DatapathError> {
    let mut slot = MaybeUninit::uninit();
    let Some(flow) = Flow::parse(ctx, &mut slot)? else {
        return Ok(icmp_error(ctx));
    };
    Ok(from_outside(ctx, flow))
}

/// A packet without ports: an ICMP error about a masqueraded packet, or someone else's. Not
/// inlined, so that its stack is not under `from_outside`'s.
#[inline(never)]
fn icmp_error(ctx: &TcContext) -> i32 {
    let mut slot = MaybeUninit::uninit();
    let container = zeroed(&mut slot);
    match masquerade::translate_icmp_error(ctx, container) {
        Answer::TO_CONTAINER => hand_over(ctx, None, container, true, None, false)
            .unwrap_or_else(|error| error.verdict(ctx)),
        answer => answer.tc_verdict(),
    }
}

/// A TCP, UDP, SCTP or ICMP echo packet from outside.
#[inline(never)]
fn from_outside(ctx: &TcContext, flow: &mut Flow) -> i32 {
    try_from_outside(ctx, flow).unwrap_or_else(|error| error.verdict(ctx))
}

fn try_from_outside(ctx: &TcContext, flow: &mut Flow) -> Result<i32, DatapathError> {
    let mut slot = MaybeUninit::uninit();
    let container = zeroed(&mut slot);
    if let Some(entry) = masquerade::lookup_reply(flow) {
        // SAFETY: points into `masq_replies`; see `masquerade::translate_reply`.
        let reply = unsafe { &*entry };
        let connection = masquerade::reply_connection(flow, reply);
        return match masquerade::translate_reply(ctx, flow, reply, container, connection) {
            Answer::TO_CONTAINER => {
                hand_over(ctx, Some(flow), container, true, Some(connection), false)
            }
            answer => Ok(answer.tc_verdict()),
        };
    }
    match portmap::translate_from_outside(ctx, flow, container)? {
        (Answer::TO_CONTAINER, connection) => {
            let verdict = hand_over(ctx, Some(flow), container, true, Some(connection), true)?;
            if filter::lets_on(verdict) {
                portmap::remember_translation(flow, connection);
            }
            Ok(verdict)
        }
        (answer, _) => Ok(answer.tc_verdict()),
    }
}

pub fn egress(ctx: &TcContext) -> i32 {
    match try_egress(ctx) {
        Ok(verdict) => verdict,
        // Headers shorter than they claim: not translated, so not sent from a masqueraded
        // container's own address either.
        Err(DatapathError::Truncated) => masquerade::untranslated(ctx),
        Err(error) => error.verdict(ctx),
    }
}

fn try_egress(ctx: &TcContext) -> Result<i32, DatapathError> {
    // Sent here by the datapath itself, translated already.
    if take_translated_mark(ctx) {
        return Ok(NEXT);
    }
    if from_local_socket(ctx) || leaves_from_uplink_address(ctx) {
        return Ok(masquerade::host::egress(ctx));
    }
    let mut slot = MaybeUninit::uninit();
    let Some(flow) = Flow::parse(ctx, &mut slot)? else {
        return Ok(masquerade::untranslated(ctx));
    };
    match portmap::translate_routed_reply(ctx, flow)? {
        Answer::NOT_MINE => Ok(masquerade::uplink_egress(ctx, flow)),
        answer => Ok(answer.tc_verdict()),
    }
}

/// Whether the packet leaves from the uplink's own address — the host's own traffic, which
/// nothing here translates (what this hook translates comes from a container's address): for
/// what carries no socket (the kernel's own packets, another NAT's translations). Told from
/// its linear headers and one `uplinks` lookup, before any parsing. `false` when it cannot
/// tell (the full path then decides).
#[inline(always)]
fn leaves_from_uplink_address(ctx: &TcContext) -> bool {
    let Some(uplink) = maps::uplinks.get_ptr(&ifindex(ctx)) else {
        return false;
    };
    // SAFETY: points into `uplinks`, whose values userspace replaces whole.
    let uplink = unsafe { &*uplink };
    match source_address(ctx) {
        Some(SourceAddress::V4(source)) => {
            uplink.addr_v4 != [0; 4]
                && u32::from_ne_bytes(source) == u32::from_ne_bytes(uplink.addr_v4)
        }
        Some(SourceAddress::V6(source)) => {
            uplink.addr_v6 != Address::UNSPECIFIED && source == uplink.addr_v6
        }
        None => false,
    }
}
