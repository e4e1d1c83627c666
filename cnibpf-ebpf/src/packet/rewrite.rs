//! Rewriting a parsed packet's addresses, ports and TTL, with every checksum they touch.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    cty::c_void,
    helpers::{bpf_csum_diff, bpf_loop},
    programs::TcContext,
};
use cnibpf_common::{
    FAMILY_IPV4, PROTO_ICMP, PROTO_ICMPV6, PROTO_SCTP, PROTO_TCP, PROTO_UDP,
    address::Address,
    internet_checksum,
    sctp_checksum::{self, Product},
};

use super::{
    DatapathError, ETH_HLEN, Flow, Fragment, IPV4_CSUM_OFF, IPV6_DADDR_OFF, IPV6_HLEN,
    IPV6_SADDR_OFF, load, load_anywhere,
};

/// Where SCTP's common header keeps its checksum.
const SCTP_CHECKSUM_OFF: usize = 8;

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

/// The ones'-complement difference between two 16-byte addresses (IPv4: the first four).
pub fn csum_diff(old: &Address, new: &Address) -> Result<u32, DatapathError> {
    let mut from = old.words();
    let mut to = new.words();
    // SAFETY: both buffers are 16 bytes on this program's stack.
    let diff =
        unsafe { bpf_csum_diff(from.as_mut_ptr().cast(), 16, to.as_mut_ptr().cast(), 16, 0) };
    u32::try_from(diff).map_err(|_| DatapathError::RewriteFailed)
}

impl Flow {
    /// Offset of the L4 checksum where it covers the addresses (the pseudo-header): not
    /// SCTP's CRC32c, not ICMPv4's.
    fn address_csum_off(&self) -> Option<usize> {
        if self.fragment == Fragment::Later {
            return None;
        }
        match self.protocol {
            PROTO_TCP => Some(self.l4_off() + 16),
            PROTO_UDP => Some(self.l4_off() + 6),
            PROTO_ICMPV6 => Some(self.l4_off() + 2),
            _ => None,
        }
    }

    /// Offset of the L4 checksum that covers the ports (or the echo identifier).
    fn port_csum_off(&self) -> Option<usize> {
        if self.fragment == Fragment::Later {
            return None;
        }
        match self.protocol {
            PROTO_TCP => Some(self.l4_off() + 16),
            PROTO_UDP => Some(self.l4_off() + 6),
            PROTO_ICMP | PROTO_ICMPV6 => Some(self.l4_off() + 2),
            _ => None,
        }
    }

    fn port_off(&self, side: Side) -> usize {
        match (self.protocol, side) {
            (PROTO_ICMP | PROTO_ICMPV6, _) => self.l4_off() + 4,
            (_, Side::Source) => self.l4_off(),
            (_, Side::Destination) => self.l4_off() + 2,
        }
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
        addr: &Address,
        port: u16,
    ) -> Result<bool, DatapathError> {
        if self.family != FAMILY_IPV4 {
            if !decrement_ipv6_hop_limit(ctx)? {
                return Ok(false);
            }
            self.rewrite(ctx, Side::Source, addr, port)?;
            return Ok(true);
        }
        if !self.rewrite_forwarded_ipv4_header(ctx, addr)? {
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
        addr: &Address,
    ) -> Result<bool, DatapathError> {
        // TTL, protocol, header checksum, source address.
        let mut header: [u8; 8] = load(ctx, ETH_HLEN + 8)?;
        if header[0] <= 1 {
            return Ok(false);
        }
        let old_word = u16::from_ne_bytes([header[0], header[1]]);
        header[0] -= 1;
        let new_word = u16::from_ne_bytes([header[0], header[1]]);
        let old4 = self.saddr.ipv4_octets();
        let new4 = addr.ipv4_octets();
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

    /// Rewrites the source address and port (network byte order), fixing checksums.
    #[inline(always)]
    pub fn rewrite_source(
        &mut self,
        ctx: &TcContext,
        addr: &Address,
        port: u16,
    ) -> Result<(), DatapathError> {
        self.rewrite(ctx, Side::Source, addr, port)
    }

    /// Rewrites the destination address and port (network byte order), fixing checksums.
    #[inline(always)]
    pub fn rewrite_destination(
        &mut self,
        ctx: &TcContext,
        addr: &Address,
        port: u16,
    ) -> Result<(), DatapathError> {
        self.rewrite(ctx, Side::Destination, addr, port)
    }

    /// Rewrites one side's address and port, fixing checksums: one body for both sides. Not
    /// inlined (nor is `route`): it needs scratch space, and the verifier caps the stack of a
    /// whole call chain at 512 bytes.
    #[inline(never)]
    fn rewrite(
        &mut self,
        ctx: &TcContext,
        side: Side,
        addr: &Address,
        port: u16,
    ) -> Result<(), DatapathError> {
        self.rewrite_address(ctx, side, addr)?;
        self.rewrite_port(ctx, side, port)?;
        match side {
            Side::Source => (self.saddr, self.sport) = (*addr, port),
            Side::Destination => (self.daddr, self.dport) = (*addr, port),
        }
        Ok(())
    }

    // BPF calls take at most five arguments: these helpers are inlined, and take few.
    #[inline(always)]
    fn rewrite_address(
        &self,
        ctx: &TcContext,
        side: Side,
        new: &Address,
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
            let old4 = old.ipv4_octets();
            let new4 = new.ipv4_octets();
            self.update_pseudo_header_v4(ctx, old4, new4)?;
            // The header checksum and both addresses lie side by side: one write, the checksum
            // computed here, instead of a checksum helper call and a store.
            let [high, low] = load::<[u8; 2]>(ctx, IPV4_CSUM_OFF)?;
            let checksum = internet_checksum::replace4(u16::from_ne_bytes([high, low]), old4, new4);
            let (source, destination) = match side {
                Side::Source => (new4, self.daddr.ipv4_octets()),
                Side::Destination => (self.saddr.ipv4_octets(), new4),
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
        // A later fragment carries no transport header: its ports are its first fragment's.
        if old == new || self.fragment == Fragment::Later {
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
        let ports: [u8; 4] = load_anywhere(ctx, self.l4_off())?;
        let mut changed = ports;
        let [high, low] = new.to_ne_bytes();
        match side {
            Side::Source => (changed[0], changed[1]) = (high, low),
            Side::Destination => (changed[2], changed[3]) = (high, low),
        }
        let (low, high) = sctp_checksum::length_factors(self.l4_length(ctx)?);
        let factor = product(low, high);
        let change = product(factor, sctp_checksum::difference(ports, changed));
        let checksum: u32 = load_anywhere(ctx, self.l4_off() + SCTP_CHECKSUM_OFF)?;
        let updated = u32::from_le(checksum) ^ change;
        ctx.store(self.l4_off() + SCTP_CHECKSUM_OFF, &updated.to_le(), 0)
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
        let header = (self.l4_off() - counted_from) as u32;
        Ok(if length == 0 {
            ctx.len().saturating_sub(self.l4_off() as u32)
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
