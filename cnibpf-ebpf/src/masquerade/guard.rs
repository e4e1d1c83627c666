//! What leaves an uplink without a flow the parser could read — an ICMP error, a protocol
//! without ports, a packet too short for its headers: an ICMP error a container sends about a
//! connection cnibpf translated is translated to the side its peer knows (as conntrack's NAT
//! translates a RELATED error), and anything else from a masqueraded container's own address
//! towards a destination that is not excluded is dropped and counted
//! (`masquerade_untranslatable`): it cannot leave translated, and must not leave with an
//! address that does not belong on the uplink's link.

use aya_ebpf::{
    EbpfContext as _, bindings::BPF_CSUM_LEVEL_RESET, helpers::bpf_csum_level, programs::TcContext,
};
use cnibpf_common::{
    FAMILY_IPV4, FAMILY_IPV6,
    address::Address,
    connections::{ConnectionKey, PART_DNAT, PART_SNAT},
    drops::DropReason,
};

use super::{count, icmp::Quoted, is_excluded, masqueraded_address};
use crate::{
    connections, drops,
    packet::{
        DROP, DatapathError, ETH_P_IP, ETH_P_IPV6, IPV4_SADDR_OFF, IPV6_SADDR_OFF, NEXT,
        icmp::icmp_error_scratch, ifindex, load_anywhere,
    },
};

/// The verdict for a packet at an uplink's egress that carries no flow the parser could read
/// (see the module).
#[inline(never)]
pub fn untranslated(ctx: &TcContext) -> i32 {
    match translate_icmp_error(ctx) {
        Ok(true) => return NEXT,
        Ok(false) => {}
        Err(error) => return error.verdict(ctx),
    }
    let Ok((family, source, destination)) = addresses(ctx) else {
        return NEXT;
    };
    let Some(masqueraded) = masqueraded_address(family, &source) else {
        return NEXT;
    };
    if is_excluded(masqueraded.owner, family, &destination) {
        return NEXT;
    }
    let reason = DropReason::MasqueradeUntranslatable;
    drops::count(reason, ctx.len());
    drops::report(reason, |event| {
        event.owner = masqueraded.owner;
        event.ifindex = ifindex(ctx);
        event.src_addr = source;
        event.dst_addr = destination;
        event.family = family;
    });
    DROP
}

/// An ICMP error a container sends about a packet of a connection cnibpf translated (a
/// datagram to a closed port that came through a hostPort or as a masquerade reply, a packet
/// too big for its link): its source and the quoted packet's destination become the hostPort
/// or the masquerade address and port its peer sent to. Whether it was one.
fn translate_icmp_error(ctx: &TcContext) -> Result<bool, DatapathError> {
    let Some(error) = icmp_error_scratch.get_ptr_mut(0) else {
        return Ok(false);
    };
    // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
    let error = unsafe { &mut *error };
    if !error.parse(ctx)? {
        return Ok(false);
    }
    // The quoted packet travelled towards the container: its destination is the container's.
    let key = ConnectionKey {
        container_addr: error.inner_daddr,
        remote_addr: error.inner_saddr,
        container_port: u16::from_be(error.inner_dport),
        remote_port: u16::from_be(error.inner_sport),
        protocol: error.inner_protocol,
        family: error.family,
        _pad: 0,
    };
    // SAFETY: points into `connections`, read at once.
    let Some(connection) = (unsafe { connections::find(&key).as_ref() }) else {
        return Ok(false);
    };
    // A hairpin client is another container, reached through the host, not this uplink.
    let (addr, port) = if connection.parts & PART_DNAT != 0 && connection.peer_ifindex == 0 {
        (connection.orig_addr, connection.orig_port)
    } else if connection.parts & PART_SNAT != 0 {
        (connection.nat_addr, connection.nat_port)
    } else {
        return Ok(false);
    };
    error.translate(ctx, Quoted::Destination, &addr, port.to_be())?;
    // The checksums are right; the hardware's verdict on the original packet no longer is.
    // SAFETY: the context pointer is this program's __sk_buff.
    unsafe { bpf_csum_level(ctx.as_ptr().cast(), u64::from(BPF_CSUM_LEVEL_RESET)) };
    count(|stats| &mut stats.icmp_errors);
    Ok(true)
}

/// The family, source and destination of an IPv4 or IPv6 packet, read wherever they lie.
fn addresses(ctx: &TcContext) -> Result<(u8, Address, Address), DatapathError> {
    let ethertype: u16 = load_anywhere(ctx, 12)?;
    if ethertype == ETH_P_IP.to_be() {
        // Words, as `Address` keeps them: no byte is moved on its own.
        let [source, destination]: [u32; 2] = load_anywhere(ctx, IPV4_SADDR_OFF)?;
        return Ok((
            FAMILY_IPV4,
            Address::from_words([source, 0, 0, 0]),
            Address::from_words([destination, 0, 0, 0]),
        ));
    }
    if ethertype == ETH_P_IPV6.to_be() {
        let source: Address = load_anywhere(ctx, IPV6_SADDR_OFF)?;
        let destination: Address = load_anywhere(ctx, IPV6_SADDR_OFF + 16)?;
        return Ok((FAMILY_IPV6, source, destination));
    }
    Err(DatapathError::Truncated)
}
