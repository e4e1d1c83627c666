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

mod maps;
mod packet;
mod portmap;

use aya_ebpf::{bindings::TC_ACT_OK, macros::classifier, programs::TcContext};

use crate::packet::DatapathError;

/// Uplink ingress: traffic from outside to a hostPort is translated to its container.
#[classifier]
pub fn uplink_ingress(ctx: TcContext) -> i32 {
    portmap::try_uplink_ingress(&ctx).unwrap_or_else(DatapathError::verdict)
}

/// Uplink egress: replies of translated flows get the hostPort address back as their source.
#[classifier]
pub fn uplink_egress(ctx: TcContext) -> i32 {
    portmap::try_uplink_egress(&ctx).unwrap_or_else(DatapathError::verdict)
}

/// Container host-side interface, TC ingress: packets the container sends. Replies of
/// translated flows and hairpin traffic to hostPorts; everything else continues unchanged.
#[classifier]
pub fn from_container(ctx: TcContext) -> i32 {
    portmap::try_from_container(&ctx).unwrap_or_else(DatapathError::verdict)
}

/// Container host-side interface, TC egress: packets towards the container. The attachment point
/// for ingress filtering; until that slice lands every packet is delivered unchanged.
#[classifier]
pub fn to_container(_ctx: TcContext) -> i32 {
    TC_ACT_OK
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
