//! Reading a packet into a [`Flow`]: TCP, UDP, SCTP and ICMP echo over IPv4 and IPv6, whole
//! or fragmented. An ICMP echo's identifier plays the port of the side that chose it: the
//! source port of a request, the destination port of a reply, so that a reply's tuple is the
//! request's reversed. A later fragment, which carries no transport header, takes the ports
//! its datagram's first fragment left in `fragments`, and with them the path of its flow.

use core::mem::MaybeUninit;

use aya_ebpf::{bindings::BPF_ANY, programs::TcContext};
use cnibpf_common::{
    FAMILY_IPV4, FAMILY_IPV6, PROTO_ICMP, PROTO_ICMPV6, PROTO_SCTP, PROTO_TCP, PROTO_UDP,
    address::Address,
    connections::{FirstFragment, FragmentKey, conntrack},
    packet::{Fragment, is_echo_reply, is_echo_request},
};

use super::{
    DatapathError, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, Header, IPV4_SADDR_OFF, IPV6_HLEN,
    IPV6_SADDR_OFF, L4_PULL, ensure_linear, extension_headers, load,
};
use crate::{
    clock, maps,
    zero::{Zeroable, zeroed},
};

/// A TCP, UDP, SCTP or ICMP echo packet over IPv4 or IPv6 (no extension headers but a
/// fragment header). Laid out by hand, words first: the hooks keep it in one slot that
/// [`Flow::parse`] fills, and the features copy its addresses a word at a time. The fields
/// after the addresses sit off the verifier's 8-byte grid on purpose (but `sport`, whose
/// value no path fixes): a value stored there reads back as unknown, so the verifier does not
/// carry each parse path's exact offsets and protocol into the hooks, which it would
/// otherwise follow apart, path by path, past its limit.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Flow {
    pub saddr: Address,
    pub daddr: Address,
    /// When the packet was parsed ([`clock::now_ns`]): the one clock read of a program run,
    /// for every timestamp and expiry its features check.
    pub now: u64,
    /// The datagram's identification (IPv4's 16 bits or the IPv6 fragment header's 32) as on
    /// the wire; zero for a whole datagram.
    pub fragment_id: u32,
    /// Where the transport header starts (see [`Self::l4_off`]).
    l4_offset: u32,
    /// Network byte order; in a later fragment its first fragment's, zero when that was not
    /// seen.
    pub sport: u16,
    /// Network byte order; as `sport`.
    pub dport: u16,
    pub family: u8,
    pub protocol: u8,
    pub fragment: Fragment,
    /// The TCP flags byte as the packet arrived (zero for other protocols and for a later
    /// fragment, which has no TCP header).
    pub tcp_flags: u8,
}
const _: () = assert!(size_of::<Flow>() == 56);

// SAFETY: addresses, integers, and a `Fragment`, whose zero is `Whole`.
unsafe impl Zeroable for Flow {}

/// What a network header's read tells the transport header's.
struct Network {
    protocol: u8,
    l4_off: usize,
    fragment: Fragment,
    /// As [`Flow::fragment_id`].
    fragment_id: u32,
}

/// What [`Flow::parse_into`] found.
#[derive(Clone, Copy)]
#[repr(u8)]
enum Parsed {
    Flow,
    NotAFlow,
    Truncated,
}

impl Flow {
    /// A whole datagram, a first fragment (with ports) or a later fragment (without) of TCP,
    /// UDP, SCTP or ICMP echo, parsed into the caller's `slot`; `None` for anything else.
    /// Filled in place: a flow returned by value inside a `Result<Option<_>>` is copied out
    /// of it byte by byte. Inlined around [`Self::parse_into`], whose one-byte answer fits
    /// the one register a BPF call returns (a `Result` of two bytes does not).
    #[inline(always)]
    pub fn parse<'slot>(
        ctx: &TcContext,
        slot: &'slot mut MaybeUninit<Self>,
    ) -> Result<Option<&'slot mut Self>, DatapathError> {
        match Self::parse_into(ctx, slot) {
            // SAFETY: `parse_into` zeroed the slot, a valid flow, then filled it.
            Parsed::Flow => Ok(Some(unsafe { slot.assume_init_mut() })),
            Parsed::NotAFlow => Ok(None),
            Parsed::Truncated => Err(DatapathError::Truncated),
        }
    }

    /// [`Self::parse`]'s work, into `slot` zeroed.
    #[inline(never)]
    fn parse_into(ctx: &TcContext, slot: &mut MaybeUninit<Self>) -> Parsed {
        match zeroed(slot).read(ctx) {
            Ok(true) => Parsed::Flow,
            Ok(false) => Parsed::NotAFlow,
            // Parsing only reads: its one error is a packet shorter than its headers.
            Err(_) => Parsed::Truncated,
        }
    }

    /// Reads the packet into `self`; `false` when it is not a flow. The network header of
    /// either family, then one transport header read for both.
    #[inline(always)]
    fn read(&mut self, ctx: &TcContext) -> Result<bool, DatapathError> {
        ensure_linear(ctx, ETH_HLEN);
        let ethertype: u16 = load(ctx, 12)?;
        let network = if ethertype == ETH_P_IP.to_be() {
            self.read_ipv4(ctx)?
        } else if ethertype == ETH_P_IPV6.to_be() {
            self.read_ipv6(ctx)?
        } else {
            None
        };
        let Some(network) = network else {
            return Ok(false);
        };
        ensure_linear(ctx, network.l4_off + L4_PULL);
        let transport = ports(ctx, network.protocol, network.l4_off, network.fragment)?;
        if !transport.translated {
            return Ok(false);
        }
        self.now = clock::now_ns();
        self.l4_offset = network.l4_off as u32;
        self.fragment_id = network.fragment_id;
        self.sport = transport.sport;
        self.dport = transport.dport;
        self.protocol = network.protocol;
        self.fragment = network.fragment;
        self.tcp_flags = transport.tcp_flags;
        if network.fragment != Fragment::Whole {
            self.follow_datagram();
        }
        Ok(true)
    }

    /// A first fragment leaves its ports in `fragments` for the rest of its datagram (an entry
    /// another hook left with the same ports stays, with what the filter marked on it); a
    /// later fragment takes them. Not inlined: fragments are rare, and the hooks' common
    /// path need not carry the key.
    #[inline(never)]
    fn follow_datagram(&mut self) {
        let key = self.fragment_key();
        let now = self.now;
        let known = maps::fragments.get_ptr(&key);
        if self.fragment == Fragment::Later {
            // SAFETY: points into `fragments`, read at once.
            if let Some(first) = known.map(|first| unsafe { *first })
                && first.is_live(now)
            {
                (self.sport, self.dport) = (first.src_port.to_be(), first.dst_port.to_be());
            }
            return;
        }
        let (src_port, dst_port) = (u16::from_be(self.sport), u16::from_be(self.dport));
        // SAFETY: as above.
        if let Some(first) = known.map(|first| unsafe { *first })
            && first.is_live(now)
            && (first.src_port, first.dst_port) == (src_port, dst_port)
        {
            return;
        }
        let first = FirstFragment {
            seen_ns: now,
            src_port,
            dst_port,
            passed: 0,
            _pad: 0,
            _pad2: 0,
        };
        // A full LRU map evicts; a failed insert leaves the later fragments without ports,
        // as when their first was not seen.
        let _ = maps::fragments.insert(&key, &first, u64::from(BPF_ANY));
    }

    /// An IPv4 header: the addresses and family into `self`, what the transport header's read
    /// needs returned; `None` for a header this datapath does not translate past.
    #[inline(always)]
    fn read_ipv4(&mut self, ctx: &TcContext) -> Result<Option<Network>, DatapathError> {
        let header = Header::at(ctx, ETH_HLEN, 20)?;
        let version_ihl: u8 = header.field(0)?;
        let header_len = usize::from(version_ihl & 0x0f) * 4;
        if version_ihl >> 4 != 4 || header_len < 20 {
            return Ok(None);
        }
        // A datagram that claims more than arrived is the stack's to drop, not ours to
        // translate (0: a segmentation offload's, whose length the stack fixes).
        let total = usize::from(u16::from_be(header.field(2)?));
        if total != 0 && (total < header_len || (ctx.len() as usize) < ETH_HLEN + total) {
            return Ok(None);
        }
        let fragment = Fragment::of_ipv4(u16::from_be(header.field(6)?));
        self.family = FAMILY_IPV4;
        self.saddr = Address::ipv4(header.field(12)?);
        self.daddr = Address::ipv4(header.field(16)?);
        Ok(Some(Network {
            protocol: header.field(9)?,
            l4_off: ETH_HLEN + header_len,
            fragment,
            fragment_id: if fragment == Fragment::Whole {
                0
            } else {
                u32::from(header.field::<u16>(4)?)
            },
        }))
    }

    /// An IPv6 header and the extension headers it may pass, as [`Self::read_ipv4`].
    #[inline(always)]
    fn read_ipv6(&mut self, ctx: &TcContext) -> Result<Option<Network>, DatapathError> {
        let header = Header::at(ctx, ETH_HLEN, IPV6_HLEN)?;
        let version: u8 = header.field(0)?;
        if version >> 4 != 6 {
            return Ok(None);
        }
        let payload = usize::from(u16::from_be(header.field(4)?));
        if payload != 0 && (ctx.len() as usize) < ETH_HLEN + IPV6_HLEN + payload {
            return Ok(None);
        }
        self.family = FAMILY_IPV6;
        self.saddr = header.field(8)?;
        self.daddr = header.field(24)?;
        Ok(extension_headers(ctx)?.map(|walked| Network {
            protocol: walked.protocol,
            l4_off: walked.l4_off,
            fragment: walked.fragment,
            fragment_id: walked.fragment_id,
        }))
    }

    /// The `fragments` key of the datagram this packet is a fragment of, under its addresses
    /// as they are now.
    pub fn fragment_key(&self) -> FragmentKey {
        FragmentKey {
            src_addr: self.saddr,
            dst_addr: self.daddr,
            id: self.fragment_id,
            protocol: self.protocol,
            family: self.family,
            _pad: 0,
        }
    }

    /// Offset of the transport header.
    pub(super) fn l4_off(&self) -> usize {
        self.l4_offset as usize
    }

    /// Whether a TCP packet opens a connection (SYN without ACK).
    pub fn is_tcp_syn(&self) -> bool {
        conntrack::is_opening(self.tcp_flags)
    }
}

fn is_translated_protocol(protocol: u8) -> bool {
    matches!(
        protocol,
        PROTO_TCP | PROTO_UDP | PROTO_SCTP | PROTO_ICMP | PROTO_ICMPV6
    )
}

/// What the parser reads of a transport header: its ports (or an ICMP echo's identifier in
/// the place of the side that chose it) in network byte order, and TCP's flags. Zeros in a
/// later fragment, which has no transport header.
struct Transport {
    /// Whether the packet is one the datapath translates at all.
    translated: bool,
    sport: u16,
    dport: u16,
    tcp_flags: u8,
}

/// The transport header at `l4_off`. Inlined: as a BPF call, LLVM packs the return value from
/// a register the verifier sees uninitialised. No `Option` either: LLVM fills the unused bits
/// of a `None` from whatever register is at hand, a packet pointer among them, which the
/// verifier refuses to mask.
#[inline(always)]
fn ports(
    ctx: &TcContext,
    protocol: u8,
    l4_off: usize,
    fragment: Fragment,
) -> Result<Transport, DatapathError> {
    let ported = |sport, dport, tcp_flags| Transport {
        translated: true,
        sport,
        dport,
        tcp_flags,
    };
    if fragment == Fragment::Later {
        return Ok(Transport {
            translated: is_translated_protocol(protocol),
            ..ported(0, 0, 0)
        });
    }
    match protocol {
        // The whole transport header must be there, not only its ports: a cut one is the
        // stack's to drop.
        PROTO_TCP => {
            let header = Header::at(ctx, l4_off, 20)?;
            let (sport, dport) = split_ports(header.field(0)?);
            Ok(ported(sport, dport, header.field(13)?))
        }
        PROTO_UDP | PROTO_SCTP => {
            let length = if protocol == PROTO_UDP { 8 } else { 12 };
            let (sport, dport) = split_ports(Header::at(ctx, l4_off, length)?.field(0)?);
            Ok(ported(sport, dport, 0))
        }
        PROTO_ICMP | PROTO_ICMPV6 => {
            // One check of the whole echo header: LLVM merges separate bounds checks into
            // one the verifier cannot follow.
            let header = Header::at(ctx, l4_off, 8)?;
            let icmp_type: u8 = header.field(0)?;
            let identifier: u16 = header.field(4)?;
            Ok(if is_echo_request(protocol, icmp_type) {
                ported(identifier, 0, 0)
            } else if is_echo_reply(protocol, icmp_type) {
                ported(0, identifier, 0)
            } else {
                Transport {
                    translated: false,
                    ..ported(0, 0, 0)
                }
            })
        }
        _ => Ok(Transport {
            translated: false,
            ..ported(0, 0, 0)
        }),
    }
}

/// The two ports at the start of a transport header, read as one word: source, destination,
/// each in network byte order.
#[inline(always)]
fn split_ports(word: u32) -> (u16, u16) {
    let [a, b, c, d] = word.to_ne_bytes();
    (u16::from_ne_bytes([a, b]), u16::from_ne_bytes([c, d]))
}

/// A packet's source address, read from its linear headers.
pub enum SourceAddress {
    V4([u8; 4]),
    V6(Address),
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
