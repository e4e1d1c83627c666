//! Packet parsing and rewriting shared by the programs. Offsets are from the start of the
//! Ethernet header, as TC programs see the packet; multi-byte fields are kept in network byte
//! order exactly as loaded.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, TC_ACT_OK, TC_ACT_SHOT},
    programs::TcContext,
};
use cnibpf_common::{PROTO_TCP, PROTO_UDP};

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const IPV4_CSUM_OFF: usize = ETH_HLEN + 10;
const IPV4_SADDR_OFF: usize = ETH_HLEN + 12;
const IPV4_DADDR_OFF: usize = ETH_HLEN + 16;
/// More-fragments flag and fragment offset: any bit set means this is a fragment.
const IPV4_FRAGMENT_MASK: u16 = 0x3fff;

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
    pub fn verdict(self) -> i32 {
        match self {
            Self::Truncated => TC_ACT_OK,
            Self::RewriteFailed => TC_ACT_SHOT,
        }
    }
}

/// An IPv4 TCP or UDP packet, addresses and ports as on the wire.
#[derive(Clone, Copy)]
pub struct Ipv4Flow {
    pub protocol: u8,
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
    /// Total length from the IPv4 header, host byte order.
    pub total_len: u16,
    l4_off: usize,
}

impl Ipv4Flow {
    /// Parses an unfragmented IPv4 TCP or UDP packet; `None` for anything else.
    pub fn parse(ctx: &TcContext) -> Result<Option<Self>, DatapathError> {
        let ethertype: u16 = ctx.load(12).map_err(|_| DatapathError::Truncated)?;
        if ethertype != ETH_P_IP.to_be() {
            return Ok(None);
        }
        let version_ihl: u8 = ctx.load(ETH_HLEN).map_err(|_| DatapathError::Truncated)?;
        let header_len = usize::from(version_ihl & 0x0f) * 4;
        if version_ihl >> 4 != 4 || header_len < 20 {
            return Ok(None);
        }
        let fragment: u16 = ctx
            .load(ETH_HLEN + 6)
            .map_err(|_| DatapathError::Truncated)?;
        if u16::from_be(fragment) & IPV4_FRAGMENT_MASK != 0 {
            return Ok(None);
        }
        let protocol: u8 = ctx
            .load(ETH_HLEN + 9)
            .map_err(|_| DatapathError::Truncated)?;
        if protocol != PROTO_TCP && protocol != PROTO_UDP {
            return Ok(None);
        }
        let total_len: u16 = ctx
            .load(ETH_HLEN + 2)
            .map_err(|_| DatapathError::Truncated)?;
        let l4_off = ETH_HLEN + header_len;
        Ok(Some(Self {
            protocol,
            saddr: ctx
                .load(IPV4_SADDR_OFF)
                .map_err(|_| DatapathError::Truncated)?,
            daddr: ctx
                .load(IPV4_DADDR_OFF)
                .map_err(|_| DatapathError::Truncated)?,
            sport: ctx.load(l4_off).map_err(|_| DatapathError::Truncated)?,
            dport: ctx.load(l4_off + 2).map_err(|_| DatapathError::Truncated)?,
            total_len: u16::from_be(total_len),
            l4_off,
        }))
    }

    fn l4_csum_off(&self) -> usize {
        if self.protocol == PROTO_TCP {
            self.l4_off + 16
        } else {
            self.l4_off + 6
        }
    }

    /// `bpf_l4_csum_replace` flags: UDP may carry no checksum at all, which must stay zero.
    fn l4_csum_flags(&self) -> u64 {
        if self.protocol == PROTO_UDP {
            u64::from(BPF_F_MARK_MANGLED_0)
        } else {
            0
        }
    }

    /// Rewrites the destination address and port, fixing the IPv4 and L4 checksums.
    pub fn rewrite_destination(
        &self,
        ctx: &TcContext,
        addr: u32,
        port: u16,
    ) -> Result<(), DatapathError> {
        self.rewrite_address(ctx, IPV4_DADDR_OFF, self.daddr, addr)?;
        self.rewrite_port(ctx, self.l4_off + 2, self.dport, port)
    }

    /// Rewrites the source address and port, fixing the IPv4 and L4 checksums.
    pub fn rewrite_source(
        &self,
        ctx: &TcContext,
        addr: u32,
        port: u16,
    ) -> Result<(), DatapathError> {
        self.rewrite_address(ctx, IPV4_SADDR_OFF, self.saddr, addr)?;
        self.rewrite_port(ctx, self.l4_off, self.sport, port)
    }

    fn rewrite_address(
        &self,
        ctx: &TcContext,
        offset: usize,
        old: u32,
        new: u32,
    ) -> Result<(), DatapathError> {
        if old == new {
            return Ok(());
        }
        let pseudo_header = u64::from(BPF_F_PSEUDO_HDR) | self.l4_csum_flags() | 4;
        ctx.l4_csum_replace(
            self.l4_csum_off(),
            u64::from(old),
            u64::from(new),
            pseudo_header,
        )
        .and_then(|()| ctx.l3_csum_replace(IPV4_CSUM_OFF, u64::from(old), u64::from(new), 4))
        .and_then(|()| ctx.store(offset, &new, 0))
        .map_err(|_| DatapathError::RewriteFailed)
    }

    fn rewrite_port(
        &self,
        ctx: &TcContext,
        offset: usize,
        old: u16,
        new: u16,
    ) -> Result<(), DatapathError> {
        if old == new {
            return Ok(());
        }
        ctx.l4_csum_replace(
            self.l4_csum_off(),
            u64::from(old),
            u64::from(new),
            self.l4_csum_flags() | 2,
        )
        .and_then(|()| ctx.store(offset, &new, 0))
        .map_err(|_| DatapathError::RewriteFailed)
    }
}

/// An IPv4 address as stored in map keys: the four bytes on the wire, then zeros.
pub fn ipv4_key_addr(addr: u32) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..4].copy_from_slice(&addr.to_ne_bytes());
    out
}

/// The IPv4 address stored in the first four bytes of a map address.
pub fn ipv4_from_key_addr(addr: &[u8; 16]) -> u32 {
    u32::from_ne_bytes([addr[0], addr[1], addr[2], addr[3]])
}
