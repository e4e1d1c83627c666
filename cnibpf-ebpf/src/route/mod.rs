//! Where a packet the datapath sends on itself goes: the FIB's answer for its flow, and the
//! send. A FIB lookup costs a forwarded packet about 300 ns here, most of a masqueraded
//! packet's time; its answer is kept per CPU in `next_hops`, with everything the lookup was
//! asked (the FIB may route by any of it: policy rules match ports, protocol and the input
//! interface), and later packets of the same flow take it until the coarse clock ticks (1 to
//! 10 ms by the kernel's HZ). A changed route, address or neighbour thus reaches a running
//! flow at most one tick late, and a new flow at once (other ports: another question). The
//! MTU check depends on the packet: one no longer than the interface's MTU, as the answer's
//! first check reported it, fits whatever the link header; a longer one, or a GSO packet, is
//! checked by the kernel.

use core::mem::MaybeUninit;

use aya_ebpf::{
    EbpfContext as _,
    bindings::{
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_NOT_FWDED, BPF_FIB_LKUP_RET_SUCCESS,
        BPF_FIB_LOOKUP_SKIP_NEIGH, BPF_FIB_LOOKUP_SRC, bpf_check_mtu_flags, bpf_fib_lookup,
    },
    btf_maps::PerCpuArray,
    helpers::{bpf_check_mtu, bpf_fib_lookup as fib_lookup, bpf_redirect, bpf_redirect_neigh},
    macros::btf_map,
    programs::TcContext,
};
use cnibpf_common::{FAMILY_IPV4, address::Address};

mod next_hop;

use next_hop::{NEXT_HOP_SLOTS, NEXT_HOP_SLOTS_LOG2, NextHop};

use crate::packet::{DatapathError, Flow, FrameMacs, ifindex, mark_translated, store_macs};

/// The source address the FIB chose for the packet at hand (see [`route`]); private to
/// each loaded object, not pinned.
#[expect(
    non_upper_case_globals,
    reason = "the static's name is the map's name, like the pinned ones"
)]
#[btf_map]
pub static route_source: PerCpuArray<Address, 1> = PerCpuArray::new();

/// The FIB's recent answers (see [`next_hop`]); private to each loaded object, not pinned.
#[expect(
    non_upper_case_globals,
    reason = "the static's name is the map's name, like the pinned ones"
)]
#[btf_map]
pub static next_hops: PerCpuArray<NextHop, { NEXT_HOP_SLOTS as usize }> = PerCpuArray::new();

/// What the FIB says about a packet's destination.
pub enum Route {
    /// Forwarded out of `ifindex` to the neighbour, in frames with these MACs.
    Neighbour { ifindex: u32, macs: FrameMacs },
    /// Forwarded out of `ifindex`, neighbour not resolved yet.
    Unresolved { ifindex: u32 },
    /// Anything else (local, no route, blackhole, forwarding off, ...): the host stack decides.
    Other,
}

/// The flow's current destination as the host forwards a packet received on the program's
/// interface. (`BPF_FIB_LOOKUP_OUTPUT` would take that interface as the output device and
/// find no route out of another one.) The MTU is checked separately: the FIB's own check
/// compares the whole length of a GSO packet, while only its segments need to fit.
///
/// With `choose_source`, the FIB also chooses the address the host would send from on that
/// route (`BPF_FIB_LOOKUP_SRC`, as the host's addresses are now), left in `route_source`;
/// where the kernel cannot (older than 6.7, or no address), the route is `Other` and the host
/// stack decides.
#[inline(always)]
pub fn route(ctx: &TcContext, flow: &Flow, choose_source: bool) -> Route {
    route_from(ctx, flow, ifindex(ctx), choose_source)
}

/// [`route`] for a packet received on `input_ifindex` (at an uplink's egress, the container's
/// veth that a packet the host stack forwarded came in by).
#[inline(never)]
pub fn route_from(ctx: &TcContext, flow: &Flow, input_ifindex: u32, choose_source: bool) -> Route {
    let Some(hop) = next_hop(ctx, flow, input_ifindex, choose_source) else {
        return Route::Other;
    };
    // SAFETY: this CPU's `next_hops` slot, which only this program run touches now.
    let hop = unsafe { &mut *hop };
    let route = match hop.answer {
        BPF_FIB_LKUP_RET_SUCCESS => Route::Neighbour {
            ifindex: hop.ifindex,
            macs: FrameMacs(hop.frame_macs),
        },
        BPF_FIB_LKUP_RET_NO_NEIGH => Route::Unresolved {
            ifindex: hop.ifindex,
        },
        _ => return Route::Other,
    };
    if choose_source && let Some(slot) = route_source.get_ptr_mut(0) {
        // SAFETY: the slot is this CPU's, written and read within one program run.
        unsafe { slot.write(hop.source) };
    }
    // Too big: the host stack answers with "fragmentation needed" or fragments it.
    if ctx.len() <= hop.mtu || fits_mtu(ctx, hop) {
        route
    } else {
        Route::Other
    }
}

/// The interface the FIB forwards the flow out of, as received on `input_ifindex`, whatever
/// the packet's size, with the source address it chooses left in `route_source`; zero where it
/// would not forward it (local, unroutable, no source address it could choose).
#[inline(never)]
pub fn chosen_source(ctx: &TcContext, flow: &Flow, input_ifindex: u32) -> u32 {
    let Some(hop) = next_hop(ctx, flow, input_ifindex, true) else {
        return 0;
    };
    // SAFETY: this CPU's `next_hops` slot, which only this program run touches now.
    let hop = unsafe { &*hop };
    if hop.answer != BPF_FIB_LKUP_RET_SUCCESS && hop.answer != BPF_FIB_LKUP_RET_NO_NEIGH {
        return 0;
    }
    let Some(slot) = route_source.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: the slot is this CPU's, written and read within one program run.
    unsafe { slot.write(hop.source) };
    hop.ifindex
}

/// [`local_destination`]: the flow's destination is no address of the host's.
pub const NOT_LOCAL: u8 = 0;
/// A local address the host does not answer the packet's source from by the interface it
/// came in by (a Service address a kube-proxy binds to its dummy interface, another
/// interface's address, a second address of that interface).
pub const LOCAL: u8 = 1;
/// A local address the host answers the packet's source from, by the interface it came in
/// by: the address it chooses to send from on its route back to the source.
pub const LOCAL_SOURCE: u8 = 2;

/// What the flow's destination is to the host as its addresses are now, by two FIB lookups
/// (the FIB's answer for a local address names no interface, and a table lookup meets the
/// local route first): whether the host delivers it locally, and whether it is the address
/// the host would answer the packet's source from, out of the interface it came in by. A
/// plain integer: a BPF call returns one register.
#[inline(never)]
pub fn local_destination(ctx: &TcContext, flow: &Flow) -> u8 {
    let mut storage = MaybeUninit::uninit();
    let params = fib_params(flow, ifindex(ctx), &mut storage);
    // SAFETY: skb is this program's context and params a correctly sized, initialised struct.
    let answer = unsafe {
        fib_lookup(
            ctx.as_ptr(),
            &raw mut *params,
            size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    } as u32;
    if answer != BPF_FIB_LKUP_RET_NOT_FWDED {
        return NOT_LOCAL;
    }
    // The way back: to the packet's source, from an address the kernel chooses.
    let params = fib_params(flow, ifindex(ctx), &mut storage);
    params.sport = flow.dport;
    params.dport = flow.sport;
    if flow.family == FAMILY_IPV4 {
        params.__bindgen_anon_3.ipv4_src = 0;
        params.__bindgen_anon_4.ipv4_dst = flow.saddr.words()[0];
    } else {
        params.__bindgen_anon_3.ipv6_src = [0; 4];
        params.__bindgen_anon_4.ipv6_dst = flow.saddr.words();
    }
    // SAFETY: as above.
    let answer = unsafe {
        fib_lookup(
            ctx.as_ptr(),
            &raw mut *params,
            size_of::<bpf_fib_lookup>() as i32,
            BPF_FIB_LOOKUP_SRC | BPF_FIB_LOOKUP_SKIP_NEIGH,
        )
    } as u32;
    if answer != BPF_FIB_LKUP_RET_SUCCESS || params.ifindex != ifindex(ctx) {
        return LOCAL;
    }
    // SAFETY: the kernel wrote the source address's union member of the lookup's family.
    let source = unsafe {
        if flow.family == FAMILY_IPV4 {
            Address::ipv4(params.__bindgen_anon_3.ipv4_src.to_ne_bytes())
        } else {
            Address::from_words(params.__bindgen_anon_3.ipv6_src)
        }
    };
    if source == flow.daddr {
        LOCAL_SOURCE
    } else {
        LOCAL
    }
}

/// Whether the packet fits the MTU of the answer's output interface, by the kernel's check
/// (which compares the whole frame with the MTU plus the link header, and a GSO packet's
/// segments with the MTU); the MTU it reports is kept with the answer.
#[inline(always)]
fn fits_mtu(ctx: &TcContext, hop: &mut NextHop) -> bool {
    let mut mtu: u32 = 0;
    // SAFETY: skb is this program's context; mtu is a u32 on this stack, zero as the
    // BPF_MTU_CHK_SEGS mode requires.
    let fits = unsafe {
        bpf_check_mtu(
            ctx.as_ptr(),
            hop.ifindex,
            &raw mut mtu,
            0,
            u64::from(bpf_check_mtu_flags::BPF_MTU_CHK_SEGS),
        )
    } == 0;
    hop.mtu = mtu;
    fits
}

/// This CPU's `next_hops` slot for the flow, holding the FIB's answer: the one found there
/// when it is for the same question and of this clock tick, else a new lookup's.
#[inline(always)]
fn next_hop(
    ctx: &TcContext,
    flow: &Flow,
    ifindex: u32,
    choose_source: bool,
) -> Option<*mut NextHop> {
    let choose_source = u8::from(choose_source);
    let hop = next_hops.get_ptr_mut(slot(flow, ifindex))?;
    // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
    let kept = unsafe { &*hop };
    let now = flow.now;
    if kept.looked_up_ns != now || !kept.answers(flow, ifindex, choose_source) {
        look_up(ctx, flow, ifindex, choose_source, hop, now);
    }
    Some(hop)
}

/// The `next_hops` slot of a question: its words folded, then spread by a multiplicative
/// (Fibonacci) hash, whose top bits depend on all of them.
#[inline(always)]
fn slot(flow: &Flow, ifindex: u32) -> u32 {
    let ([d0, d1, d2, d3], [s0, s1, s2, s3]) = (flow.daddr.words(), flow.saddr.words());
    let mixed = d0 ^ d1 ^ d2 ^ d3 ^ (s0 ^ s1 ^ s2 ^ s3).rotate_left(13);
    let ports = u32::from(flow.sport) << 16 | u32::from(flow.dport);
    let folded = mixed ^ ports.rotate_left(7) ^ ifindex ^ u32::from(flow.protocol);
    folded.wrapping_mul(0x9e37_79b1) >> (32 - NEXT_HOP_SLOTS_LOG2)
}

impl NextHop {
    /// Whether this answer is for the question the flow asks on `ifindex`.
    #[inline(always)]
    fn answers(&self, flow: &Flow, ifindex: u32, choose_source: u8) -> bool {
        self.query_destination == flow.daddr
            && self.query_source == flow.saddr
            && self.query_ifindex == ifindex
            && self.query_source_port == flow.sport
            && self.query_destination_port == flow.dport
            && self.query_family == flow.family
            && self.query_protocol == flow.protocol
            && self.query_choose_source == choose_source
    }
}

/// Asks the FIB about the flow and keeps the question and the answer in `hop`. Inlined: a
/// frame of its own would deepen the call chains under `route` past the verifier's 512 bytes.
#[inline(always)]
fn look_up(
    ctx: &TcContext,
    flow: &Flow,
    ifindex: u32,
    choose_source: u8,
    hop: *mut NextHop,
    now: u64,
) {
    let mut storage = MaybeUninit::uninit();
    let params = fib_params(flow, ifindex, &mut storage);
    let flags = if choose_source != 0 {
        BPF_FIB_LOOKUP_SRC
    } else {
        0
    };
    // SAFETY: skb is this program's context and params a correctly sized, initialised struct.
    let answer = unsafe {
        fib_lookup(
            ctx.as_ptr(),
            &raw mut *params,
            size_of::<bpf_fib_lookup>() as i32,
            flags,
        )
    } as u32;
    // SAFETY: this CPU's `next_hops` slot; programs on one CPU do not overlap.
    let hop = unsafe { &mut *hop };
    hop.query_source = flow.saddr;
    hop.query_destination = flow.daddr;
    hop.query_ifindex = ifindex;
    hop.query_source_port = flow.sport;
    hop.query_destination_port = flow.dport;
    hop.query_family = flow.family;
    hop.query_protocol = flow.protocol;
    hop.query_choose_source = choose_source;
    hop.looked_up_ns = now;
    hop.answer = answer;
    hop.ifindex = params.ifindex;
    hop.mtu = 0;
    // SAFETY: the kernel filled in the MAC addresses on success, and wrote the source
    // address's union member of the lookup's family when asked for it; other answers do not
    // read them.
    unsafe {
        let macs = params.__bindgen_anon_6.__bindgen_anon_2;
        hop.frame_macs[..6].copy_from_slice(&macs.dmac);
        hop.frame_macs[6..].copy_from_slice(&macs.smac);
        hop.source = if flow.family == FAMILY_IPV4 {
            Address::ipv4(params.__bindgen_anon_3.ipv4_src.to_ne_bytes())
        } else {
            Address::from_words(params.__bindgen_anon_3.ipv6_src)
        };
    }
}

/// The FIB lookup of the flow's current addresses and ports, as for a packet received on
/// `ifindex`.
#[inline(always)]
fn fib_params<'a>(
    flow: &Flow,
    ifindex: u32,
    params: &'a mut MaybeUninit<bpf_fib_lookup>,
) -> &'a mut bpf_fib_lookup {
    // Zeroed (the documented initial state) in place, a word at a time and volatile, as
    // `crate::zero` does for the datapath's own types (this one is the kernel's).
    let zeros = params.as_mut_ptr().cast::<u32>();
    for index in 0..size_of::<bpf_fib_lookup>() / size_of::<u32>() {
        // SAFETY: within `params`, which is aligned for u32 (it holds u32 fields).
        unsafe { zeros.add(index).write_volatile(0) };
    }
    // SAFETY: every byte was written; bpf_fib_lookup is plain old data.
    let params = unsafe { params.assume_init_mut() };
    params.family = flow.family;
    params.l4_protocol = flow.protocol;
    params.sport = flow.sport;
    params.dport = flow.dport;
    if flow.family == FAMILY_IPV4 {
        params.__bindgen_anon_3.ipv4_src = flow.saddr.words()[0];
        params.__bindgen_anon_4.ipv4_dst = flow.daddr.words()[0];
    } else {
        params.__bindgen_anon_3.ipv6_src = flow.saddr.words();
        params.__bindgen_anon_4.ipv6_dst = flow.daddr.words();
    }
    params.ifindex = ifindex;
    params
}

/// Sends the packet on along `route`; `None` when the route is not one to send it on. The
/// packet is marked translated: the egress hook of its output interface takes it as the
/// datapath's own (at an uplink, not as the host's traffic that leaves from its address).
pub fn forward(ctx: &TcContext, route: &Route) -> Result<Option<i32>, DatapathError> {
    if !matches!(route, Route::Other) {
        mark_translated(ctx);
    }
    match route {
        Route::Neighbour { ifindex, macs } => {
            store_macs(ctx, &macs.0)?;
            // SAFETY: bpf_redirect has no memory arguments.
            Ok(Some(unsafe { bpf_redirect(*ifindex, 0) as i32 }))
        }
        Route::Unresolved { ifindex } => {
            // SAFETY: a null parameter block asks the kernel to resolve the next hop itself.
            Ok(Some(unsafe {
                bpf_redirect_neigh(*ifindex, core::ptr::null_mut(), 0, 0) as i32
            }))
        }
        Route::Other => Ok(None),
    }
}
