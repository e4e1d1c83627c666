//! Handing a translated packet to its container, the one way every path does it (hostPort
//! DNAT, hairpin, replies of masqueraded flows, their ICMP errors and later fragments).
//!
//! Normally straight into the container's namespace (`bpf_redirect_peer`), past the bridge,
//! the host stack and the host-side veth's own hooks — so the filter judges the packet here.
//! A container marked `FLAG_VIA_STACK` (something shapes its traffic, e.g. the `bandwidth`
//! plugin's TBF on the host-side veth) gets it through that veth's egress instead
//! (`bpf_redirect`): its `to_container` filters it and its qdiscs shape it.

use aya_ebpf::{EbpfContext as _, bindings::__sk_buff, helpers::bpf_redirect, programs::TcContext};
use cnibpf_common::{endpoint::FLAG_VIA_STACK, filter::DIRECTION_INGRESS};

use crate::{
    filter, maps,
    packet::{DROP, DatapathError, Flow, redirect_to_peer, set_macs},
};

/// `__sk_buff::tc_index` of a packet a cnibpf hook translated and handed to a container's
/// veth (or to the stack) for its `to_container` to see: that hook must not take the fresh
/// translation for a stale one. No qdisc the kernel still has reads `tc_index`.
const TRANSLATED: u32 = 0xcb1f;

/// The `endpoints` flags of a container's host-side veth (zero for an unknown one). Not
/// inlined: its lookup key would otherwise sit in its callers' frames, under the filter's.
#[inline(never)]
pub fn endpoint_flags(host_ifindex: u32) -> u32 {
    // SAFETY: points into `endpoints`, read at once.
    maps::endpoints
        .get_ptr(&host_ifindex)
        .map_or(0, |endpoint| unsafe { (*endpoint).flags })
}

/// Hands the packet to the container behind host-side veth `ifindex`, framed with the MAC
/// addresses it expects (its own, its gateway's); `flow` is the packet as translated (`None`:
/// a packet the filter judges without ports, such as an ICMP error). Inlined, with plain
/// arguments: a call or a struct of its own would push the deepest call chains (into the
/// filter) past the verifier's 512 bytes.
#[inline(always)]
pub fn hand_over(
    ctx: &TcContext,
    flow: Option<&Flow>,
    ifindex: u32,
    container_mac: &[u8; 6],
    gateway_mac: &[u8; 6],
) -> Result<i32, DatapathError> {
    set_macs(ctx, container_mac, gateway_mac)?;
    if endpoint_flags(ifindex) & FLAG_VIA_STACK != 0 {
        mark_translated(ctx);
        // SAFETY: bpf_redirect has no memory arguments.
        return Ok(unsafe { bpf_redirect(ifindex, 0) } as i32);
    }
    let allowed = match flow {
        Some(flow) => filter::allows(ctx, flow, ifindex, DIRECTION_INGRESS),
        None => filter::allows_other(ctx, ifindex, DIRECTION_INGRESS),
    };
    if !allowed {
        return Ok(DROP);
    }
    Ok(redirect_to_peer(ifindex))
}

/// Marks the packet as translated by cnibpf (see [`TRANSLATED`]).
pub fn mark_translated(ctx: &TcContext) {
    // SAFETY: the context is this program's __sk_buff, whose tc_index TC programs may write.
    unsafe { (*ctx.as_ptr().cast::<__sk_buff>()).tc_index = TRANSLATED };
}

/// Whether the packet was marked translated; the mark is cleared.
pub fn take_translated_mark(ctx: &TcContext) -> bool {
    let skb = ctx.as_ptr().cast::<__sk_buff>();
    // SAFETY: the context is this program's __sk_buff, whose tc_index TC programs may read
    // and write.
    unsafe {
        if (*skb).tc_index != TRANSLATED {
            return false;
        }
        (*skb).tc_index = 0;
    }
    true
}
