//! ICMP errors and the packet they quote. Features translate them (`masquerade`) or judge them
//! by the connection they quote (`filter`).

use aya_ebpf::{btf_maps::PerCpuArray, macros::btf_map, programs::TcContext};
use cnibpf_common::{
    FAMILY_IPV4, FAMILY_IPV6, PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP,
    address::Address,
    packet::{Fragment, is_echo_request, is_icmp_error},
};

use super::{
    DatapathError, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, Header, IPV6_HLEN, ensure_linear, load,
};

const ICMP_HLEN: usize = 8;
const IPV4_MIN_HLEN: usize = 20;
/// What an error's parse reads at most: its IP header with options, its ICMP header, the
/// quoted IP header with options, and the first bytes of the quoted transport header.
const ICMP_ERROR_PULL: usize = ETH_HLEN + 60 + ICMP_HLEN + 60 + 8;

/// An ICMP error quoting a TCP, UDP or ICMP echo packet. Kept in [`icmp_error_scratch`]:
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
    /// The error's own source and destination.
    pub saddr: Address,
    pub daddr: Address,
    pub inner_saddr: Address,
    pub inner_daddr: Address,
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
    /// Reads the packet into `self`; `false` when it is not such an error (what it read so
    /// far is then meaningless). The error's headers and its quote's are pulled into the
    /// linear area first (a short packet whole) and read there a word at a time; the offsets
    /// stay in registers, where the verifier knows their bounds, and are kept last.
    #[inline(never)]
    pub fn parse(&mut self, ctx: &TcContext) -> Result<bool, DatapathError> {
        ensure_linear(ctx, (ctx.len() as usize).min(ICMP_ERROR_PULL));
        let ethertype: u16 = load(ctx, 12)?;
        let (protocol, icmp_off) = if ethertype == ETH_P_IP.to_be() {
            let ip = Header::at(ctx, ETH_HLEN, IPV4_MIN_HLEN)?;
            let version_ihl: u8 = ip.field(0)?;
            let fragment: u16 = ip.field(6)?;
            if version_ihl >> 4 != 4 || Fragment::of_ipv4(u16::from_be(fragment)) != Fragment::Whole
            {
                return Ok(false);
            }
            self.family = FAMILY_IPV4;
            self.saddr = Address::ipv4(ip.field(12)?);
            self.daddr = Address::ipv4(ip.field(16)?);
            (
                ip.field::<u8>(9)?,
                ETH_HLEN + usize::from(version_ihl & 0x0f) * 4,
            )
        } else if ethertype == ETH_P_IPV6.to_be() {
            let ip = Header::at(ctx, ETH_HLEN, IPV6_HLEN)?;
            self.family = FAMILY_IPV6;
            self.saddr = ip.field(8)?;
            self.daddr = ip.field(24)?;
            (ip.field::<u8>(6)?, ETH_HLEN + IPV6_HLEN)
        } else {
            return Ok(false);
        };
        // The whole ICMP header: a one-byte read at a variable offset gets a bounds check
        // that LLVM words in a way the verifier takes as one byte short.
        if !is_icmp_error(protocol, Header::at(ctx, icmp_off, ICMP_HLEN)?.field(0)?) {
            return Ok(false);
        }
        let inner_off = icmp_off + ICMP_HLEN;
        let inner_l4_off = if self.family == FAMILY_IPV4 {
            let ip = Header::at(ctx, inner_off, IPV4_MIN_HLEN)?;
            let version_ihl: u8 = ip.field(0)?;
            self.inner_protocol = ip.field(9)?;
            self.inner_saddr = Address::ipv4(ip.field(12)?);
            self.inner_daddr = Address::ipv4(ip.field(16)?);
            inner_off + usize::from(version_ihl & 0x0f) * 4
        } else {
            let ip = Header::at(ctx, inner_off, IPV6_HLEN)?;
            self.inner_protocol = ip.field(6)?;
            self.inner_saddr = ip.field(8)?;
            self.inner_daddr = ip.field(24)?;
            inner_off + IPV6_HLEN
        };
        (self.inner_sport, self.inner_dport) = match self.inner_protocol {
            PROTO_TCP | PROTO_UDP => {
                let ports = Header::at(ctx, inner_l4_off, 4)?;
                (ports.field(0)?, ports.field(2)?)
            }
            // Only a quoted echo request: its identifier is what was translated.
            PROTO_ICMP | PROTO_ICMPV6 => {
                let echo = Header::at(ctx, inner_l4_off, 6)?;
                if !is_echo_request(self.inner_protocol, echo.field(0)?) {
                    return Ok(false);
                }
                (echo.field(4)?, 0)
            }
            _ => return Ok(false),
        };
        (self.icmp_off, self.inner_off, self.inner_l4_off) = (icmp_off, inner_off, inner_l4_off);
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
