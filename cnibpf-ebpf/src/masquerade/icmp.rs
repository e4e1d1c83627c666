//! ICMP errors about translated connections (read by `packet::icmp`): an error about a packet
//! a container sent, translated back to the container's side, and an error a container sends
//! about a packet it received, translated to the side its peer knows — each with every
//! checksum it touches.

use aya_ebpf::{helpers::bpf_csum_diff, programs::TcContext};
use cnibpf_common::{
    FAMILY_IPV4, PROTO_ICMP, PROTO_ICMPV6, PROTO_UDP, address::Address, internet_checksum,
};

use crate::packet::{DatapathError, ETH_HLEN, csum_diff, icmp::IcmpError, load_anywhere};

/// Which side of the quoted packet a translation rewrites, and with it which address of the
/// error itself.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Quoted {
    /// Its source, and the error's destination: an error about a packet the container sent,
    /// on its way back to the container.
    Source,
    /// Its destination, and the error's source: an error the container sends about a packet
    /// it received, on its way to that packet's sender.
    Destination,
}

impl IcmpError {
    /// Rewrites the `side` address and port of the quoted packet to `addr`:`port` and the
    /// error's own address on that side (its destination for a quoted source, its source for a
    /// quoted destination) to `addr`, and every checksum these touch: the quoted IP and L4
    /// headers', and the error's own (which covers the whole quote, and for ICMPv6 both
    /// addresses too).
    #[inline(never)]
    pub fn translate(
        &self,
        ctx: &TcContext,
        side: Quoted,
        addr: &Address,
        port: u16,
    ) -> Result<(), DatapathError> {
        let failed = |_| DatapathError::RewriteFailed;
        let source = side == Quoted::Source;
        // Borrowed, not copied: the error lives in its scratch map, and the stack of the call
        // chains under uplink_ingress is at the verifier's cap.
        let (inner_addr, inner_port, outer_addr) = if source {
            (&self.inner_saddr, self.inner_sport, &self.daddr)
        } else {
            (&self.inner_daddr, self.inner_dport, &self.saddr)
        };
        // Offsets of the quoted address and of the error's own, by family and side.
        let (inner_addr_off, outer_addr_off) = match (self.family == FAMILY_IPV4, source) {
            (true, true) => (self.inner_off + 12, ETH_HLEN + 16),
            (true, false) => (self.inner_off + 16, ETH_HLEN + 12),
            (false, true) => (self.inner_off + 8, ETH_HLEN + 24),
            (false, false) => (self.inner_off + 24, ETH_HLEN + 8),
        };
        let outer_csum = self.icmp_off + 2;
        let (inner_csum, inner_covers_addresses) = self.inner_csum();
        // A quoted L4 checksum cut off by the quote, or a UDP datagram without one, stays.
        let inner_csum_present = u32::try_from(inner_csum + 2).is_ok_and(|end| end <= ctx.len())
            && (self.inner_protocol != PROTO_UDP
                || self.family != FAMILY_IPV4
                || load_anywhere::<u16>(ctx, inner_csum)? != 0);
        let address_diff = csum_diff(inner_addr, addr)?;
        let port_diff = csum_diff_u16(inner_port, port)?;
        if inner_csum_present {
            let old: u16 = load_anywhere(ctx, inner_csum)?;
            let diff = if inner_covers_addresses {
                internet_checksum::add(address_diff, port_diff)
            } else {
                port_diff
            };
            ctx.l4_csum_replace(inner_csum, 0, u64::from(internet_checksum::fold(diff)), 0)
                .map_err(failed)?;
            let new: u16 = load_anywhere(ctx, inner_csum)?;
            ctx.l4_csum_replace(outer_csum, u64::from(old), u64::from(new), 2)
                .map_err(failed)?;
        }
        // A quoted echo's identifier is where its translation is; a transport header's ports
        // are source then destination.
        let port_off = if matches!(self.inner_protocol, PROTO_ICMP | PROTO_ICMPV6) {
            self.inner_l4_off + 4
        } else if source {
            self.inner_l4_off
        } else {
            self.inner_l4_off + 2
        };
        ctx.store(port_off, &port, 0).map_err(failed)?;
        ctx.l4_csum_replace(outer_csum, u64::from(inner_port), u64::from(port), 2)
            .map_err(failed)?;
        if self.family == FAMILY_IPV4 {
            let old_addr = inner_addr.words()[0];
            let new_addr = addr.words()[0];
            let inner_ip_csum = self.inner_off + 10;
            let old: u16 = load_anywhere(ctx, inner_ip_csum)?;
            ctx.l3_csum_replace(inner_ip_csum, u64::from(old_addr), u64::from(new_addr), 4)
                .map_err(failed)?;
            let new: u16 = load_anywhere(ctx, inner_ip_csum)?;
            ctx.store(inner_addr_off, &new_addr, 0).map_err(failed)?;
            // The quoted header still sums to the same, but its bytes changed.
            ctx.l4_csum_replace(outer_csum, u64::from(old_addr), u64::from(new_addr), 4)
                .map_err(failed)?;
            ctx.l4_csum_replace(outer_csum, u64::from(old), u64::from(new), 2)
                .map_err(failed)?;
            // The error's own address; ICMPv4's checksum does not cover it.
            let old_outer = outer_addr.words()[0];
            ctx.l3_csum_replace(ETH_HLEN + 10, u64::from(old_outer), u64::from(new_addr), 4)
                .map_err(failed)?;
            ctx.store(outer_addr_off, &new_addr, 0).map_err(failed)?;
        } else {
            ctx.store(inner_addr_off, addr, 0).map_err(failed)?;
            ctx.l4_csum_replace(
                outer_csum,
                0,
                u64::from(internet_checksum::fold(address_diff)),
                0,
            )
            .map_err(failed)?;
            let outer_diff = csum_diff(outer_addr, addr)?;
            ctx.l4_csum_replace(
                outer_csum,
                0,
                u64::from(internet_checksum::fold(outer_diff)),
                u64::from(aya_ebpf::bindings::BPF_F_PSEUDO_HDR),
            )
            .map_err(failed)?;
            ctx.store(outer_addr_off, addr, 0).map_err(failed)?;
        }
        Ok(())
    }
}

fn csum_diff_u16(old: u16, new: u16) -> Result<u32, DatapathError> {
    // bpf_csum_diff works on 4-byte multiples: pad both with the same zero half.
    let mut from = u32::from(old).to_ne_bytes();
    let mut to = u32::from(new).to_ne_bytes();
    // SAFETY: both buffers are 4 bytes on this program's stack.
    let diff = unsafe { bpf_csum_diff(from.as_mut_ptr().cast(), 4, to.as_mut_ptr().cast(), 4, 0) };
    u32::try_from(diff).map_err(|_| DatapathError::RewriteFailed)
}
