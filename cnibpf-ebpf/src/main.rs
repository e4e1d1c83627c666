//! cnibpf datapath: TC programs attached with tcx to the uplinks and to each container's
//! host-side interface, and socket hooks on a cgroup. This file holds only the entry points;
//! `hooks` says what runs at each, the features (`portmap`, `masquerade`, `filter`) do the work
//! with `connections`, `packet` and `maps` below them. Modules only use modules below them:
//!
//! ```text
//! main → hooks → portmap, masquerade, filter, sources → connections, route, netfilter → packet → drops → maps, clock, zero
//! ```
#![no_std]
#![no_main]
// Inline assembly on the BPF target, for loads of unaligned packet fields (`packet::field`).
#![feature(asm_experimental_arch)]
#![expect(
    clippy::not_unsafe_ptr_arg_deref,
    reason = "aya-ebpf's #[classifier] generates the extern entry point that takes the kernel's raw context pointer"
)]

mod clock;
mod connections;
mod drops;
mod filter;
mod hooks;
mod maps;
mod masquerade;
mod netfilter;
mod packet;
mod portmap;
mod route;
mod sources;
mod zero;

use aya_ebpf::{
    macros::{cgroup_sock_addr, classifier, raw_tracepoint},
    programs::{RawTracePointContext, SockAddrContext, TcContext},
};
use cnibpf_common::{FAMILY_IPV4, FAMILY_IPV6};

use crate::hooks::{container, qdisc, socket, uplink};

/// Uplink ingress: traffic from outside to a hostPort is translated to its container; replies
/// of masqueraded flows (and ICMP errors about them) are translated back to theirs.
#[classifier]
pub fn uplink_ingress(ctx: TcContext) -> i32 {
    filter::answered(&ctx, uplink::ingress(&ctx))
}

/// Uplink egress: replies of translated flows get the hostPort address back as their source;
/// container traffic the host stack forwarded is masqueraded.
#[classifier]
pub fn uplink_egress(ctx: TcContext) -> i32 {
    uplink::egress(&ctx)
}

/// Container host-side interface, TC ingress: packets the container sends. Replies of
/// translated flows, hairpin traffic to hostPorts, and masqueraded traffic leaving through an
/// uplink; everything else continues unchanged.
#[classifier]
pub fn from_container(ctx: TcContext) -> i32 {
    filter::answered(&ctx, container::from_container(&ctx))
}

/// Container host-side interface, TC egress: packets towards the container that did not come
/// through a hostPort (those are handed to the container directly). A connection opened this
/// way reuses its 5-tuple, so a translation remembered for it is stale and goes.
#[classifier]
pub fn to_container(ctx: TcContext) -> i32 {
    filter::answered(&ctx, container::to_container(&ctx))
}

/// Attached nowhere: the hooks above tail-call it (`answer_programs`) for a packet a REJECT
/// rule refused, which it answers with a TCP reset or an ICMP error (see `filter::answer`).
#[classifier]
pub fn reject_answer(ctx: TcContext) -> i32 {
    filter::answer_refused(&ctx)
}

/// Host sockets, connect(2) over IPv4: a hostPort of this host becomes its container.
#[cgroup_sock_addr(connect4)]
pub fn sock_connect4(ctx: SockAddrContext) -> i32 {
    socket::to_container(&ctx, FAMILY_IPV4);
    socket::ALLOW
}

#[cgroup_sock_addr(connect6)]
pub fn sock_connect6(ctx: SockAddrContext) -> i32 {
    socket::to_container(&ctx, FAMILY_IPV6);
    socket::ALLOW
}

/// Host sockets, sendmsg(2) with a destination (unconnected UDP): as connect, and a datagram
/// from a hostPort's number opens a host flow, whose answers are the host's.
#[cgroup_sock_addr(sendmsg4)]
pub fn sock_sendmsg4(ctx: SockAddrContext) -> i32 {
    socket::datagram_to(&ctx, FAMILY_IPV4);
    socket::ALLOW
}

#[cgroup_sock_addr(sendmsg6)]
pub fn sock_sendmsg6(ctx: SockAddrContext) -> i32 {
    socket::datagram_to(&ctx, FAMILY_IPV6);
    socket::ALLOW
}

/// Host sockets, recvmsg(2): datagrams from a container show the hostPort they answer for.
#[cgroup_sock_addr(recvmsg4)]
pub fn sock_recvmsg4(ctx: SockAddrContext) -> i32 {
    socket::to_host_port(&ctx, FAMILY_IPV4);
    socket::ALLOW
}

#[cgroup_sock_addr(recvmsg6)]
pub fn sock_recvmsg6(ctx: SockAddrContext) -> i32 {
    socket::to_host_port(&ctx, FAMILY_IPV6);
    socket::ALLOW
}

/// Host sockets, getpeername(2): a translated connection's peer is the hostPort.
#[cgroup_sock_addr(getpeername4)]
pub fn sock_peername4(ctx: SockAddrContext) -> i32 {
    socket::to_host_port(&ctx, FAMILY_IPV4);
    socket::ALLOW
}

#[cgroup_sock_addr(getpeername6)]
pub fn sock_peername6(ctx: SockAddrContext) -> i32 {
    socket::to_host_port(&ctx, FAMILY_IPV6);
    socket::ALLOW
}

/// A qdisc added to a container's host-side veth: its traffic passes the veth's qdiscs from
/// then on (the `bandwidth` plugin chained after cnibpf).
#[raw_tracepoint(tracepoint = "qdisc_create")]
pub fn qdisc_created(ctx: RawTracePointContext) -> i32 {
    qdisc::qdisc_created(&ctx)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    // The verifier rejects any path that could reach here; this only satisfies no_std.
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
