//! Reading what a hook sent: addresses, ports and quoted packets, every checksum verified,
//! and the `connections` key a step's packet is tracked by.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use cnibpf_common::connections::ConnectionKey;
use cnibpf_tests::packet::{ETH_P_IP, ETH_P_IPV6, ICMP, ICMPV6, SCTP, TCP, UDP, ethernet, verify};

use super::Bench;

/// An IP packet's addresses, ports and (ICMP errors) quoted packet, read from a frame.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Ends {
    pub(super) src: IpAddr,
    pub(super) dst: IpAddr,
    pub(super) protocol: u8,
    pub(super) ports: Option<(u16, u16)>,
    pub(super) quoted: Option<Box<Ends>>,
}

/// [`Ends`] of an Ethernet frame, every checksum verified.
pub(super) fn ends_of(frame: &[u8]) -> Result<Ends, String> {
    let parsed = verify(frame)?;
    let header = if parsed.src.is_ipv4() {
        usize::from(frame[14] & 0x0f) * 4
    } else {
        40
    };
    let l4 = &frame[14 + header..];
    let is_error = match parsed.protocol {
        ICMP => matches!(l4.first(), Some(3 | 11 | 12)),
        ICMPV6 => matches!(l4.first(), Some(1..=4)),
        _ => false,
    };
    let quoted = if is_error && l4.len() > 8 {
        let ethertype: u16 = if parsed.src.is_ipv4() {
            ETH_P_IP
        } else {
            ETH_P_IPV6
        };
        let inner = ethernet([0; 6], [0; 6], ethertype, &l4[8..]);
        Some(Box::new(quoted_ends(&inner)?))
    } else {
        None
    };
    Ok(Ends {
        src: parsed.src,
        dst: parsed.dst,
        protocol: parsed.protocol,
        ports: parsed.ports,
        quoted,
    })
}

/// The addresses and ports of a quoted packet (its transport checksum is not checked: an
/// ICMP error may quote a part of it only, and a translation keeps it as the sender saw it).
fn quoted_ends(frame: &[u8]) -> Result<Ends, String> {
    let packet = &frame[14..];
    let (src, dst, protocol, l4): (IpAddr, IpAddr, u8, &[u8]) = if frame[12..14] == [0x08, 0] {
        let ihl = usize::from(packet[0] & 0x0f) * 4;
        let octets =
            |at: usize| Ipv4Addr::new(packet[at], packet[at + 1], packet[at + 2], packet[at + 3]);
        (
            octets(12).into(),
            octets(16).into(),
            packet[9],
            &packet[ihl..],
        )
    } else {
        let address = |at: usize| {
            let bytes: [u8; 16] = packet[at..at + 16].try_into().expect("16 bytes");
            Ipv6Addr::from(bytes)
        };
        (
            address(8).into(),
            address(24).into(),
            packet[6],
            &packet[40..],
        )
    };
    if frame[12..14] == [0x08, 0] {
        let ihl = usize::from(packet[0] & 0x0f) * 4;
        if cnibpf_tests::packet::checksum(&[&packet[..ihl]]) != 0 {
            return Err("bad quoted IPv4 header checksum".to_owned());
        }
    }
    let ports = (matches!(protocol, TCP | UDP | SCTP) && l4.len() >= 4).then(|| {
        (
            u16::from_be_bytes([l4[0], l4[1]]),
            u16::from_be_bytes([l4[2], l4[3]]),
        )
    });
    Ok(Ends {
        src,
        dst,
        protocol,
        ports,
        quoted: None,
    })
}

/// The `connections` key of a step's packet: its tuple from its container's side — the
/// destination of what comes out when that is a container (DNAT, replies), else the sender
/// of what went in when a container sent it, else its destination.
pub(super) fn connection_key(bench: &Bench, frame: &[u8], out: &[u8]) -> Option<ConnectionKey> {
    let (input, output) = (ends_of(frame).ok()?, ends_of(out).ok());
    let sides = [
        output
            .as_ref()
            .map(|ends| (ends.dst, ends.src, ends.ports.map(|(s, d)| (d, s)))),
        Some((input.src, input.dst, input.ports)),
        Some((input.dst, input.src, input.ports.map(|(s, d)| (d, s)))),
    ];
    let (container, remote, ports) = sides
        .into_iter()
        .flatten()
        .find(|(container, _, _)| bench.is_container(*container))?;
    let (container_port, remote_port) = ports?;
    let address = |address: IpAddr| match address {
        IpAddr::V4(address) => cnibpf_common::address::Address::ipv4(address.octets()),
        IpAddr::V6(address) => cnibpf_common::address::Address::from_bytes(address.octets()),
    };
    Some(ConnectionKey {
        container_addr: address(container),
        remote_addr: address(remote),
        container_port,
        remote_port,
        protocol: input.protocol,
        family: if container.is_ipv4() { 2 } else { 10 },
        _pad: 0,
    })
}
