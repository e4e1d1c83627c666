//! Packets built byte by byte for the datapath's programs run on their own
//! (`BPF_PROG_TEST_RUN`), and their checksums verified independently of the datapath.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
pub const ETH_P_ARP: u16 = 0x0806;
pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const ICMP: u8 = 1;
pub const ICMPV6: u8 = 58;
pub const SCTP: u8 = 132;
/// TCP flags.
pub const FIN: u8 = 0x01;
pub const SYN: u8 = 0x02;
pub const RST: u8 = 0x04;
pub const ACK: u8 = 0x10;

pub fn ethernet(dst: [u8; 6], src: [u8; 6], ethertype: u16, payload: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(14 + payload.len());
    frame.extend(dst);
    frame.extend(src);
    frame.extend(ethertype.to_be_bytes());
    frame.extend(payload);
    frame
}

/// An IPv4 header (`options` padded to 4 bytes) with its checksum, then `payload`.
/// `fragment` is (more fragments, offset in 8-byte units).
pub fn ipv4(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    protocol: u8,
    options: &[u8],
    fragment: (bool, u16),
    payload: &[u8],
) -> Vec<u8> {
    let options_len = options.len().next_multiple_of(4);
    let header_len = 20 + options_len;
    let total = u16::try_from(header_len + payload.len()).expect("fits a datagram");
    let mut header = vec![0u8; header_len];
    header[0] = 0x40 | u8::try_from(header_len / 4).expect("IHL fits");
    header[2..4].copy_from_slice(&total.to_be_bytes());
    header[4..6].copy_from_slice(&0x1234u16.to_be_bytes());
    let flags_offset = (u16::from(fragment.0) << 13) | fragment.1;
    header[6..8].copy_from_slice(&flags_offset.to_be_bytes());
    header[8] = 64;
    header[9] = protocol;
    header[12..16].copy_from_slice(&src.octets());
    header[16..20].copy_from_slice(&dst.octets());
    header[20..20 + options.len()].copy_from_slice(options);
    let sum = checksum(&[&header]);
    header[10..12].copy_from_slice(&sum.to_be_bytes());
    header.extend(payload);
    header
}

/// An IPv6 header, then `payload` (which starts with whatever `next_header` says).
pub fn ipv6(src: Ipv6Addr, dst: Ipv6Addr, next_header: u8, payload: &[u8]) -> Vec<u8> {
    let mut header = vec![0u8; 40];
    header[0] = 0x60;
    header[4..6].copy_from_slice(&u16::try_from(payload.len()).expect("fits").to_be_bytes());
    header[6] = next_header;
    header[7] = 64;
    header[8..24].copy_from_slice(&src.octets());
    header[24..40].copy_from_slice(&dst.octets());
    header.extend(payload);
    header
}

/// A TCP segment with its checksum over the pseudo header of (`src`, `dst`).
pub fn tcp(src: IpAddr, dst: IpAddr, sport: u16, dport: u16, flags: u8, payload: &[u8]) -> Vec<u8> {
    tcp_with_options(src, dst, sport, dport, flags, &[], payload)
}

/// [`tcp`] with `options` (padded with end-of-options to 4 bytes, at most 40).
pub fn tcp_with_options(
    src: IpAddr,
    dst: IpAddr,
    sport: u16,
    dport: u16,
    flags: u8,
    options: &[u8],
    payload: &[u8],
) -> Vec<u8> {
    let options_len = options.len().next_multiple_of(4);
    assert!(options_len <= 40, "TCP options fit 40 bytes");
    let mut segment = vec![0u8; 20 + options_len];
    segment[0..2].copy_from_slice(&sport.to_be_bytes());
    segment[2..4].copy_from_slice(&dport.to_be_bytes());
    segment[4..8].copy_from_slice(&1000u32.to_be_bytes());
    segment[12] = u8::try_from((20 + options_len) / 4).expect("data offset fits") << 4;
    segment[13] = flags;
    segment[14..16].copy_from_slice(&65_535u16.to_be_bytes());
    segment[20..20 + options.len()].copy_from_slice(options);
    segment.extend(payload);
    let sum = checksum(&[&pseudo_header(src, dst, TCP, segment.len()), &segment]);
    segment[16..18].copy_from_slice(&sum.to_be_bytes());
    segment
}

/// A UDP datagram; `with_checksum` false leaves the checksum 0 ("none", IPv4 only).
pub fn udp(
    src: IpAddr,
    dst: IpAddr,
    sport: u16,
    dport: u16,
    payload: &[u8],
    with_checksum: bool,
) -> Vec<u8> {
    let mut datagram = vec![0u8; 8];
    datagram[0..2].copy_from_slice(&sport.to_be_bytes());
    datagram[2..4].copy_from_slice(&dport.to_be_bytes());
    datagram[4..6].copy_from_slice(
        &u16::try_from(8 + payload.len())
            .expect("fits")
            .to_be_bytes(),
    );
    datagram.extend(payload);
    if with_checksum {
        let mut sum = checksum(&[&pseudo_header(src, dst, UDP, datagram.len()), &datagram]);
        if sum == 0 {
            sum = 0xffff;
        }
        datagram[6..8].copy_from_slice(&sum.to_be_bytes());
    }
    datagram
}

/// An SCTP packet (common header and one DATA chunk) with its CRC32c.
pub fn sctp(sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    let mut packet = vec![0u8; 12];
    packet[0..2].copy_from_slice(&sport.to_be_bytes());
    packet[2..4].copy_from_slice(&dport.to_be_bytes());
    packet[4..8].copy_from_slice(&0xdead_beefu32.to_be_bytes());
    // DATA chunk: type 0, flags, length, TSN, stream, sequence, PPID, data.
    let mut chunk = vec![0u8, 0x03];
    chunk.extend(
        u16::try_from(16 + payload.len())
            .expect("fits")
            .to_be_bytes(),
    );
    chunk.extend(1u32.to_be_bytes());
    chunk.extend([0, 0, 0, 0]);
    chunk.extend(0u32.to_be_bytes());
    chunk.extend(payload);
    chunk.resize(chunk.len().next_multiple_of(4), 0);
    packet.extend(chunk);
    let crc = crc32c(&packet);
    packet[8..12].copy_from_slice(&crc.to_le_bytes());
    packet
}

/// An ICMP (v4) message of `kind`/`code` quoting `quoted`, with its checksum.
pub fn icmp(kind: u8, code: u8, rest: [u8; 4], quoted: &[u8]) -> Vec<u8> {
    let mut message = vec![kind, code, 0, 0];
    message.extend(rest);
    message.extend(quoted);
    let sum = checksum(&[&message]);
    message[2..4].copy_from_slice(&sum.to_be_bytes());
    message
}

/// An ICMPv6 message, its checksum over the pseudo header of (`src`, `dst`).
pub fn icmpv6(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    kind: u8,
    code: u8,
    rest: [u8; 4],
    quoted: &[u8],
) -> Vec<u8> {
    let mut message = vec![kind, code, 0, 0];
    message.extend(rest);
    message.extend(quoted);
    let sum = checksum(&[
        &pseudo_header(IpAddr::V6(src), IpAddr::V6(dst), ICMPV6, message.len()),
        &message,
    ]);
    message[2..4].copy_from_slice(&sum.to_be_bytes());
    message
}

fn pseudo_header(src: IpAddr, dst: IpAddr, protocol: u8, length: usize) -> Vec<u8> {
    let mut header = Vec::with_capacity(40);
    match (src, dst) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => {
            header.extend(src.octets());
            header.extend(dst.octets());
            header.extend([0, protocol]);
            header.extend(u16::try_from(length).expect("fits").to_be_bytes());
        }
        (IpAddr::V6(src), IpAddr::V6(dst)) => {
            header.extend(src.octets());
            header.extend(dst.octets());
            header.extend(u32::try_from(length).expect("fits").to_be_bytes());
            header.extend([0, 0, 0, protocol]);
        }
        _ => panic!("addresses of one family"),
    }
    header
}

/// The Internet checksum of the concatenation of `parts`.
pub fn checksum(parts: &[&[u8]]) -> u16 {
    let bytes: Vec<u8> = parts.iter().flat_map(|part| part.iter().copied()).collect();
    let mut sum: u32 = bytes
        .chunks(2)
        .map(|pair| u32::from(u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// CRC32c (Castagnoli), as SCTP carries it.
pub fn crc32c(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for byte in bytes {
        crc ^= u32::from(*byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// What a frame says of itself, read without the datapath's code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parsed {
    pub dst_mac: [u8; 6],
    pub src: IpAddr,
    pub dst: IpAddr,
    pub protocol: u8,
    /// Ports, when the transport header is there (a first or whole datagram).
    pub ports: Option<(u16, u16)>,
}

/// Parses an Ethernet frame of IPv4 or IPv6 (no extension headers) and checks every
/// checksum it carries: the IPv4 header's, TCP's, UDP's (0 allowed over IPv4), ICMP's,
/// ICMPv6's and SCTP's CRC32c. A fragment's transport checksum cannot be checked.
pub fn verify(frame: &[u8]) -> Result<Parsed, String> {
    let short = || format!("frame of {} bytes is short", frame.len());
    let dst_mac: [u8; 6] = frame
        .get(..6)
        .ok_or_else(short)?
        .try_into()
        .map_err(|_| short())?;
    let ethertype = u16::from_be_bytes([
        *frame.get(12).ok_or_else(short)?,
        *frame.get(13).ok_or_else(short)?,
    ]);
    let packet = &frame[14..];
    // (source, destination, protocol, transport bytes, a later fragment, more to come)
    let (src, dst, protocol, l4, later_fragment, more): (IpAddr, IpAddr, u8, &[u8], bool, bool) =
        match ethertype {
            ETH_P_IP => {
                let ihl = usize::from(packet.first().ok_or_else(short)? & 0x0f) * 4;
                let header = packet.get(..ihl).ok_or_else(short)?;
                if checksum(&[header]) != 0 {
                    return Err("bad IPv4 header checksum".to_owned());
                }
                let total = usize::from(u16::from_be_bytes([header[2], header[3]]));
                let flags_offset = u16::from_be_bytes([header[6], header[7]]);
                (
                    IpAddr::V4(Ipv4Addr::new(
                        header[12], header[13], header[14], header[15],
                    )),
                    IpAddr::V4(Ipv4Addr::new(
                        header[16], header[17], header[18], header[19],
                    )),
                    header[9],
                    packet.get(ihl..total).ok_or_else(short)?,
                    flags_offset & 0x1fff != 0,
                    flags_offset & 0x2000 != 0,
                )
            }
            ETH_P_IPV6 => {
                let header = packet.get(..40).ok_or_else(short)?;
                let length = usize::from(u16::from_be_bytes([header[4], header[5]]));
                let src: [u8; 16] = header[8..24].try_into().map_err(|_| short())?;
                let dst: [u8; 16] = header[24..40].try_into().map_err(|_| short())?;
                // Past hop-by-hop, routing, destination options and fragment headers.
                let (mut next, mut offset, mut later, mut more) = (header[6], 40, false, false);
                while matches!(next, 0 | 43 | 60 | 44) {
                    let extension = packet.get(offset..offset + 8).ok_or_else(short)?;
                    if next == 44 {
                        let offset_and_more = u16::from_be_bytes([extension[2], extension[3]]);
                        later = offset_and_more >> 3 != 0;
                        more = offset_and_more & 1 != 0;
                        offset += 8;
                    } else {
                        offset += (usize::from(extension[1]) + 1) * 8;
                    }
                    next = extension[0];
                }
                (
                    IpAddr::V6(Ipv6Addr::from(src)),
                    IpAddr::V6(Ipv6Addr::from(dst)),
                    next,
                    packet.get(offset..40 + length).ok_or_else(short)?,
                    later,
                    more,
                )
            }
            other => return Err(format!("ethertype {other:#06x}")),
        };
    let ports = |l4: &[u8]| {
        (l4.len() >= 4).then(|| {
            (
                u16::from_be_bytes([l4[0], l4[1]]),
                u16::from_be_bytes([l4[2], l4[3]]),
            )
        })
    };
    if later_fragment {
        return Ok(Parsed {
            dst_mac,
            src,
            dst,
            protocol,
            ports: None,
        });
    }
    match protocol {
        // A first fragment carries only part of what its transport checksum covers.
        _ if more => {}
        TCP | UDP => {
            let zero_udp = protocol == UDP && l4.get(6..8) == Some(&[0, 0]) && src.is_ipv4();
            if !zero_udp && checksum(&[&pseudo_header(src, dst, protocol, l4.len()), l4]) != 0 {
                return Err(format!("bad transport checksum (protocol {protocol})"));
            }
        }
        ICMP => {
            if checksum(&[l4]) != 0 {
                return Err("bad ICMP checksum".to_owned());
            }
        }
        ICMPV6 => {
            if checksum(&[&pseudo_header(src, dst, ICMPV6, l4.len()), l4]) != 0 {
                return Err("bad ICMPv6 checksum".to_owned());
            }
        }
        SCTP => {
            let mut zeroed = l4.to_vec();
            let carried = u32::from_le_bytes(
                zeroed
                    .get(8..12)
                    .ok_or_else(short)?
                    .try_into()
                    .map_err(|_| short())?,
            );
            zeroed[8..12].fill(0);
            if crc32c(&zeroed) != carried {
                return Err("bad SCTP CRC32c".to_owned());
            }
        }
        _ => {}
    }
    Ok(Parsed {
        dst_mac,
        src,
        dst,
        protocol,
        ports: if matches!(protocol, TCP | UDP | SCTP) {
            ports(l4)
        } else {
            None
        },
    })
}

const ETH_BROADCAST: [u8; 6] = [0xff; 6];
/// ff02::1 and its multicast MAC address.
const ALL_NODES: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
const ALL_NODES_MAC: [u8; 6] = [0x33, 0x33, 0, 0, 0, 1];
const NEIGHBOR_ADVERTISEMENT: u8 = 136;
/// The override flag of a neighbour advertisement.
const NA_OVERRIDE: u8 = 0x20;
const TARGET_LINK_LAYER_ADDRESS: u8 = 2;
const DESTINATION_OPTIONS: u8 = 60;

/// A gratuitous ARP request, broadcast: `address` is at `mac`. Receivers holding a neighbour
/// entry for `address` take `mac` for it at once.
pub fn arp_announcement(mac: [u8; 6], address: Ipv4Addr) -> Vec<u8> {
    let mut arp = vec![0, 1, 0x08, 0x00, 6, 4, 0, 1];
    arp.extend(mac);
    arp.extend(address.octets());
    arp.extend([0; 6]);
    arp.extend(address.octets());
    ethernet(ETH_BROADCAST, mac, ETH_P_ARP, &arp)
}

/// An unsolicited neighbour advertisement with the override flag, from `source` to all nodes:
/// `target` is at `mac`; behind a destination options header when `behind_options` (which
/// the receiving kernel walks past as well).
pub fn neighbour_advertisement(
    mac: [u8; 6],
    source: Ipv6Addr,
    target: Ipv6Addr,
    behind_options: bool,
) -> Vec<u8> {
    let mut body = target.octets().to_vec();
    body.extend([TARGET_LINK_LAYER_ADDRESS, 1]);
    body.extend(mac);
    let message = icmpv6(
        source,
        ALL_NODES,
        NEIGHBOR_ADVERTISEMENT,
        0,
        [NA_OVERRIDE, 0, 0, 0],
        &body,
    );
    let mut packet = if behind_options {
        // Destination options: next header ICMPv6, 8 bytes, a PadN option filling them.
        let mut payload = vec![ICMPV6, 0, 1, 4, 0, 0, 0, 0];
        payload.extend(&message);
        ipv6(source, ALL_NODES, DESTINATION_OPTIONS, &payload)
    } else {
        ipv6(source, ALL_NODES, ICMPV6, &message)
    };
    // Neighbour discovery is accepted only with the hop limit it cannot have been routed with.
    packet[7] = 255;
    ethernet(ALL_NODES_MAC, mac, ETH_P_IPV6, &packet)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_builders_make_verifies() {
        let (a, b) = (Ipv4Addr::new(203, 0, 113, 2), Ipv4Addr::new(203, 0, 113, 1));
        let syn = tcp(a.into(), b.into(), 40_000, 8080, SYN, b"");
        let frame = ethernet(
            [2; 6],
            [4; 6],
            ETH_P_IP,
            &ipv4(a, b, TCP, &[1, 1, 1, 1], (false, 0), &syn),
        );
        let parsed = verify(&frame).expect("valid");
        assert_eq!(parsed.ports, Some((40_000, 8080)));
        let (a6, b6) = (
            "2001:db8::2".parse().expect("literal"),
            "2001:db8::1".parse().expect("literal"),
        );
        let datagram = udp(IpAddr::V6(a6), IpAddr::V6(b6), 1, 2, b"x", true);
        verify(&ethernet(
            [2; 6],
            [4; 6],
            ETH_P_IPV6,
            &ipv6(a6, b6, UDP, &datagram),
        ))
        .expect("valid");
        let association = sctp(9, 9, b"hello");
        verify(&ethernet(
            [2; 6],
            [4; 6],
            ETH_P_IP,
            &ipv4(a, b, SCTP, &[], (false, 0), &association),
        ))
        .expect("valid");
        let mut broken = frame.clone();
        broken[14 + 24 + 16] ^= 1;
        assert!(verify(&broken).is_err(), "a flipped bit is caught");
        // The RFC 3720 test vector: 32 zero bytes.
        assert_eq!(crc32c(&[0; 32]), 0x8a91_36aa);
    }
}
