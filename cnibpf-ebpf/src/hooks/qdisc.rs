//! The qdisc watcher, on the kernel's `qdisc_create` tracepoint: a qdisc someone adds to a
//! container's host-side veth in the host's namespace (the `bandwidth` plugin's TBF, its
//! ingress qdisc redirecting to an ifb, an operator's clsact) marks the container
//! `FLAG_VIA_STACK` at once, so that its traffic passes that veth's qdiscs from the next
//! packet on — whichever order the chain runs its plugins in, with no daemon between CNI calls.
//! (A plugin chained before cnibpf is seen by ADD itself.) The flag stays until the record is
//! written again, which its ADD does from the qdiscs it finds.
//!
//! The tracepoint's arguments are `(const struct Qdisc_ops *, struct net_device *, u32)`; where
//! the device keeps its index and its namespace varies by kernel, so the loader sets the byte
//! offsets from the kernel's BTF. Unset (`u32::MAX`), the watcher does nothing.

use aya_ebpf::{helpers::bpf_probe_read_kernel, programs::RawTracePointContext};
use cnibpf_common::endpoints::FLAG_VIA_STACK;

use crate::maps;

/// Byte offset of `ifindex` in `struct net_device`, set by the loader.
#[unsafe(no_mangle)]
static NET_DEVICE_IFINDEX: u32 = u32::MAX;
/// Byte offset of `nd_net.net` (a `struct net *`) in `struct net_device`, set by the loader.
#[unsafe(no_mangle)]
static NET_DEVICE_NAMESPACE: u32 = u32::MAX;
/// Byte offset of `net_cookie` in `struct net`, set by the loader.
#[unsafe(no_mangle)]
static NET_COOKIE: u32 = u32::MAX;

/// Every path returns 0: a tracepoint program's return value is ignored.
pub fn qdisc_created(ctx: &RawTracePointContext) -> i32 {
    // A device that could not be read is left as it is: the worst outcome is the fast path
    // for a shaped container until its next ADD, which is what happened before the watcher.
    let _ = try_qdisc_created(ctx);
    0
}

fn try_qdisc_created(ctx: &RawTracePointContext) -> Result<(), i64> {
    // SAFETY: plain reads of statics the loader may have rewritten (volatile, so that the
    // compiler does not take their initial values for constants).
    let (ifindex_at, namespace_at, cookie_at) = unsafe {
        (
            core::ptr::read_volatile(&NET_DEVICE_IFINDEX),
            core::ptr::read_volatile(&NET_DEVICE_NAMESPACE),
            core::ptr::read_volatile(&NET_COOKIE),
        )
    };
    if ifindex_at == u32::MAX || namespace_at == u32::MAX || cookie_at == u32::MAX {
        return Ok(());
    }
    let device: u64 = ctx.arg(1);
    let device = device as *const u8;
    // SAFETY: bpf_probe_read_kernel copies from kernel memory and fails (rather than faults)
    // on a bad address; the offsets are the running kernel's, from its BTF.
    let (ifindex, namespace) = unsafe {
        (
            bpf_probe_read_kernel(device.wrapping_add(ifindex_at as usize).cast::<i32>())?,
            bpf_probe_read_kernel(
                device
                    .wrapping_add(namespace_at as usize)
                    .cast::<*const u8>(),
            )?,
        )
    };
    // SAFETY: as above.
    let cookie: u64 =
        unsafe { bpf_probe_read_kernel(namespace.wrapping_add(cookie_at as usize).cast::<u64>())? };
    let host = maps::settings
        .get(0)
        .map_or(0, |settings| settings.host_netns_cookie);
    if host == 0 || cookie != host {
        return Ok(());
    }
    let Some(endpoint) = maps::endpoints.get_ptr_mut(&(ifindex as u32)) else {
        return Ok(());
    };
    // SAFETY: points into `endpoints`; one word is set, which packets read whole.
    unsafe { (*endpoint).flags |= FLAG_VIA_STACK };
    Ok(())
}
