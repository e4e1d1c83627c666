//! Source address verification: a container may send only from its own addresses (the source
//! set of its interface's `endpoints` record).
//! Checked first in `from_container`, before anything is translated or tracked, so that a
//! packet in another container's name creates no state: its IPv4 or IPv6 source, an ARP
//! packet's sender address, a neighbour advertisement's target (past extension headers). The unspecified address passes
//! (IPv6 duplicate address detection and MLD before an address is configured, ARP probes): no
//! answer can reach anyone through it. Frames that are neither IP nor ARP carry no address of
//! the container's and are dropped too (a VLAN tag would hide a spoofed source). What is
//! dropped is counted in `source_drops` (per attachment) and `drop_stats` (per reason) and
//! reported in `filter_events`.

use aya_ebpf::programs::TcContext;
use cnibpf_common::{
    FAMILY_IPV4, FAMILY_IPV6, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP,
    address::Address,
    drops::DropReason,
    endpoints::EndpointInfo,
    filter::DIRECTION_EGRESS,
    sources::{SourceDrops, SourceSet},
};

use crate::{
    drops, maps,
    packet::{
        ETH_HLEN, ETH_P_IP, ETH_P_IPV6, IPV4_DADDR_OFF, IPV4_SADDR_OFF, IPV6_DADDR_OFF,
        IPV6_SADDR_OFF, SourceAddress, extension_headers, load, load_anywhere, source_address,
    },
};

const ETH_P_ARP: u16 = 0x0806;
/// ARP for IPv4 over Ethernet: hardware type, protocol type, their lengths.
const ARP_IPV4_ETHERNET: [u8; 6] = [0, 1, 0x08, 0x00, 6, 4];
const ARP_SENDER_ADDR_OFF: usize = ETH_HLEN + 14;
const ARP_TARGET_ADDR_OFF: usize = ETH_HLEN + 24;
const NEIGHBOR_ADVERTISEMENT: u8 = 136;
/// Where a neighbour advertisement's target address starts in its ICMPv6 message.
const NA_TARGET_OFF: usize = 8;

/// What the check needs to know of a dropped packet, for its event.
struct Spoofed {
    reason: DropReason,
    family: u8,
    protocol: u8,
    source: Address,
    destination: Address,
}

/// Whether the container behind `ifindex`, whose `endpoints` record is `endpoint` (null for
/// an interface cnibpf knows nothing about), may send this packet as far as its addresses go:
/// always for an interface without a recorded set. Not inlined: its reads stay out of the
/// frames of `from_container`'s deeper calls.
#[inline(never)]
pub fn admit(ctx: &TcContext, ifindex: u32, endpoint: *const EndpointInfo) -> bool {
    if endpoint.is_null() {
        return true;
    }
    // SAFETY: points into `endpoints`, whose elements are replaced whole (never written in
    // place), so it reads one consistent set.
    let set = unsafe { &(*endpoint).sources };
    if !set.checks() {
        return true;
    }
    match spoofed(ctx, set) {
        None => true,
        Some(spoofed) => {
            count(ctx, ifindex);
            drops::count(spoofed.reason, ctx.len());
            report(&spoofed, set.owner, ifindex);
            false
        }
    }
}

/// Whether the packet plainly comes from one of the container's addresses, told from its
/// linear headers without a helper call: IPv4, or IPv6 with TCP or UDP right after its
/// header (nothing that could carry a neighbour advertisement). `false` when it cannot tell:
/// the full check decides.
#[inline(always)]
fn plainly_own(ctx: &TcContext, set: &SourceSet) -> bool {
    match source_address(ctx) {
        Some(SourceAddress::V4(source)) => set.holds_ipv4(source),
        Some(SourceAddress::V6(source)) => {
            matches!(load::<u8>(ctx, ETH_HLEN + 6), Ok(PROTO_TCP | PROTO_UDP))
                && set.holds_ipv6(&source)
        }
        None => false,
    }
}

/// The packet's addresses when one the container claims is not its own; `None` when it may go.
#[inline(always)]
fn spoofed(ctx: &TcContext, set: &SourceSet) -> Option<Spoofed> {
    if plainly_own(ctx, set) {
        return None;
    }
    let ethertype = u16::from_be(load_anywhere::<u16>(ctx, 12).ok()?);
    let unreadable = || Spoofed {
        reason: DropReason::SourceCheckNotIp,
        family: 0,
        protocol: 0,
        source: Address::UNSPECIFIED,
        destination: Address::UNSPECIFIED,
    };
    if ethertype == ETH_P_IP {
        let source: [u8; 4] = load_anywhere(ctx, IPV4_SADDR_OFF).ok()?;
        if set.holds_ipv4(source) {
            return None;
        }
        let destination: [u8; 4] = load_anywhere(ctx, IPV4_DADDR_OFF).unwrap_or([0; 4]);
        return Some(Spoofed {
            reason: DropReason::SourceCheckAddress,
            family: FAMILY_IPV4,
            protocol: load_anywhere(ctx, ETH_HLEN + 9).unwrap_or(0),
            source: Address::ipv4(source),
            destination: Address::ipv4(destination),
        });
    }
    if ethertype == ETH_P_IPV6 {
        let source: Address = load_anywhere(ctx, IPV6_SADDR_OFF).ok()?;
        let spoofed = |reason: DropReason, protocol: u8, claimed: Address| Spoofed {
            reason,
            family: FAMILY_IPV6,
            protocol,
            source: claimed,
            destination: load_anywhere(ctx, IPV6_DADDR_OFF).unwrap_or(Address::UNSPECIFIED),
        };
        if source != Address::UNSPECIFIED && !set.holds_ipv6(&source) {
            return Some(spoofed(
                DropReason::SourceCheckAddress,
                load_anywhere(ctx, ETH_HLEN + 6).unwrap_or(0),
                source,
            ));
        }
        // An advertisement tells the neighbours where its target lives — behind whatever
        // extension headers the kernel would walk; one this check cannot walk past (more than
        // four, a routing header with segments left) hides what it carries, and goes.
        let (protocol, l4_off) = match extension_headers(ctx) {
            Ok(Some(walked)) => (walked.protocol, walked.l4_off),
            Ok(None) => return Some(spoofed(DropReason::SourceCheckNotIp, 0, source)),
            Err(_) => return None,
        };
        if protocol != PROTO_ICMPV6
            || load_anywhere::<u8>(ctx, l4_off).ok() != Some(NEIGHBOR_ADVERTISEMENT)
        {
            return None;
        }
        let target: Address = load_anywhere(ctx, l4_off + NA_TARGET_OFF).ok()?;
        if set.holds_ipv6(&target) {
            return None;
        }
        return Some(spoofed(
            DropReason::SourceCheckNeighbourAdvertisement,
            protocol,
            target,
        ));
    }
    if ethertype == ETH_P_ARP {
        let Ok(header) = load_anywhere::<[u8; 6]>(ctx, ETH_HLEN) else {
            return Some(unreadable());
        };
        if header != ARP_IPV4_ETHERNET {
            return Some(unreadable());
        }
        let Ok(sender) = load_anywhere::<[u8; 4]>(ctx, ARP_SENDER_ADDR_OFF) else {
            return Some(unreadable());
        };
        if sender == [0; 4] || set.holds_ipv4(sender) {
            return None;
        }
        return Some(Spoofed {
            reason: DropReason::SourceCheckArp,
            family: FAMILY_IPV4,
            protocol: 0,
            source: Address::ipv4(sender),
            destination: Address::ipv4(load_anywhere(ctx, ARP_TARGET_ADDR_OFF).unwrap_or([0; 4])),
        });
    }
    Some(unreadable())
}

fn count(ctx: &TcContext, ifindex: u32) {
    if let Some(drops) = maps::source_drops.get_ptr_mut(&ifindex) {
        // SAFETY: this CPU's value of a per-CPU map; programs on one CPU do not overlap.
        let drops: &mut SourceDrops = unsafe { &mut *drops };
        drops.packets += 1;
        drops.bytes += u64::from(ctx.len());
    }
}

/// Reports a packet the check dropped.
#[inline(always)]
fn report(spoofed: &Spoofed, owner: u64, ifindex: u32) {
    drops::report(spoofed.reason, |event| {
        event.owner = owner;
        event.src_addr = spoofed.source;
        event.dst_addr = spoofed.destination;
        event.ifindex = ifindex;
        event.protocol = spoofed.protocol;
        event.family = spoofed.family;
        event.direction = DIRECTION_EGRESS;
    });
}
