//! The hooks: what runs, and in what order, at each place cnibpf attaches — an uplink
//! ([`uplink`]), a container's host-side veth ([`container`]), host processes' sockets
//! ([`socket`]), the kernel's creation of a qdisc ([`qdisc`]). The features (`portmap`, `masquerade`, `filter`) each do their part on a
//! packet; a hook decides which of them sees it, and hands what they translated to its
//! container, filter first.

pub mod container;
pub mod qdisc;
pub mod socket;
pub mod uplink;

use aya_ebpf::{helpers::bpf_redirect, programs::TcContext};
use cnibpf_common::{
    connections::{Connection, FLAG_THROUGH_STACK},
    endpoints::{FLAG_HOST_FIREWALL, FLAG_UNFILTERED, FLAG_VIA_STACK},
    filter::DIRECTION_INGRESS,
};

use crate::{
    filter::{self, Way},
    maps,
    packet::{
        DROP, DatapathError, Flow, Handover, NEXT, mark_translated, redirect_to_peer, store_macs,
    },
    portmap,
};

/// Hands a translated packet to its container; `flow` is the packet as translated (`None`: a
/// packet the filter judges without ports, such as an ICMP error), `connection` its
/// `connections` entry as the hook found it (`None`: the filter looks it up), `answered`
/// whether the filter may answer it (a hostPort's translation: a REJECT goes back the way the
/// packet came, from the hostPort its sender used; else refused, it is dropped).
///
/// Normally straight into the container's namespace (`bpf_redirect_peer`), past the bridge,
/// the host stack and the veth's own hooks — so the filter judges the packet here. A container
/// marked `FLAG_VIA_STACK` (something shapes its traffic, e.g. the `bandwidth` plugin's TBF on
/// its veth) gets it through that veth's egress instead (`bpf_redirect`): its `to_container`
/// filters it and its qdiscs shape it. A container marked `FLAG_HOST_FIREWALL`, and a reply of a
/// connection that crosses the host stack (`FLAG_THROUGH_STACK`: the node's netfilter
/// translated it), get what came in by an uplink (`from_uplink`) through the host stack, from
/// where it was translated: the kernel routes it through the host's own chains (netfilter
/// reversing its own translation), and `to_container` filters it. (Hairpin traffic
/// reaches the stack from the client's hook already translated; what is handed over from a
/// container's hook carries a host address as its source, which the stack would not forward.)
/// Inlined: as a call of its own it would push the deepest
/// call chains (into the filter) past the verifier's 512 bytes.
#[inline(always)]
fn hand_over(
    ctx: &TcContext,
    flow: Option<&Flow>,
    container: &Handover,
    from_uplink: bool,
    connection: Option<*mut Connection>,
    answered: bool,
) -> Result<i32, DatapathError> {
    let ifindex = container.host_ifindex;
    let flags = maps::endpoint_flags(ifindex);
    // SAFETY: points into `connections`, read at once.
    let crosses_stack = connection
        .and_then(|connection| unsafe { connection.as_ref() })
        .is_some_and(|connection| connection.flags & FLAG_THROUGH_STACK != 0);
    if from_uplink && (flags & FLAG_HOST_FIREWALL != 0 || crosses_stack) {
        // Addressed to the container now; the kernel routes it there through the host's
        // chains, and its `to_container` filters it.
        mark_translated(ctx);
        return Ok(NEXT);
    }
    if flags & FLAG_VIA_STACK != 0 {
        store_macs(ctx, container.frame_macs())?;
        mark_translated(ctx);
        // SAFETY: bpf_redirect has no memory arguments.
        return Ok(unsafe { bpf_redirect(ifindex, 0) } as i32);
    }
    let allowed = flags & FLAG_UNFILTERED != 0
        || match (flow, connection) {
            (Some(flow), Some(connection)) => {
                filter::allows_in(ctx, flow, ifindex, DIRECTION_INGRESS, connection)
            }
            (Some(flow), None) => filter::allows(ctx, flow, ifindex, DIRECTION_INGRESS),
            (None, _) => filter::allows_other(ctx, ifindex, DIRECTION_INGRESS),
        };
    if !allowed {
        // Before the container's MAC addresses are written: the answer swaps the sender's.
        let way = if from_uplink {
            Way::OutOfUplink
        } else {
            Way::IntoContainer
        };
        if !answered {
            return Ok(DROP);
        }
        let Some(ends) = filter::ends_slot() else {
            return Ok(DROP);
        };
        portmap::translation_ends(ends);
        return Ok(filter::refused(way, true));
    }
    store_macs(ctx, container.frame_macs())?;
    Ok(redirect_to_peer(ifindex))
}
