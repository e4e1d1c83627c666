//! ICMP errors and the packet they quote, read with `bpf_skb_load_bytes` (the quote need not be
//! in the linear area). Features translate them (`masquerade`) or judge them by the connection
//! they quote (`filter`).

use aya_ebpf::{
    EbpfContext as _, btf_maps::PerCpuArray, helpers::bpf_skb_load_bytes, macros::btf_map,
    programs::TcContext,
};
use cnibpf_common::{
    FAMILY_IPV4, FAMILY_IPV6, PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP,
    address::Address,
    packet::{Fragment, is_echo_request, is_icmp_error},
};

use super::{DatapathError, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, IPV6_HLEN, load_anywhere};

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
    /// far is then meaningless). Field by field into the scratch, addresses straight from the
    /// packet: a whole `Self` or address copies on the stack would push the call chains that
    /// reach it past the verifier's 512 bytes.
    #[inline(never)]
    pub fn parse(&mut self, ctx: &TcContext) -> Result<bool, DatapathError> {
        let ethertype: u16 = load_anywhere(ctx, 12)?;
        let protocol = if ethertype == ETH_P_IP.to_be() {
            let version_ihl: u8 = load_anywhere(ctx, ETH_HLEN)?;
            let fragment: u16 = load_anywhere(ctx, ETH_HLEN + 6)?;
            if version_ihl >> 4 != 4 || Fragment::of_ipv4(u16::from_be(fragment)) != Fragment::Whole
            {
                return Ok(false);
            }
            self.family = FAMILY_IPV4;
            self.icmp_off = ETH_HLEN + usize::from(version_ihl & 0x0f) * 4;
            read_address(ctx, ETH_HLEN + 12, FAMILY_IPV4, &mut self.saddr)?;
            read_address(ctx, ETH_HLEN + 16, FAMILY_IPV4, &mut self.daddr)?;
            load_anywhere::<u8>(ctx, ETH_HLEN + 9)?
        } else if ethertype == ETH_P_IPV6.to_be() {
            self.family = FAMILY_IPV6;
            self.icmp_off = ETH_HLEN + IPV6_HLEN;
            read_address(ctx, ETH_HLEN + 8, FAMILY_IPV6, &mut self.saddr)?;
            read_address(ctx, ETH_HLEN + 24, FAMILY_IPV6, &mut self.daddr)?;
            load_anywhere::<u8>(ctx, ETH_HLEN + 6)?
        } else {
            return Ok(false);
        };
        let icmp_type: u8 = load_anywhere(ctx, self.icmp_off)?;
        if !is_icmp_error(protocol, icmp_type) {
            return Ok(false);
        }
        self.inner_off = self.icmp_off + ICMP_HLEN;
        let inner_off = self.inner_off;
        if self.family == FAMILY_IPV4 {
            let version_ihl: u8 = load_anywhere(ctx, inner_off)?;
            self.inner_protocol = load_anywhere::<u8>(ctx, inner_off + 9)?;
            self.inner_l4_off = inner_off + usize::from(version_ihl & 0x0f) * 4;
            read_address(ctx, inner_off + 12, FAMILY_IPV4, &mut self.inner_saddr)?;
            read_address(ctx, inner_off + 16, FAMILY_IPV4, &mut self.inner_daddr)?;
        } else {
            self.inner_protocol = load_anywhere::<u8>(ctx, inner_off + 6)?;
            self.inner_l4_off = inner_off + IPV6_HLEN;
            read_address(ctx, inner_off + 8, FAMILY_IPV6, &mut self.inner_saddr)?;
            read_address(ctx, inner_off + 24, FAMILY_IPV6, &mut self.inner_daddr)?;
        }
        let inner_l4_off = self.inner_l4_off;
        (self.inner_sport, self.inner_dport) = match self.inner_protocol {
            PROTO_TCP | PROTO_UDP => (
                load_anywhere::<u16>(ctx, inner_l4_off)?,
                load_anywhere::<u16>(ctx, inner_l4_off + 2)?,
            ),
            // Only a quoted echo request: its identifier is what was translated.
            PROTO_ICMP | PROTO_ICMPV6 => {
                let quoted_type: u8 = load_anywhere(ctx, inner_l4_off)?;
                if !is_echo_request(self.inner_protocol, quoted_type) {
                    return Ok(false);
                }
                (load_anywhere::<u16>(ctx, inner_l4_off + 4)?, 0)
            }
            _ => return Ok(false),
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

/// Reads the address of `family` at `offset` into `address`, in the 16-byte map form (an IPv4
/// address in its first four bytes, the rest zero): straight from the packet into the
/// scratch, with a length the verifier sees as never zero.
#[inline(always)]
fn read_address(
    ctx: &TcContext,
    offset: usize,
    family: u8,
    address: &mut Address,
) -> Result<(), DatapathError> {
    *address = Address::UNSPECIFIED;
    let length: u32 = if family == FAMILY_IPV4 { 4 } else { 16 };
    // SAFETY: `address` is 16 bytes of map value, at least `length`; the helper checks the
    // packet's bounds itself.
    let read = unsafe {
        bpf_skb_load_bytes(
            ctx.as_ptr().cast(),
            offset as u32,
            address.bytes.as_mut_ptr().cast(),
            length,
        )
    };
    if read == 0 {
        Ok(())
    } else {
        Err(DatapathError::Truncated)
    }
}
