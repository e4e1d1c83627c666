//! ICMP errors about masqueraded packets (read by `packet::icmp`): translating the error and
//! the packet it quotes back to the container's side with every checksum they touch.

use aya_ebpf::{helpers::bpf_csum_diff, programs::TcContext};
use cnibpf_common::{FAMILY_IPV4, PROTO_ICMP, PROTO_ICMPV6, PROTO_UDP, internet_checksum};

use crate::packet::{DatapathError, ETH_HLEN, csum_diff, icmp::IcmpError, load_anywhere};

impl IcmpError {
    /// Rewrites the quoted source to `addr`:`port` and the error's destination to `addr`, and
    /// every checksum these touch: the quoted IP and L4 headers', and the error's own (which
    /// covers the whole quote, and for ICMPv6 the destination too).
    #[inline(never)]
    pub fn translate(
        &self,
        ctx: &TcContext,
        addr: &[u8; 16],
        port: u16,
    ) -> Result<(), DatapathError> {
        let failed = |_| DatapathError::RewriteFailed;
        let outer_csum = self.icmp_off + 2;
        let (inner_csum, inner_covers_addresses) = self.inner_csum();
        // A quoted L4 checksum cut off by the quote, or a UDP datagram without one, stays.
        let inner_csum_present = u32::try_from(inner_csum + 2).is_ok_and(|end| end <= ctx.len())
            && (self.inner_protocol != PROTO_UDP
                || self.family != FAMILY_IPV4
                || load_anywhere::<u16>(ctx, inner_csum)? != 0);
        let address_diff = csum_diff(&self.inner_saddr, addr)?;
        let port_diff = csum_diff_u16(self.inner_sport, port)?;
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
        let port_off = if matches!(self.inner_protocol, PROTO_ICMP | PROTO_ICMPV6) {
            self.inner_l4_off + 4
        } else {
            self.inner_l4_off
        };
        ctx.store(port_off, &port, 0).map_err(failed)?;
        ctx.l4_csum_replace(outer_csum, u64::from(self.inner_sport), u64::from(port), 2)
            .map_err(failed)?;
        if self.family == FAMILY_IPV4 {
            let old_addr = u32::from_ne_bytes([
                self.inner_saddr[0],
                self.inner_saddr[1],
                self.inner_saddr[2],
                self.inner_saddr[3],
            ]);
            let new_addr = u32::from_ne_bytes([addr[0], addr[1], addr[2], addr[3]]);
            let inner_ip_csum = self.inner_off + 10;
            let old: u16 = load_anywhere(ctx, inner_ip_csum)?;
            ctx.l3_csum_replace(inner_ip_csum, u64::from(old_addr), u64::from(new_addr), 4)
                .map_err(failed)?;
            let new: u16 = load_anywhere(ctx, inner_ip_csum)?;
            ctx.store(self.inner_off + 12, &new_addr, 0)
                .map_err(failed)?;
            // The quoted header still sums to the same, but its bytes changed.
            ctx.l4_csum_replace(outer_csum, u64::from(old_addr), u64::from(new_addr), 4)
                .map_err(failed)?;
            ctx.l4_csum_replace(outer_csum, u64::from(old), u64::from(new), 2)
                .map_err(failed)?;
            // The error's own destination; ICMPv4's checksum does not cover it.
            let old_daddr =
                u32::from_ne_bytes([self.daddr[0], self.daddr[1], self.daddr[2], self.daddr[3]]);
            ctx.l3_csum_replace(ETH_HLEN + 10, u64::from(old_daddr), u64::from(new_addr), 4)
                .map_err(failed)?;
            ctx.store(ETH_HLEN + 16, &new_addr, 0).map_err(failed)?;
        } else {
            ctx.store(self.inner_off + 8, addr, 0).map_err(failed)?;
            ctx.l4_csum_replace(
                outer_csum,
                0,
                u64::from(internet_checksum::fold(address_diff)),
                0,
            )
            .map_err(failed)?;
            let daddr_diff = csum_diff(&self.daddr, addr)?;
            ctx.l4_csum_replace(
                outer_csum,
                0,
                u64::from(internet_checksum::fold(daddr_diff)),
                u64::from(aya_ebpf::bindings::BPF_F_PSEUDO_HDR),
            )
            .map_err(failed)?;
            ctx.store(ETH_HLEN + 24, addr, 0).map_err(failed)?;
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
