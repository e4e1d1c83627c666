//! The socket buffer around a packet: cnibpf's mark, the interface, the sending socket, MAC
//! addresses and redirects.

use aya_ebpf::{
    EbpfContext as _,
    bindings::__sk_buff,
    helpers::{bpf_redirect_peer, bpf_sk_fullsock},
    programs::TcContext,
};

use super::DatapathError;

/// `__sk_buff::tc_index` of a packet a cnibpf hook translated and handed to a container's
/// veth (or to the stack) for its `to_container` to see: that hook must not take the fresh
/// translation for a stale one. No qdisc the kernel still has reads `tc_index`.
const TRANSLATED: u32 = 0xcb1f;

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

/// The interface the program runs on.
pub fn ifindex(ctx: &TcContext) -> u32 {
    // SAFETY: the context pointer is the __sk_buff the kernel handed to this program.
    unsafe { (*ctx.as_ptr().cast::<__sk_buff>()).ifindex }
}

/// Whether a local socket sent the packet: the host's own traffic. A forwarded packet never
/// carries one (the stack drops one that does), nor does one that crossed a veth from a
/// container (its socket is released at the crossing). A full socket of no protocol is
/// nobody's: `BPF_PROG_TEST_RUN` gives every packet it runs one, and its packets are taken as
/// the stack forwards them.
#[inline(always)]
pub fn from_local_socket(ctx: &TcContext) -> bool {
    // SAFETY: the context is this program's __sk_buff; TC programs may read its socket
    // pointer, and a full socket's protocol.
    unsafe {
        let socket = (*ctx.as_ptr().cast::<__sk_buff>()).__bindgen_anon_2.sk;
        if socket.is_null() {
            return false;
        }
        let full = bpf_sk_fullsock(socket);
        full.is_null() || (*full).protocol != 0
    }
}

/// Writes the Ethernet destination and source addresses (one store: a helper call each would
/// cost twice).
pub fn set_macs(
    ctx: &TcContext,
    destination: &[u8; 6],
    source: &[u8; 6],
) -> Result<(), DatapathError> {
    let mut macs = [0u8; 12];
    macs[..6].copy_from_slice(destination);
    macs[6..].copy_from_slice(source);
    store_macs(ctx, &macs)
}

/// A frame's Ethernet destination and source addresses, in the frame's order, on a word
/// boundary, so that copies of them go a word at a time.
#[derive(Clone, Copy)]
#[repr(C, align(4))]
pub struct FrameMacs(pub [u8; 12]);

/// Writes `macs`, the Ethernet destination address followed by the source address.
pub fn store_macs(ctx: &TcContext, macs: &[u8; 12]) -> Result<(), DatapathError> {
    ctx.store(0, macs, 0)
        .map_err(|_| DatapathError::RewriteFailed)
}

/// Hands the packet to the peer of veth `ifindex` (into the container's namespace), skipping
/// the bridge and the host stack.
pub fn redirect_to_peer(ifindex: u32) -> i32 {
    // SAFETY: bpf_redirect_peer has no memory arguments.
    unsafe { bpf_redirect_peer(ifindex, 0) as i32 }
}
