//! A container's host-side veth. Ingress (what the container sends): its source address
//! checked first, then the filter, as it sees the container's own addresses; then a packet of
//! a flow masquerade already tracks for this attachment (its translation holds, as a conntrack
//! entry keeps its NAT binding), replies of translated flows and hairpin traffic to a hostPort;
//! the rest — a new connection's first packet among it — goes on to the host stack. Egress (what reaches the container through the bridge or the
//! host stack): the filter, and a translation a direct connection has made stale is forgotten.

use core::mem::MaybeUninit;

use aya_ebpf::programs::TcContext;
use cnibpf_common::{
    connections::Connection,
    endpoints::{FLAG_HOST_FIREWALL, FLAG_UNFILTERED, FLAG_VIA_STACK},
    filter::{DIRECTION_EGRESS, DIRECTION_INGRESS},
};

use super::hand_over;
use crate::{
    connections,
    filter::{self, Way},
    maps, masquerade,
    packet::{Answer, DROP, DatapathError, Flow, Fragment, NEXT, ifindex, take_translated_mark},
    portmap, sources,
    zero::zeroed,
};

pub fn from_container(ctx: &TcContext) -> i32 {
    try_from_container(ctx).unwrap_or_else(|error| error.verdict(ctx))
}

fn try_from_container(ctx: &TcContext) -> Result<i32, DatapathError> {
    let endpoint = maps::endpoint(ifindex(ctx));
    if !sources::admit(ctx, ifindex(ctx), endpoint) {
        return Ok(DROP);
    }
    // A null record is an interface cnibpf knows nothing about: its packets take every lookup.
    let (flags, owner) = if endpoint.is_null() {
        (0, 0)
    } else {
        // SAFETY: points into `endpoints`, read at once.
        unsafe { ((*endpoint).flags, (*endpoint).owner) }
    };
    let filtered = flags & FLAG_UNFILTERED == 0;
    let mut slot = MaybeUninit::uninit();
    let Some(flow) = Flow::parse(ctx, &mut slot)? else {
        if !filtered || filter::allows_other(ctx, ifindex(ctx), DIRECTION_EGRESS) {
            return Ok(NEXT);
        }
        return Ok(filter::refused(Way::IntoContainer, false));
    };
    // Found once for the filter, masquerade and the hostPort replies: each reads it. (A
    // connection's first packet may get an entry from the filter after this; what follows
    // then finds none, as none of theirs is in it.)
    let connection = connections::of_packet(flow, DIRECTION_EGRESS);
    if filtered && !filter::allows_in(ctx, flow, ifindex(ctx), DIRECTION_EGRESS, connection) {
        return Ok(filter::refused(Way::IntoContainer, false));
    }
    // A container whose traffic is shaped on its veth: what it sends must pass the qdiscs
    // that follow this hook (the `bandwidth` plugin's redirect to its ifb), so nothing is sent
    // on from here; `uplink_egress` translates it on its way out.
    if flags & (FLAG_VIA_STACK | FLAG_HOST_FIREWALL) != 0 {
        // Only translated replies and hairpin traffic: `uplink_egress` masquerades the rest.
        return Ok(translated(ctx, flow, true, connection).tc_verdict());
    }
    let answer = masquerade::established(ctx, flow, flags, owner, connection);
    if answer != Answer::NOT_MINE {
        return Ok(answer.tc_verdict());
    }
    // Anything else — a new connection among it — crosses the host stack, where the node's
    // netfilter sees it; `uplink_egress` masquerades what leaves by an uplink.
    Ok(translated(ctx, flow, false, connection).tc_verdict())
}

/// A reply of a translated flow (or a fragment of one), or hairpin traffic to a hostPort:
/// translated, and handed to the container it is for, sent on, or left to the stack;
/// [`Answer::NOT_MINE`] when it is neither. `connection` is the packet's `connections` entry as
/// the hook found it. Not inlined: its frame must not sit under masquerade's.
#[inline(never)]
fn translated(
    ctx: &TcContext,
    flow: &mut Flow,
    via_stack: bool,
    connection: *mut Connection,
) -> Answer {
    let mut slot = MaybeUninit::uninit();
    let target = zeroed(&mut slot);
    match portmap::translate_reply(ctx, flow, via_stack, target, connection) {
        // Translated towards the client container, whose entry has the other side's key.
        Answer::TO_CONTAINER => {
            return Answer::verdict(
                hand_over(ctx, Some(flow), target, false, None, false)
                    .unwrap_or_else(|error| error.verdict(ctx)),
            );
        }
        Answer::NOT_MINE => {}
        answer => return answer,
    }
    // Hairpin traffic is translated whole only (nothing would follow a first fragment).
    if flow.fragment != Fragment::Whole {
        return Answer::NOT_MINE;
    }
    match portmap::translate_hairpin(ctx, flow, via_stack, target) {
        Answer::TO_CONTAINER => {
            let connection = connections::of_packet(flow, DIRECTION_INGRESS);
            let verdict = hand_over(ctx, Some(flow), target, false, Some(connection), true)
                .unwrap_or_else(|error| error.verdict(ctx));
            if filter::lets_on(verdict) {
                portmap::remember_translation(flow, connection);
            }
            Answer::verdict(verdict)
        }
        answer => answer,
    }
}

/// What reaches the container through the bridge or the host stack. Returns the verdict
/// itself: with the filter's early drop inside a `Result`, LLVM reads a register the verifier
/// sees unset.
pub fn to_container(ctx: &TcContext) -> i32 {
    let mut slot = MaybeUninit::uninit();
    let flow = match Flow::parse(ctx, &mut slot) {
        Ok(Some(flow)) => flow,
        Ok(None) => {
            if filter::allows_other(ctx, ifindex(ctx), DIRECTION_INGRESS) {
                return NEXT;
            }
            return filter::refused(Way::FromContainer, false);
        }
        Err(error) => return error.verdict(ctx),
    };
    // Translated by one of cnibpf's hooks on its way here: not a direct connection.
    let translated = take_translated_mark(ctx);
    let connection = if flow.fragment == Fragment::Later {
        core::ptr::null_mut()
    } else {
        connections::of_packet(flow, DIRECTION_INGRESS)
    };
    if !filter::allows_in(ctx, flow, ifindex(ctx), DIRECTION_INGRESS, connection) {
        return filter::refused(Way::FromContainer, false);
    }
    if !translated {
        portmap::forget_stale_translation(flow, connection);
    }
    NEXT
}
