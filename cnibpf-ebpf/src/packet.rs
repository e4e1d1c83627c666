//! Parsing and rewriting of IPv4 and IPv6 TCP, UDP, SCTP and ICMP echo packets as TC programs
//! see them (offsets from the Ethernet header). Addresses are kept as the 16-byte map form (IPv4
//! in the first four bytes), ports in network byte order as on the wire. An ICMP echo's
//! identifier plays the port of the side that chose it: the source port of a request, the
//! destination port of a reply, so that a reply's tuple is the request's reversed.

use core::mem::MaybeUninit;

use aya_ebpf::{
    EbpfContext as _,
    bindings::{__sk_buff, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, TC_ACT_SHOT, TC_ACT_UNSPEC},
    cty::c_void,
    helpers::{bpf_csum_diff, bpf_loop, bpf_redirect_peer},
    programs::TcContext,
};
use cnibpf_common::{
    FAMILY_IPV4, FAMILY_IPV6, PROTO_ICMP, PROTO_ICMPV6, PROTO_SCTP, PROTO_TCP, PROTO_UDP,
    drop_stats::DropReason,
    internet_checksum,
    masq_fragment::FragmentKey,
    sctp_checksum::{self, Product},
};

use crate::drops;

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
const IPV4_CSUM_OFF: usize = ETH_HLEN + 10;
pub const IPV4_SADDR_OFF: usize = ETH_HLEN + 12;
pub const IPV4_DADDR_OFF: usize = ETH_HLEN + 16;
pub const IPV6_HLEN: usize = 40;
pub const IPV6_SADDR_OFF: usize = ETH_HLEN + 8;
pub const IPV6_DADDR_OFF: usize = ETH_HLEN + 24;
const IPV4_FRAGMENT_OFFSET_MASK: u16 = 0x1fff;
const IPV4_MORE_FRAGMENTS: u16 = 0x2000;
pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;
const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_ECHO_REQUEST: u8 = 8;
const ICMPV6_ECHO_REQUEST: u8 = 128;
const ICMPV6_ECHO_REPLY: u8 = 129;
/// Where SCTP's common header keeps its checksum.
const SCTP_CHECKSUM_OFF: usize = 8;
/// Enough of any L4 header for ports and checksum, pulled into the linear area up front.
const L4_PULL: usize = 20;
/// The largest offset read directly at a variable position: the verifier must see a bound
/// (IPv4 options and the IPv6 extension headers walked end well before it).
const MAX_DIRECT_OFFSET: usize = 512;

/// The verdict for a packet cnibpf leaves alone, or rewrote and leaves to the stack: on to the
/// next tcx program or tc filter, then the stack (`TCX_NEXT`, `TC_ACT_UNSPEC`). Never
/// `TC_ACT_OK`, which would end tc processing for every program and filter after cnibpf's:
/// an operator's own filters and other plugins' programs on the same hooks must keep seeing
/// what cnibpf does not take.
pub const NEXT: i32 = TC_ACT_UNSPEC;
/// The verdict for a packet cnibpf drops (the filter, or a rewrite that failed half way).
pub const DROP: i32 = TC_ACT_SHOT;

/// A feature's answer that the packet is translated and must be handed to the container its
/// [`Handover`] names — the hook does that, filter first.
pub const TO_CONTAINER: i32 = i32::MIN + 1;
/// A feature's answer that the packet is none of its business: the hook asks the next one.
pub const NOT_MINE: i32 = i32::MIN;

/// The container a translated packet goes to: its host-side veth and the MAC addresses it
/// expects on its frames (its own, its gateway's).
#[derive(Clone, Copy)]
pub struct Handover {
    pub host_ifindex: u32,
    pub container_mac: [u8; 6],
    pub gateway_mac: [u8; 6],
}

/// Decrements an IPv6 packet's hop limit; `false` when it runs out (nothing written).
#[inline(always)]
fn decrement_ipv6_hop_limit(ctx: &TcContext) -> Result<bool, DatapathError> {
    let hop_limit: u8 = load(ctx, ETH_HLEN + 7)?;
    if hop_limit <= 1 {
        return Ok(false);
    }
    ctx.store(ETH_HLEN + 7, &(hop_limit - 1), 0)
        .map_err(|_| DatapathError::RewriteFailed)?;
    Ok(true)
}

/// `slot` zeroed in place (see [`zero`]), for a value of integers and byte arrays only.
#[inline(always)]
pub fn zeroed<T: Zeroable>(slot: &mut MaybeUninit<T>) -> &mut T {
    // SAFETY: all of `slot` is zeroed, a valid value of a `Zeroable` type.
    unsafe {
        zero(slot.as_mut_ptr().cast(), size_of::<T>());
        slot.assume_init_mut()
    }
}

/// Types whose all-zero bytes are a valid value.
///
/// # Safety
/// Only for types made of integers and arrays of them.
pub unsafe trait Zeroable {}

// SAFETY: an integer and two byte arrays.
unsafe impl Zeroable for Handover {}

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

/// The value of a `Result` step, or a return of its error's verdict: for functions that
/// return verdicts rather than a `Result` — LLVM packs an early `Ok` with whatever a register
/// holds (a map or packet pointer), and the verifier refuses the unused bits it builds from it.
macro_rules! or_verdict {
    ($ctx:expr, $step:expr) => {
        match $step {
            Ok(value) => value,
            Err(error) => return $crate::packet::DatapathError::verdict(error, $ctx),
        }
    };
}
pub(crate) use or_verdict;

/// Why a program stopped early, and what that means for the packet.
#[derive(Clone, Copy)]
pub enum DatapathError {
    /// The packet was shorter than its headers claim: not ours to judge, the stack drops it.
    Truncated,
    /// A rewrite helper failed after the packet was partly changed: passing it on would deliver
    /// a packet with a wrong address or checksum, so it is dropped.
    RewriteFailed,
}

impl DatapathError {
    /// The packet's verdict; a drop is counted and reported (`drops`).
    pub fn verdict(self, ctx: &TcContext) -> i32 {
        match self {
            Self::Truncated => NEXT,
            Self::RewriteFailed => {
                drops::record_unread(ctx, DropReason::RewriteFailed, ifindex(ctx));
                DROP
            }
        }
    }
}

/// A TCP, UDP, SCTP or ICMP echo packet over IPv4 or IPv6 (no extension headers but a
/// fragment header).
#[derive(Clone, Copy)]
pub struct Flow {
    pub family: u8,
    pub protocol: u8,
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    /// Network byte order; zero in a later fragment.
    pub sport: u16,
    /// Network byte order; zero in a later fragment.
    pub dport: u16,
    pub fragment: Fragment,
    /// The datagram's identification (IPv4's 16 bits or the IPv6 fragment header's 32) as on
    /// the wire; zero for a whole datagram.
    pub fragment_id: u32,
    l4_off: usize,
}

/// Where a packet stands in its datagram.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Fragment {
    Whole,
    /// The first fragment, which carries the L4 header.
    First,
    /// A later fragment: no L4 header, so no ports; only addresses can be rewritten.
    Later,
}

/// The IPv6 fragment header's next-header value.
const IPV6_FRAGMENT_HEADER: u8 = 44;
const IPV6_FRAGMENT_HLEN: usize = 8;

/// Brings the first `length` bytes into the linear area, where direct reads can see them —
/// only when they are not there already: pulling also makes a cloned packet (every TCP
/// segment a container sends is one) writable, which copies its headers even when nothing is
/// rewritten. A packet shorter than `length` stays as it is; reads check their own bounds.
fn ensure_linear(ctx: &TcContext, length: usize) {
    if ctx.data() + length > ctx.data_end() {
        let _ = ctx.pull_data(length as u32);
    }
}

/// IPv6 extension headers a translation may pass: hop-by-hop options, destination options, a
/// routing header with no segments left (the destination is final), and a fragment header.
const IPV6_HOP_BY_HOP: u8 = 0;
const IPV6_ROUTING: u8 = 43;
const IPV6_DESTINATION_OPTIONS: u8 = 60;
/// How many extension headers are walked: a packet with more is left alone.
const MAX_EXTENSION_HEADERS: usize = 4;

/// Walks an IPv6 packet's extension headers to its transport header: (protocol, its offset,
/// where the packet stands in its datagram, the fragment identification); `None` for a
/// routing header with segments left (its destination is not the final one), or more headers
/// than are walked. Read with `bpf_skb_load_bytes`: the headers need not be linear, and the
/// offsets grow with each.
#[inline(always)]
pub fn extension_headers(
    ctx: &TcContext,
) -> Result<Option<(u8, usize, Fragment, u32)>, DatapathError> {
    let mut next_header: u8 = load_anywhere(ctx, ETH_HLEN + 6)?;
    let mut offset = ETH_HLEN + IPV6_HLEN;
    let mut fragment = Fragment::Whole;
    let mut fragment_id = 0;
    for _ in 0..MAX_EXTENSION_HEADERS {
        match next_header {
            IPV6_HOP_BY_HOP | IPV6_DESTINATION_OPTIONS | IPV6_ROUTING => {
                // Next header, length in 8-byte units beyond the first 8; a routing header's
                // type and segments left.
                let header: [u8; 4] = load_anywhere(ctx, offset)?;
                if next_header == IPV6_ROUTING && header[3] != 0 {
                    return Ok(None);
                }
                next_header = header[0];
                offset += (usize::from(header[1]) + 1) * 8;
            }
            IPV6_FRAGMENT_HEADER => {
                let header: [u8; 8] = load_anywhere(ctx, offset)?;
                let offset_and_more = u16::from_be_bytes([header[2], header[3]]);
                fragment = if offset_and_more >> 3 != 0 {
                    Fragment::Later
                } else if offset_and_more & 1 != 0 {
                    Fragment::First
                } else {
                    Fragment::Whole
                };
                fragment_id = u32::from_ne_bytes([header[4], header[5], header[6], header[7]]);
                next_header = header[0];
                offset += IPV6_FRAGMENT_HLEN;
            }
            _ => return Ok(Some((next_header, offset, fragment, fragment_id))),
        }
    }
    Ok(None)
}

/// Reads a packet field with `bpf_skb_load_bytes`, wherever it lies (the linear area or not)
/// and whatever bounds the verifier knows of `offset`.
pub fn load_anywhere<T: Copy>(ctx: &TcContext, offset: usize) -> Result<T, DatapathError> {
    ctx.load(offset).map_err(|_| DatapathError::Truncated)
}

/// The ones'-complement difference between two 16-byte addresses (IPv4: the first four).
pub fn csum_diff(old: &[u8; 16], new: &[u8; 16]) -> Result<u32, DatapathError> {
    let mut from = *old;
    let mut to = *new;
    // SAFETY: both buffers are 16 bytes on this program's stack.
    let diff =
        unsafe { bpf_csum_diff(from.as_mut_ptr().cast(), 16, to.as_mut_ptr().cast(), 16, 0) };
    u32::try_from(diff).map_err(|_| DatapathError::RewriteFailed)
}

pub fn load<T: Copy>(ctx: &TcContext, offset: usize) -> Result<T, DatapathError> {
    let start = ctx.data();
    if start + offset + size_of::<T>() > ctx.data_end() {
        return Err(DatapathError::Truncated);
    }
    // SAFETY: the range was checked against data_end just above; unaligned reads are how
    // packet fields are read.
    Ok(unsafe { ((start + offset) as *const T).read_unaligned() })
}

impl Flow {
    /// A whole datagram, a first fragment (with ports) or a later fragment (without) of TCP,
    /// UDP, SCTP or ICMP echo; `None` for anything else.
    pub fn parse(ctx: &TcContext) -> Result<Option<Self>, DatapathError> {
        ensure_linear(ctx, ETH_HLEN);
        let ethertype: u16 = load(ctx, 12)?;
        if ethertype == ETH_P_IP.to_be() {
            Self::parse_ipv4(ctx)
        } else if ethertype == ETH_P_IPV6.to_be() {
            Self::parse_ipv6(ctx)
        } else {
            Ok(None)
        }
    }

    #[inline(always)]
    fn parse_ipv4(ctx: &TcContext) -> Result<Option<Self>, DatapathError> {
        let version_ihl: u8 = load(ctx, ETH_HLEN)?;
        let header_len = usize::from(version_ihl & 0x0f) * 4;
        if version_ihl >> 4 != 4 || header_len < 20 {
            return Ok(None);
        }
        // A datagram that claims more than arrived is the stack's to drop, not ours to
        // translate (0: a segmentation offload's, whose length the stack fixes).
        let total = usize::from(u16::from_be(load::<u16>(ctx, ETH_HLEN + 2)?));
        if total != 0 && (total < header_len || (ctx.len() as usize) < ETH_HLEN + total) {
            return Ok(None);
        }
        // Identification and flags/offset, read together.
        let id_and_fragment: [u8; 4] = load(ctx, ETH_HLEN + 4)?;
        let fragment_bits = u16::from_be_bytes([id_and_fragment[2], id_and_fragment[3]]);
        let fragment = if fragment_bits & IPV4_FRAGMENT_OFFSET_MASK != 0 {
            Fragment::Later
        } else if fragment_bits & IPV4_MORE_FRAGMENTS != 0 {
            Fragment::First
        } else {
            Fragment::Whole
        };
        ensure_linear(ctx, ETH_HLEN + header_len + L4_PULL);
        let protocol: u8 = load(ctx, ETH_HLEN + 9)?;
        let l4_off = ETH_HLEN + header_len;
        let (translated, sport, dport) = ports(ctx, protocol, l4_off, fragment)?;
        if !translated {
            return Ok(None);
        }
        let saddr: [u8; 4] = load(ctx, IPV4_SADDR_OFF)?;
        let daddr: [u8; 4] = load(ctx, IPV4_DADDR_OFF)?;
        Ok(Some(Self {
            family: FAMILY_IPV4,
            protocol,
            saddr: widen_fast(saddr),
            daddr: widen_fast(daddr),
            sport,
            dport,
            fragment,
            fragment_id: if fragment == Fragment::Whole {
                0
            } else {
                u32::from(u16::from_ne_bytes([id_and_fragment[0], id_and_fragment[1]]))
            },
            l4_off,
        }))
    }

    #[inline(always)]
    fn parse_ipv6(ctx: &TcContext) -> Result<Option<Self>, DatapathError> {
        let version: u8 = load(ctx, ETH_HLEN)?;
        if version >> 4 != 6 {
            return Ok(None);
        }
        let payload = usize::from(u16::from_be(load::<u16>(ctx, ETH_HLEN + 4)?));
        if payload != 0 && (ctx.len() as usize) < ETH_HLEN + IPV6_HLEN + payload {
            return Ok(None);
        }
        let (protocol, l4_off, fragment, fragment_id) = match extension_headers(ctx)? {
            Some(walked) => walked,
            None => return Ok(None),
        };
        ensure_linear(ctx, l4_off + L4_PULL);
        let (translated, sport, dport) = ports(ctx, protocol, l4_off, fragment)?;
        if !translated {
            return Ok(None);
        }
        Ok(Some(Self {
            family: FAMILY_IPV6,
            protocol,
            saddr: load(ctx, IPV6_SADDR_OFF)?,
            daddr: load(ctx, IPV6_DADDR_OFF)?,
            sport,
            dport,
            fragment,
            fragment_id,
            l4_off,
        }))
    }

    /// The key of the datagram this packet is a fragment of (`masq_fragments`,
    /// `nat_fragments`).
    pub fn fragment_key(&self) -> FragmentKey {
        FragmentKey {
            src_addr: self.saddr,
            dst_addr: self.daddr,
            id: self.fragment_id,
            protocol: self.protocol,
            family: self.family,
            _pad: [0; 2],
        }
    }

    /// Whether a TCP packet opens a connection (SYN without ACK).
    pub fn is_tcp_syn(&self, ctx: &TcContext) -> Result<bool, DatapathError> {
        let flags = self.tcp_flags(ctx)?;
        Ok(flags & TCP_SYN != 0 && flags & TCP_ACK == 0)
    }

    /// The TCP flags byte (zero for other protocols): read directly where parsing left the
    /// header (the linear area), else with `bpf_skb_load_bytes`. A `Flow` passed between
    /// functions loses the verifier's bounds on `l4_off`: the offset is bounded again here.
    /// Not inlined: its two ways of reading would double the paths the verifier walks after
    /// each caller's read.
    #[inline(never)]
    pub fn tcp_flags(&self, ctx: &TcContext) -> Result<u8, DatapathError> {
        if self.protocol != PROTO_TCP || self.fragment == Fragment::Later {
            return Ok(0);
        }
        // The data offset byte too: for a one-byte read LLVM turns the bounds check into a
        // comparison the verifier takes as one byte short.
        let offset = self.l4_off + 12;
        if offset < MAX_DIRECT_OFFSET
            && let Ok([_, flags]) = load::<[u8; 2]>(ctx, offset)
        {
            return Ok(flags);
        }
        load_anywhere(ctx, offset + 1)
    }

    /// Offset of the L4 checksum where it covers the addresses (the pseudo-header): not
    /// SCTP's CRC32c, not ICMPv4's.
    fn address_csum_off(&self) -> Option<usize> {
        if self.fragment == Fragment::Later {
            return None;
        }
        match self.protocol {
            PROTO_TCP => Some(self.l4_off + 16),
            PROTO_UDP => Some(self.l4_off + 6),
            PROTO_ICMPV6 => Some(self.l4_off + 2),
            _ => None,
        }
    }

    /// Offset of the L4 checksum that covers the ports (or the echo identifier).
    fn port_csum_off(&self) -> Option<usize> {
        if self.fragment == Fragment::Later {
            return None;
        }
        match self.protocol {
            PROTO_TCP => Some(self.l4_off + 16),
            PROTO_UDP => Some(self.l4_off + 6),
            PROTO_ICMP | PROTO_ICMPV6 => Some(self.l4_off + 2),
            _ => None,
        }
    }

    fn port_off(&self, side: Side) -> usize {
        match (self.protocol, side) {
            (PROTO_ICMP | PROTO_ICMPV6, _) => self.l4_off + 4,
            (_, Side::Source) => self.l4_off,
            (_, Side::Destination) => self.l4_off + 2,
        }
    }

    /// Decrements the TTL (hop limit) of a packet the datapath forwards itself, as a router
    /// does; `false` when it must not be forwarded (the host stack then answers with ICMP time
    /// exceeded).
    #[inline(never)]
    pub fn decrement_hop_limit(&self, ctx: &TcContext) -> Result<bool, DatapathError> {
        let failed = |_| DatapathError::RewriteFailed;
        if self.family == FAMILY_IPV4 {
            // TTL and protocol share the 16-bit word the checksum update works on.
            let word: u16 = load(ctx, ETH_HLEN + 8)?;
            if u16::from_be(word) >> 8 <= 1 {
                return Ok(false);
            }
            let new = (u16::from_be(word) - 0x0100).to_be();
            ctx.l3_csum_replace(IPV4_CSUM_OFF, u64::from(word), u64::from(new), 2)
                .map_err(failed)?;
            ctx.store(ETH_HLEN + 8, &new, 0).map_err(failed)?;
        } else if !decrement_ipv6_hop_limit(ctx)? {
            return Ok(false);
        }
        Ok(true)
    }

    /// Rewrites the source address and port (network byte order) of a packet the datapath
    /// forwards itself and decrements its TTL (hop limit), as masquerade does to every packet
    /// of a flow; `false` when the TTL runs out (nothing is written: the host stack answers
    /// with time exceeded). IPv4's TTL, header checksum and source address lie side by side:
    /// one write with the checksum computed here replaces four helper calls.
    #[inline(never)]
    pub fn rewrite_forwarded_source(
        &mut self,
        ctx: &TcContext,
        addr: &[u8; 16],
        port: u16,
    ) -> Result<bool, DatapathError> {
        if self.family != FAMILY_IPV4 {
            if !decrement_ipv6_hop_limit(ctx)? {
                return Ok(false);
            }
            self.rewrite_address(ctx, Side::Source, addr)?;
        } else if !self.rewrite_forwarded_ipv4_header(ctx, addr)? {
            return Ok(false);
        }
        self.saddr = *addr;
        self.rewrite_port(ctx, Side::Source, port)?;
        self.sport = port;
        Ok(true)
    }

    /// IPv4's part of [`Self::rewrite_forwarded_source`]: TTL, header checksum and source
    /// address in one write; `false` when the TTL runs out (nothing written).
    #[inline(always)]
    fn rewrite_forwarded_ipv4_header(
        &self,
        ctx: &TcContext,
        addr: &[u8; 16],
    ) -> Result<bool, DatapathError> {
        // TTL, protocol, header checksum, source address.
        let mut header: [u8; 8] = load(ctx, ETH_HLEN + 8)?;
        if header[0] <= 1 {
            return Ok(false);
        }
        let old_word = u16::from_ne_bytes([header[0], header[1]]);
        header[0] -= 1;
        let new_word = u16::from_ne_bytes([header[0], header[1]]);
        let old4 = [self.saddr[0], self.saddr[1], self.saddr[2], self.saddr[3]];
        let new4 = [addr[0], addr[1], addr[2], addr[3]];
        let checksum = internet_checksum::replace4(
            internet_checksum::replace(
                u16::from_ne_bytes([header[2], header[3]]),
                old_word,
                new_word,
            ),
            old4,
            new4,
        );
        [header[2], header[3]] = checksum.to_ne_bytes();
        [header[4], header[5], header[6], header[7]] = new4;
        if old4 != new4 {
            self.update_pseudo_header_v4(ctx, old4, new4)?;
        }
        ctx.store(ETH_HLEN + 8, &header, 0)
            .map_err(|_| DatapathError::RewriteFailed)?;
        Ok(true)
    }

    /// Folds an IPv4 address change into the transport checksum where it covers the
    /// pseudo-header (the helper knows how the packet's checksum is offloaded).
    #[inline(always)]
    fn update_pseudo_header_v4(
        &self,
        ctx: &TcContext,
        old: [u8; 4],
        new: [u8; 4],
    ) -> Result<(), DatapathError> {
        let Some(csum_off) = self.address_csum_off() else {
            return Ok(());
        };
        let flags = u64::from(BPF_F_PSEUDO_HDR) | self.l4_csum_flags() | 4;
        ctx.l4_csum_replace(
            csum_off,
            u64::from(u32::from_ne_bytes(old)),
            u64::from(u32::from_ne_bytes(new)),
            flags,
        )
        .map_err(|_| DatapathError::RewriteFailed)
    }

    /// `bpf_l4_csum_replace` flags: UDP may carry no checksum at all, which must stay zero.
    fn l4_csum_flags(&self) -> u64 {
        if self.protocol == PROTO_UDP {
            u64::from(BPF_F_MARK_MANGLED_0)
        } else {
            0
        }
    }

    /// Rewrites the source address and port (network byte order), fixing checksums. Not
    /// inlined (nor is `rewrite_destination` or `route`): each needs scratch space, and the
    /// verifier caps the stack of a whole call chain at 512 bytes.
    #[inline(never)]
    pub fn rewrite_source(
        &mut self,
        ctx: &TcContext,
        addr: &[u8; 16],
        port: u16,
    ) -> Result<(), DatapathError> {
        self.rewrite_address(ctx, Side::Source, addr)?;
        self.rewrite_port(ctx, Side::Source, port)?;
        self.saddr = *addr;
        self.sport = port;
        Ok(())
    }

    /// Rewrites the destination address and port (network byte order), fixing checksums.
    #[inline(never)]
    pub fn rewrite_destination(
        &mut self,
        ctx: &TcContext,
        addr: &[u8; 16],
        port: u16,
    ) -> Result<(), DatapathError> {
        self.rewrite_address(ctx, Side::Destination, addr)?;
        self.rewrite_port(ctx, Side::Destination, port)?;
        self.daddr = *addr;
        self.dport = port;
        Ok(())
    }

    // BPF calls take at most five arguments: these helpers are inlined, and take few.
    #[inline(always)]
    fn rewrite_address(
        &self,
        ctx: &TcContext,
        side: Side,
        new: &[u8; 16],
    ) -> Result<(), DatapathError> {
        let (old, v6_off) = match side {
            Side::Source => (self.saddr, IPV6_SADDR_OFF),
            Side::Destination => (self.daddr, IPV6_DADDR_OFF),
        };
        if old == *new {
            return Ok(());
        }
        let failed = |_| DatapathError::RewriteFailed;
        if self.family == FAMILY_IPV4 {
            let old4 = [old[0], old[1], old[2], old[3]];
            let new4 = [new[0], new[1], new[2], new[3]];
            self.update_pseudo_header_v4(ctx, old4, new4)?;
            // The header checksum and both addresses lie side by side: one write, the checksum
            // computed here, instead of a checksum helper call and a store.
            let [high, low] = load::<[u8; 2]>(ctx, IPV4_CSUM_OFF)?;
            let checksum = internet_checksum::replace4(u16::from_ne_bytes([high, low]), old4, new4);
            let (source, destination) = match side {
                Side::Source => (
                    new4,
                    [self.daddr[0], self.daddr[1], self.daddr[2], self.daddr[3]],
                ),
                Side::Destination => (
                    [self.saddr[0], self.saddr[1], self.saddr[2], self.saddr[3]],
                    new4,
                ),
            };
            let [high, low] = checksum.to_ne_bytes();
            let header = [
                high,
                low,
                source[0],
                source[1],
                source[2],
                source[3],
                destination[0],
                destination[1],
                destination[2],
                destination[3],
            ];
            ctx.store(IPV4_CSUM_OFF, &header, 0).map_err(failed)
        } else {
            if let Some(csum_off) = self.address_csum_off() {
                let diff = csum_diff(&old, new)?;
                let flags = u64::from(BPF_F_PSEUDO_HDR) | self.l4_csum_flags();
                ctx.l4_csum_replace(csum_off, 0, u64::from(diff), flags)
                    .map_err(failed)?;
            }
            ctx.store(v6_off, new, 0).map_err(failed)
        }
    }

    #[inline(always)]
    fn rewrite_port(&self, ctx: &TcContext, side: Side, new: u16) -> Result<(), DatapathError> {
        let old = match side {
            Side::Source => self.sport,
            Side::Destination => self.dport,
        };
        if old == new {
            return Ok(());
        }
        let offset = self.port_off(side);
        let failed = |_| DatapathError::RewriteFailed;
        if let Some(csum_off) = self.port_csum_off() {
            ctx.l4_csum_replace(
                csum_off,
                u64::from(old),
                u64::from(new),
                self.l4_csum_flags() | 2,
            )
            .map_err(failed)?;
        } else if self.protocol == PROTO_SCTP && self.fragment == Fragment::Whole {
            // (A first fragment does not tell the datagram's length, which the CRC covers.)
            self.update_sctp_checksum(ctx, side, new)?;
        } else {
            return Err(DatapathError::RewriteFailed);
        }
        ctx.store(offset, &new, 0).map_err(failed)
    }

    /// Folds a port change into SCTP's CRC32c (see `cnibpf_common::sctp_checksum`): the
    /// packet's length from its IP header, the payload never read. (A packet whose checksum
    /// the stack has yet to compute gets it computed over the new ports anyway.) Not inlined:
    /// its loops stay out of the callers' code.
    #[inline(never)]
    fn update_sctp_checksum(
        &self,
        ctx: &TcContext,
        side: Side,
        new: u16,
    ) -> Result<(), DatapathError> {
        let ports: [u8; 4] = load_anywhere(ctx, self.l4_off)?;
        let mut changed = ports;
        let [high, low] = new.to_ne_bytes();
        match side {
            Side::Source => (changed[0], changed[1]) = (high, low),
            Side::Destination => (changed[2], changed[3]) = (high, low),
        }
        let (low, high) = sctp_checksum::length_factors(self.l4_length(ctx)?);
        let factor = product(low, high);
        let change = product(factor, sctp_checksum::difference(ports, changed));
        let checksum: u32 = load_anywhere(ctx, self.l4_off + SCTP_CHECKSUM_OFF)?;
        let updated = u32::from_le(checksum) ^ change;
        ctx.store(self.l4_off + SCTP_CHECKSUM_OFF, &updated.to_le(), 0)
            .map_err(|_| DatapathError::RewriteFailed)
    }

    /// Bytes from the L4 header to the end of the datagram, from the IP header's length (the
    /// packet's when that says 0, as a segmentation offload's may).
    fn l4_length(&self, ctx: &TcContext) -> Result<u32, DatapathError> {
        let (length_off, counted_from) = if self.family == FAMILY_IPV4 {
            (ETH_HLEN + 2, ETH_HLEN)
        } else {
            (ETH_HLEN + 4, ETH_HLEN + IPV6_HLEN)
        };
        let length = u32::from(u16::from_be(load_anywhere::<u16>(ctx, length_off)?));
        let header = (self.l4_off - counted_from) as u32;
        Ok(if length == 0 {
            ctx.len().saturating_sub(self.l4_off as u32)
        } else {
            length.saturating_sub(header)
        })
    }
}

/// `a · b mod P` of SCTP's CRC, its 32 steps run by `bpf_loop`: the verifier checks one step,
/// not 32 at every path that reaches here.
fn product(a: u32, b: u32) -> u32 {
    let mut product = Product::new(a, b);
    // SAFETY: the callback has the signature bpf_loop expects; its context is `product`,
    // which outlives the call.
    unsafe {
        bpf_loop(
            Product::STEPS,
            product_step as *mut c_void,
            (&raw mut product).cast(),
            0,
        )
    };
    product.value()
}

/// One step of [`product`] (`bpf_loop` callback).
extern "C" fn product_step(bit: u64, context: *mut c_void) -> i64 {
    // SAFETY: `product` passes its `Product`, alive for the whole loop.
    let product = unsafe { &mut *context.cast::<Product>() };
    product.step(bit as u32);
    0
}

#[derive(Clone, Copy)]
enum Side {
    Source,
    Destination,
}

fn is_translated_protocol(protocol: u8) -> bool {
    matches!(
        protocol,
        PROTO_TCP | PROTO_UDP | PROTO_SCTP | PROTO_ICMP | PROTO_ICMPV6
    )
}

/// The ports of a TCP, UDP or SCTP header at `l4_off`, or an ICMP echo's identifier in the
/// place of the side that chose it (zeros in a later fragment, which has no L4 header), after
/// `true`; `false` for any other packet. Inlined: as a BPF call, LLVM packs the return value
/// from a register the verifier sees uninitialised. Not an `Option` either: LLVM fills the
/// unused bits of a `None` from whatever register is at hand, a packet pointer among them,
/// which the verifier refuses to mask.
#[inline(always)]
fn ports(
    ctx: &TcContext,
    protocol: u8,
    l4_off: usize,
    fragment: Fragment,
) -> Result<(bool, u16, u16), DatapathError> {
    const NONE: (bool, u16, u16) = (false, 0, 0);
    if fragment == Fragment::Later {
        return Ok((is_translated_protocol(protocol), 0, 0));
    }
    match protocol {
        // The whole transport header must be there, not only its ports: a cut one is the
        // stack's to drop.
        PROTO_TCP => {
            let header: [u8; 20] = load(ctx, l4_off)?;
            Ok(header_ports(&header))
        }
        PROTO_UDP => {
            let header: [u8; 8] = load(ctx, l4_off)?;
            Ok(header_ports(&header))
        }
        PROTO_SCTP => {
            let header: [u8; 12] = load(ctx, l4_off)?;
            Ok(header_ports(&header))
        }
        PROTO_ICMP | PROTO_ICMPV6 => {
            // One read of the whole echo header: LLVM merges separate bounds checks into one
            // the verifier cannot follow.
            let header: [u8; 8] = load(ctx, l4_off)?;
            let icmp_type = header[0];
            let identifier = u16::from_ne_bytes([header[4], header[5]]);
            Ok(match (protocol, icmp_type) {
                (PROTO_ICMP, ICMP_ECHO_REQUEST) | (PROTO_ICMPV6, ICMPV6_ECHO_REQUEST) => {
                    (true, identifier, 0)
                }
                (PROTO_ICMP, ICMP_ECHO_REPLY) | (PROTO_ICMPV6, ICMPV6_ECHO_REPLY) => {
                    (true, 0, identifier)
                }
                _ => NONE,
            })
        }
        _ => Ok(NONE),
    }
}

/// The ports at the start of a transport header, in network byte order, after `true`.
#[inline(always)]
fn header_ports(header: &[u8]) -> (bool, u16, u16) {
    (
        true,
        u16::from_ne_bytes([header[0], header[1]]),
        u16::from_ne_bytes([header[2], header[3]]),
    )
}

/// A packet's source address, read from its linear headers.
pub enum SourceAddress {
    V4([u8; 4]),
    V6([u8; 16]),
}

/// The packet's source address when its IP header is in the linear area (nothing is pulled:
/// the caller falls back to parsing otherwise); `None` for anything else.
#[inline(always)]
pub fn source_address(ctx: &TcContext) -> Option<SourceAddress> {
    let ethertype: u16 = load(ctx, 12).ok()?;
    if ethertype == ETH_P_IP.to_be() {
        return load(ctx, IPV4_SADDR_OFF).ok().map(SourceAddress::V4);
    }
    if ethertype == ETH_P_IPV6.to_be() {
        return load(ctx, IPV6_SADDR_OFF).ok().map(SourceAddress::V6);
    }
    None
}

/// An IPv4 address in the 16-byte map form.
pub fn widen(addr: [u8; 4]) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[0] = addr[0];
    out[1] = addr[1];
    out[2] = addr[2];
    out[3] = addr[3];
    out
}

/// [`widen`] as one 128-bit integer, for the per-packet path: the zero array `widen` starts
/// from becomes a `memset` call (see [`zero`]). (Not `widen` itself: the registers LLVM then
/// picks elsewhere hand the verifier bits it sees unset.)
#[inline(always)]
fn widen_fast(addr: [u8; 4]) -> [u8; 16] {
    u128::from(u32::from_le_bytes(addr)).to_le_bytes()
}

/// Sets `addr` to the unspecified address (see [`zero`]).
#[inline(always)]
pub fn clear_address(addr: &mut [u8; 16]) {
    // SAFETY: the 16 bytes of `addr`.
    unsafe { zero(addr.as_mut_ptr(), addr.len()) };
}

/// Zeroes `len` bytes at `at` a byte at a time, volatile: on this target LLVM turns any zeroing
/// it sees (a zero array, a derived `Default`) into a call of compiler-builtins' `memset`,
/// a loop of its own, per packet.
///
/// # Safety
/// `at..at + len` must be writable.
#[inline(always)]
unsafe fn zero(at: *mut u8, len: usize) {
    for index in 0..len {
        // SAFETY: within the range the caller vouches for.
        unsafe { at.add(index).write_volatile(0) };
    }
}

/// The interface the program runs on.
pub fn ifindex(ctx: &TcContext) -> u32 {
    // SAFETY: the context pointer is the __sk_buff the kernel handed to this program.
    unsafe { (*ctx.as_ptr().cast::<__sk_buff>()).ifindex }
}

/// Whether a local socket sent the packet: the host's own traffic. A forwarded packet never
/// carries one (the stack drops one that does), nor does one that crossed a veth from a
/// container (its socket is released at the crossing).
#[inline(always)]
pub fn from_local_socket(ctx: &TcContext) -> bool {
    // SAFETY: the context is this program's __sk_buff; TC programs may read its socket
    // pointer (a full 8-byte read, compared only).
    unsafe {
        !(*ctx.as_ptr().cast::<__sk_buff>())
            .__bindgen_anon_2
            .sk
            .is_null()
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
    ctx.store(0, &macs, 0)
        .map_err(|_| DatapathError::RewriteFailed)
}

/// Hands the packet to the peer of veth `ifindex` (into the container's namespace), skipping
/// the bridge and the host stack.
pub fn redirect_to_peer(ifindex: u32) -> i32 {
    // SAFETY: bpf_redirect_peer has no memory arguments.
    unsafe { bpf_redirect_peer(ifindex, 0) as i32 }
}

/// An address as the four 32-bit words BPF helper structures take.
pub fn words(addr: &[u8; 16]) -> [u32; 4] {
    [
        u32::from_ne_bytes([addr[0], addr[1], addr[2], addr[3]]),
        u32::from_ne_bytes([addr[4], addr[5], addr[6], addr[7]]),
        u32::from_ne_bytes([addr[8], addr[9], addr[10], addr[11]]),
        u32::from_ne_bytes([addr[12], addr[13], addr[14], addr[15]]),
    ]
}

/// The address `words` made: the words' bytes in order.
pub fn unwords(words: [u32; 4]) -> [u8; 16] {
    let mut addr = [0u8; 16];
    for (index, word) in words.iter().enumerate() {
        let bytes = word.to_ne_bytes();
        addr[index * 4] = bytes[0];
        addr[index * 4 + 1] = bytes[1];
        addr[index * 4 + 2] = bytes[2];
        addr[index * 4 + 3] = bytes[3];
    }
    addr
}
