//! Packets as TC programs see them (offsets from the Ethernet header): reading their fields,
//! [`parse`] (one parser for every feature, ICMP error quotes included), [`rewrite`] (addresses,
//! ports, TTL and every checksum they touch), [`verdict`] (what a feature answers its hook and
//! what the hook answers the kernel) and [`skb`] (marks, redirects, MAC addresses). Addresses
//! are kept as `cnibpf_common::address::Address` (IPv4 in the first four bytes), ports in
//! network byte order as on the wire.

pub mod extension;
pub mod field;
pub mod icmp;
pub mod parse;
pub mod rewrite;
pub mod skb;
pub mod verdict;

use aya_ebpf::programs::TcContext;

pub use cnibpf_common::packet::Fragment;
pub use extension::extension_headers;
pub use field::{Header, load};
pub use parse::{Flow, SourceAddress, source_address};
pub use rewrite::csum_diff;
pub use skb::{
    FrameMacs, from_local_socket, ifindex, mark_translated, redirect_to_peer, set_macs, store_macs,
    take_translated_mark,
};
pub(crate) use verdict::or_verdict;
pub use verdict::{Answer, DROP, DatapathError, Handover, NEXT};

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
const IPV4_CSUM_OFF: usize = ETH_HLEN + 10;
pub const IPV4_SADDR_OFF: usize = ETH_HLEN + 12;
pub const IPV4_DADDR_OFF: usize = ETH_HLEN + 16;
pub const IPV6_HLEN: usize = 40;
pub const IPV6_SADDR_OFF: usize = ETH_HLEN + 8;
pub const IPV6_DADDR_OFF: usize = ETH_HLEN + 24;
/// Enough of any L4 header for ports and checksum, pulled into the linear area up front.
const L4_PULL: usize = 20;

/// Brings the first `length` bytes into the linear area, where direct reads can see them —
/// only when they are not there already: pulling also makes a cloned packet (every TCP
/// segment a container sends is one) writable, which copies its headers even when nothing is
/// rewritten. A packet shorter than `length` stays as it is; reads check their own bounds.
fn ensure_linear(ctx: &TcContext, length: usize) {
    if ctx.data() + length > ctx.data_end() {
        let _ = ctx.pull_data(length as u32);
    }
}

/// Reads a packet field with `bpf_skb_load_bytes`, wherever it lies (the linear area or not)
/// and whatever bounds the verifier knows of `offset`.
pub fn load_anywhere<T: Copy>(ctx: &TcContext, offset: usize) -> Result<T, DatapathError> {
    ctx.load(offset).map_err(|_| DatapathError::Truncated)
}
