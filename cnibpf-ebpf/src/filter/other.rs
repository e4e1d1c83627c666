//! Packets the filter judges without ports: link-local control traffic (always passes), ICMP
//! errors (with the connection they quote), and anything else (by the rules, as new).

use aya_ebpf::programs::TcContext;
use cnibpf_common::{
    FAMILY_IPV4, FAMILY_IPV6, PROTO_ICMP, PROTO_ICMPV6,
    address::Address,
    connections::{ConnectionKey, PART_FILTER},
    drops::DropReason,
    filter::{DIRECTION_EGRESS, TARGET_ALLOW},
    packet::is_icmpv6_link_control,
};

use super::{IPV6_HOP_BY_HOP, PROTO_IGMP, Packet, filter_scratch, judged_as_new, subject};
use crate::{
    clock, drops, maps,
    packet::{
        DatapathError, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, IPV6_HLEN, icmp::icmp_error_scratch,
        load_anywhere,
    },
};

/// Whether a packet without ports or state — an ICMP error, ICMP other than echo, another
/// protocol — passes the filter of the attachment on `ifindex`: link-local control always,
/// an ICMP error about a connection whose packets are allowed with it, anything else by the
/// rules as a first packet (ports zero), without creating state.
#[inline(never)]
pub fn allows_other(ctx: &TcContext, ifindex: u32, direction: u8) -> bool {
    let Some(set) = maps::filters.get_ptr(&ifindex) else {
        return true;
    };
    // SAFETY: see `allows`.
    let set = unsafe { &*set };
    let subject = match classify(ctx, ifindex, direction) {
        JUDGED => filter_scratch.get_ptr_mut(0),
        ICMP_JUDGED if error_of_allowed_connection(ctx, set.owner, direction) => return true,
        ICMP_JUDGED => filter_scratch.get_ptr_mut(0),
        PASSES => return true,
        _ => {
            drops::record_unread(ctx, DropReason::FilterUnreadable, ifindex);
            return false;
        }
    };
    let Some(subject) = subject else {
        drops::record_unread(ctx, DropReason::FilterUnreadable, ifindex);
        return false;
    };
    // SAFETY: this CPU's scratch, filled by `classify`.
    let subject = unsafe { &mut *subject };
    judged_as_new(subject, set)
}

/// [`classify`]'s answers: the packet always passes, it is to be judged by the rules (an
/// ICMP packet maybe by its connection first), or it could not be read.
const PASSES: u32 = 0;
const JUDGED: u32 = 1;
const ICMP_JUDGED: u32 = 2;
const MALFORMED: u32 = 3;

/// Reads a packet without ports into this CPU's [`Subject`]. Anything but IP, and
/// link-local control, passes. Not inlined: it must not share a stack frame with
/// `error_of_allowed_connection`'s callees.
#[inline(never)]
fn classify(ctx: &TcContext, ifindex: u32, direction: u8) -> u32 {
    match read_other(ctx) {
        Ok(Some(packet)) => {
            if subject(ctx, &packet, ifindex, direction).is_null() {
                MALFORMED
            } else if matches!(packet.protocol, PROTO_ICMP | PROTO_ICMPV6) {
                ICMP_JUDGED
            } else {
                JUDGED
            }
        }
        Ok(None) => PASSES,
        Err(_) => MALFORMED,
    }
}

#[inline(always)]
fn read_other(ctx: &TcContext) -> Result<Option<Packet>, DatapathError> {
    let ethertype: u16 = load_anywhere(ctx, 12)?;
    let (family, protocol, source, destination) = if ethertype == ETH_P_IP.to_be() {
        let protocol: u8 = load_anywhere(ctx, ETH_HLEN + 9)?;
        if protocol == PROTO_IGMP {
            return Ok(None);
        }
        let source: [u8; 4] = load_anywhere(ctx, ETH_HLEN + 12)?;
        let destination: [u8; 4] = load_anywhere(ctx, ETH_HLEN + 16)?;
        (
            FAMILY_IPV4,
            protocol,
            Address::ipv4(source),
            Address::ipv4(destination),
        )
    } else if ethertype == ETH_P_IPV6.to_be() {
        let mut protocol: u8 = load_anywhere(ctx, ETH_HLEN + 6)?;
        let mut l4_off = ETH_HLEN + IPV6_HLEN;
        if protocol == IPV6_HOP_BY_HOP {
            let header: [u8; 2] = load_anywhere(ctx, l4_off)?;
            protocol = header[0];
            l4_off += (usize::from(header[1]) + 1) * 8;
        }
        if protocol == PROTO_ICMPV6 {
            let icmp_type: u8 = load_anywhere(ctx, l4_off)?;
            if is_icmpv6_link_control(icmp_type) {
                return Ok(None);
            }
        }
        (
            FAMILY_IPV6,
            protocol,
            load_anywhere::<Address>(ctx, ETH_HLEN + 8)?,
            load_anywhere::<Address>(ctx, ETH_HLEN + 24)?,
        )
    } else {
        return Ok(None);
    };
    Ok(Some(Packet {
        family,
        protocol,
        flags: 0,
        source,
        destination,
        source_port: 0,
        destination_port: 0,
        now: clock::now_ns(),
    }))
}

/// Whether the packet is an ICMP error about a live connection of the attachment whose
/// packets are allowed (the quoted packet is one of the connection's).
#[inline(never)]
fn error_of_allowed_connection(ctx: &TcContext, owner: u64, direction: u8) -> bool {
    let Some(error) = icmp_error_scratch.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
    let error = unsafe { &mut *error };
    if !matches!(error.parse(ctx), Ok(true)) {
        return false;
    }
    // The quoted packet was sent by the container when the error travels towards it, and
    // to it when the container reports the error.
    let (container, remote) = if direction == DIRECTION_EGRESS {
        (
            (error.inner_daddr, error.inner_dport),
            (error.inner_saddr, error.inner_sport),
        )
    } else {
        (
            (error.inner_saddr, error.inner_sport),
            (error.inner_daddr, error.inner_dport),
        )
    };
    let key = ConnectionKey {
        container_addr: container.0,
        remote_addr: remote.0,
        container_port: u16::from_be(container.1),
        remote_port: u16::from_be(remote.1),
        protocol: error.inner_protocol,
        family: error.family,
        _pad: 0,
    };
    let Some(entry) = maps::connections.get_ptr(&key) else {
        return false;
    };
    // SAFETY: points into `connections`, read at once.
    let entry = unsafe { &*entry };
    let now = clock::now_ns();
    entry.has(owner, PART_FILTER)
        && entry.last_verdict == TARGET_ALLOW
        && !entry.is_expired(key.protocol, now)
}
