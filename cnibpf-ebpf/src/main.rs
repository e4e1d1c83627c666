//! cnibpf datapath: TC programs attached with tcx to the uplinks and to each container's
//! host-side interface. Every program is a thin entry point that turns the `Result` of its
//! `try_*` function into a TC verdict; `DatapathError::verdict` says which verdict each error
//! path gets.
#![no_std]
#![no_main]
#![expect(
    clippy::not_unsafe_ptr_arg_deref,
    reason = "aya-ebpf's #[classifier] generates the extern entry point that takes the kernel's raw context pointer"
)]

mod conditions;
mod conntrack;
mod delivery;
mod filter;
mod maps;
mod masquerade;
mod packet;
mod portmap;
mod sock;

use aya_ebpf::{
    macros::{cgroup_sock_addr, classifier},
    programs::{SockAddrContext, TcContext},
};
use cnibpf_common::{FAMILY_IPV4, FAMILY_IPV6};

use crate::packet::DatapathError;

/// Uplink ingress: traffic from outside to a hostPort is translated to its container; replies
/// of masqueraded flows (and ICMP errors about them) are translated back to theirs.
#[classifier]
pub fn uplink_ingress(ctx: TcContext) -> i32 {
    portmap::try_uplink_ingress(&ctx).unwrap_or_else(DatapathError::verdict)
}

/// Uplink egress: replies of translated flows get the hostPort address back as their source;
/// container traffic the host stack forwarded is masqueraded.
#[classifier]
pub fn uplink_egress(ctx: TcContext) -> i32 {
    portmap::try_uplink_egress(&ctx).unwrap_or_else(DatapathError::verdict)
}

/// Container host-side interface, TC ingress: packets the container sends. Replies of
/// translated flows, hairpin traffic to hostPorts, and masqueraded traffic leaving through an
/// uplink; everything else continues unchanged.
#[classifier]
pub fn from_container(ctx: TcContext) -> i32 {
    portmap::try_from_container(&ctx).unwrap_or_else(DatapathError::verdict)
}

/// Container host-side interface, TC egress: packets towards the container that did not come
/// through a hostPort (those are handed to the container directly). A connection opened this
/// way reuses its 5-tuple, so a translation remembered for it is stale and goes.
#[classifier]
pub fn to_container(ctx: TcContext) -> i32 {
    portmap::to_container(&ctx)
}

/// Host sockets, connect(2) over IPv4: a hostPort of this host becomes its container.
#[cgroup_sock_addr(connect4)]
pub fn sock_connect4(ctx: SockAddrContext) -> i32 {
    sock::to_container(&ctx, FAMILY_IPV4);
    sock::ALLOW
}

#[cgroup_sock_addr(connect6)]
pub fn sock_connect6(ctx: SockAddrContext) -> i32 {
    sock::to_container(&ctx, FAMILY_IPV6);
    sock::ALLOW
}

/// Host sockets, sendmsg(2) with a destination (unconnected UDP).
#[cgroup_sock_addr(sendmsg4)]
pub fn sock_sendmsg4(ctx: SockAddrContext) -> i32 {
    sock::to_container(&ctx, FAMILY_IPV4);
    sock::ALLOW
}

#[cgroup_sock_addr(sendmsg6)]
pub fn sock_sendmsg6(ctx: SockAddrContext) -> i32 {
    sock::to_container(&ctx, FAMILY_IPV6);
    sock::ALLOW
}

/// Host sockets, recvmsg(2): datagrams from a container show the hostPort they answer for.
#[cgroup_sock_addr(recvmsg4)]
pub fn sock_recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::to_host_port(&ctx, FAMILY_IPV4);
    sock::ALLOW
}

#[cgroup_sock_addr(recvmsg6)]
pub fn sock_recvmsg6(ctx: SockAddrContext) -> i32 {
    sock::to_host_port(&ctx, FAMILY_IPV6);
    sock::ALLOW
}

/// Host sockets, getpeername(2): a translated connection's peer is the hostPort.
#[cgroup_sock_addr(getpeername4)]
pub fn sock_peername4(ctx: SockAddrContext) -> i32 {
    sock::to_host_port(&ctx, FAMILY_IPV4);
    sock::ALLOW
}

#[cgroup_sock_addr(getpeername6)]
pub fn sock_peername6(ctx: SockAddrContext) -> i32 {
    sock::to_host_port(&ctx, FAMILY_IPV6);
    sock::ALLOW
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
