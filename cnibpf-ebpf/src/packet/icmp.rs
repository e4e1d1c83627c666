//! ICMP errors and the packet they quote, read with `bpf_skb_load_bytes` (the quote need not be
//! in the linear area). Features translate them (`masquerade`) or judge them by the connection
//! they quote (`filter`).

use aya_ebpf::{btf_maps::PerCpuArray, macros::btf_map, programs::TcContext};
use cnibpf_common::{
    FAMILY_IPV4, FAMILY_IPV6, PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP,
    packet::{Fragment, is_echo_request, is_icmp_error},
};

use super::{DatapathError, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, IPV6_HLEN, load_anywhere, widen};

const ICMP_HLEN: usize = 8;

/// An ICMP error quoting a TCP, UDP or ICMP echo packet, read with `bpf_skb_load_bytes`
/// (the quoted packet need not be in the linear area). Kept in [`icmp_error_scratch`]:
/// on the stack it would push the call chain past 512 bytes.
pub struct IcmpError {
    pub family: u8,
    /// Offset of the ICMP header.
    pub icmp_off: usize,
    /// Offset of the quoted IP header.
    pub inner_off: usize,
    /// Offset of the quoted L4 header.
    pub inner_l4_off: usize,
    pub inner_protocol: u8,
    /// The error's own destination.
    pub daddr: [u8; 16],
    pub inner_saddr: [u8; 16],
    pub inner_daddr: [u8; 16],
    /// Network byte order; an echo's identifier as its source port.
    pub inner_sport: u16,
    pub inner_dport: u16,
}

/// Scratch space of an [`IcmpError`] read; private to each loaded object, not pinned.
#[expect(
    non_upper_case_globals,
    reason = "the static's name is the map's name, like the pinned ones"
)]
#[btf_map]
pub static icmp_error_scratch: PerCpuArray<IcmpError, 1> = PerCpuArray::new();

impl IcmpError {
    /// Reads the packet into `self`; `false` when it is not such an error.
    #[inline(never)]
    pub fn parse(&mut self, ctx: &TcContext) -> Result<bool, DatapathError> {
        let ethertype: u16 = load_anywhere(ctx, 12)?;
        let (family, icmp_off, protocol, daddr) = if ethertype == ETH_P_IP.to_be() {
            let version_ihl: u8 = load_anywhere(ctx, ETH_HLEN)?;
            let fragment: u16 = load_anywhere(ctx, ETH_HLEN + 6)?;
            if version_ihl >> 4 != 4 || Fragment::of_ipv4(u16::from_be(fragment)) != Fragment::Whole
            {
                return Ok(false);
            }
            let daddr: [u8; 4] = load_anywhere(ctx, ETH_HLEN + 16)?;
            (
                FAMILY_IPV4,
                ETH_HLEN + usize::from(version_ihl & 0x0f) * 4,
                load_anywhere::<u8>(ctx, ETH_HLEN + 9)?,
                widen(daddr),
            )
        } else if ethertype == ETH_P_IPV6.to_be() {
            (
                FAMILY_IPV6,
                ETH_HLEN + IPV6_HLEN,
                load_anywhere::<u8>(ctx, ETH_HLEN + 6)?,
                load_anywhere::<[u8; 16]>(ctx, ETH_HLEN + 24)?,
            )
        } else {
            return Ok(false);
        };
        let icmp_type: u8 = load_anywhere(ctx, icmp_off)?;
        if !is_icmp_error(protocol, icmp_type) {
            return Ok(false);
        }
        let inner_off = icmp_off + ICMP_HLEN;
        let (inner_protocol, inner_l4_off, inner_saddr, inner_daddr) = if family == FAMILY_IPV4 {
            let version_ihl: u8 = load_anywhere(ctx, inner_off)?;
            let saddr: [u8; 4] = load_anywhere(ctx, inner_off + 12)?;
            let daddr: [u8; 4] = load_anywhere(ctx, inner_off + 16)?;
            (
                load_anywhere::<u8>(ctx, inner_off + 9)?,
                inner_off + usize::from(version_ihl & 0x0f) * 4,
                widen(saddr),
                widen(daddr),
            )
        } else {
            (
                load_anywhere::<u8>(ctx, inner_off + 6)?,
                inner_off + IPV6_HLEN,
                load_anywhere::<[u8; 16]>(ctx, inner_off + 8)?,
                load_anywhere::<[u8; 16]>(ctx, inner_off + 24)?,
            )
        };
        let (inner_sport, inner_dport) = match inner_protocol {
            PROTO_TCP | PROTO_UDP => (
                load_anywhere::<u16>(ctx, inner_l4_off)?,
                load_anywhere::<u16>(ctx, inner_l4_off + 2)?,
            ),
            // Only a quoted echo request: its identifier is what was translated.
            PROTO_ICMP | PROTO_ICMPV6 => {
                let quoted_type: u8 = load_anywhere(ctx, inner_l4_off)?;
                if !is_echo_request(inner_protocol, quoted_type) {
                    return Ok(false);
                }
                (load_anywhere::<u16>(ctx, inner_l4_off + 4)?, 0)
            }
            _ => return Ok(false),
        };
        *self = Self {
            family,
            icmp_off,
            inner_off,
            inner_l4_off,
            inner_protocol,
            daddr,
            inner_saddr,
            inner_daddr,
            inner_sport,
            inner_dport,
        };
        Ok(true)
    }

    /// Offset of the quoted L4 checksum, and whether it covers the quoted addresses.
    pub fn inner_csum(&self) -> (usize, bool) {
        match self.inner_protocol {
            PROTO_TCP => (self.inner_l4_off + 16, true),
            PROTO_UDP => (self.inner_l4_off + 6, true),
            PROTO_ICMPV6 => (self.inner_l4_off + 2, true),
            _ => (self.inner_l4_off + 2, false),
        }
    }
}
