//! Not a map: the answer to a packet a filter rule REJECTs, as bytes from its IP header on — a
//! TCP reset for a segment that opens a connection, an ICMP or ICMPv6 "administratively
//! prohibited" quoting the packet for anything else, and nothing for what is never answered
//! (an ICMP error, a reset, a later fragment, a multicast or broadcast destination, IPv4
//! options, IPv6 extension headers). The programs copy the packet's headers in, call these,
//! fill the two checksums left zero with `bpf_csum_diff` over the spans named here, and write
//! the answer over the packet. Kept here to be unit-tested on the host.

use crate::{PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, address::Address, internet_checksum, packet};

/// The answer's two ends: `local`, the address and port the packet was sent to (the answer
/// comes from there), and `remote`, its sender's. Ports in network byte order, as on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ends {
    pub local: Address,
    pub local_port: u16,
    pub remote: Address,
    pub remote_port: u16,
}

/// What a rejected packet is answered with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Nothing: it is never answered.
    Nothing,
    /// A TCP reset (to a segment that opens a connection).
    Reset,
    /// An ICMP or ICMPv6 "administratively prohibited".
    Prohibited,
}

/// The largest answer, from the IP header on.
pub const ANSWER_MAX: usize = PROHIBITED_V6_LEN;
pub const RESET_V4_LEN: usize = 40;
pub const PROHIBITED_V4_LEN: usize = 56;
pub const RESET_V6_LEN: usize = 60;
pub const PROHIBITED_V6_LEN: usize = 96;
/// Of an answer `out`: the offset of the L4 header (where its checksummed span starts, behind
/// the pseudo-header of IPv4's TCP and of IPv6), and of its checksum.
pub const L4_V4: usize = 20;
pub const L4_V6: usize = 40;
pub const TCP_CHECKSUM: usize = 16;
pub const ICMP_CHECKSUM: usize = 2;
/// Of an IPv4 answer: the header's checksum, over `out[..20]`.
pub const IPV4_CHECKSUM: usize = 10;

const TTL: u8 = 64;
const TCP_RST_ACK: u8 = 0x14;
const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;
const TCP_RST: u8 = 0x04;
/// ICMP destination unreachable, "communication administratively prohibited" (RFC 1812).
const ICMP_UNREACHABLE: u8 = 3;
const ICMP_PROHIBITED: u8 = 13;
/// ICMPv6 destination unreachable, "communication with destination administratively
/// prohibited" (RFC 4443).
const ICMPV6_UNREACHABLE: u8 = 1;
const ICMPV6_PROHIBITED: u8 = 1;

/// What an IPv4 packet is answered with: `ip` is its header's first 20 bytes, `l4` the 20
/// bytes after them (zeros past the packet's end).
pub fn kind_v4(ip: &[u8; 20], l4: &[u8; 20]) -> Kind {
    let options = ip[0] != 0x45;
    let later_fragment =
        packet::Fragment::of_ipv4(u16::from_be_bytes([ip[6], ip[7]])) == packet::Fragment::Later;
    let destination = [ip[16], ip[17], ip[18], ip[19]];
    let not_unicast = destination[0] >= 224 || destination == [255; 4];
    if options || later_fragment || not_unicast {
        return Kind::Nothing;
    }
    kind_of(ip[9], l4)
}

/// What an IPv6 packet is answered with: `ip` is its 40-byte header, `l4` the 20 bytes after.
pub fn kind_v6(ip: &[u8; 40], l4: &[u8; 20]) -> Kind {
    let multicast = ip[24] == 0xff;
    let extension_headers = !matches!(ip[6], PROTO_TCP | PROTO_ICMPV6 | 17 | 132);
    if ip[0] >> 4 != 6 || multicast || extension_headers {
        return Kind::Nothing;
    }
    kind_of(ip[6], l4)
}

fn kind_of(protocol: u8, l4: &[u8; 20]) -> Kind {
    match protocol {
        PROTO_TCP => {
            let flags = l4[13];
            if flags & TCP_RST != 0 {
                Kind::Nothing
            } else if flags & (TCP_SYN | TCP_ACK) == TCP_SYN {
                Kind::Reset
            } else {
                Kind::Prohibited
            }
        }
        PROTO_ICMP | PROTO_ICMPV6 if packet::is_icmp_error(protocol, l4[0]) => Kind::Nothing,
        _ => Kind::Prohibited,
    }
}

/// The reset answering an IPv4 segment whose TCP header's first 20 bytes are `tcp`, with
/// `payload` bytes of data after the header: written into
/// `out[..RESET_V4_LEN]`, both checksums zero — the IP header's over `out[..20]`, TCP's over
/// [`pseudo_v4`] and `out[20..40]`.
pub fn reset_v4(tcp: &[u8; 20], payload: u16, ends: &Ends, out: &mut [u8]) {
    ipv4_header(out, RESET_V4_LEN as u16, PROTO_TCP, ends);
    reset(&mut out[L4_V4..L4_V4 + 20], tcp, payload, ends);
}

/// The "administratively prohibited" answering the IPv4 packet `ip` (its header) with `l4`
/// (the first 8 bytes after it): written into `out[..PROHIBITED_V4_LEN]`, both checksums zero
/// — the IP header's over `out[..20]`, ICMP's over `out[20..56]`. The quote is the packet as
/// its sender sent it, to `ends.local`.
pub fn prohibited_v4(ip: &[u8; 20], l4: &[u8; 8], ends: &Ends, out: &mut [u8]) {
    ipv4_header(out, PROHIBITED_V4_LEN as u16, PROTO_ICMP, ends);
    out[20] = ICMP_UNREACHABLE;
    out[21] = ICMP_PROHIBITED;
    out[22..28].fill(0);
    let quote = &mut out[28..PROHIBITED_V4_LEN];
    quote[..20].copy_from_slice(ip);
    quote[20..].copy_from_slice(l4);
    let checksum = u16::from_ne_bytes([quote[10], quote[11]]);
    let checksum = internet_checksum::replace4(
        checksum,
        [quote[12], quote[13], quote[14], quote[15]],
        ends.remote.ipv4_octets(),
    );
    let checksum = internet_checksum::replace4(
        checksum,
        [quote[16], quote[17], quote[18], quote[19]],
        ends.local.ipv4_octets(),
    );
    quote[10..12].copy_from_slice(&checksum.to_ne_bytes());
    quote[12..16].copy_from_slice(&ends.remote.ipv4_octets());
    quote[16..20].copy_from_slice(&ends.local.ipv4_octets());
    quote_ports(&mut quote[20..], ip[9], ends);
}

/// The reset answering an IPv6 segment whose TCP header's first 20 bytes are `tcp`: written into `out[..RESET_V6_LEN]`,
/// its checksum zero — TCP's over [`pseudo_v6`] and `out[40..60]`.
pub fn reset_v6(tcp: &[u8; 20], payload: u16, ends: &Ends, out: &mut [u8]) {
    ipv6_header(out, 20, PROTO_TCP, ends);
    reset(&mut out[L4_V6..L4_V6 + 20], tcp, payload, ends);
}

/// The ICMPv6 "administratively prohibited" answering the IPv6 packet `ip` with `l4`: written
/// into `out[..PROHIBITED_V6_LEN]`, its checksum zero — over [`pseudo_v6`] and
/// `out[40..96]`.
pub fn prohibited_v6(ip: &[u8; 40], l4: &[u8; 8], ends: &Ends, out: &mut [u8]) {
    ipv6_header(out, (PROHIBITED_V6_LEN - L4_V6) as u16, PROTO_ICMPV6, ends);
    out[40] = ICMPV6_UNREACHABLE;
    out[41] = ICMPV6_PROHIBITED;
    out[42..48].fill(0);
    let quote = &mut out[48..PROHIBITED_V6_LEN];
    quote[..40].copy_from_slice(ip);
    quote[40..].copy_from_slice(l4);
    quote[8..24].copy_from_slice(&ends.remote.bytes);
    quote[24..40].copy_from_slice(&ends.local.bytes);
    quote_ports(&mut quote[40..], ip[6], ends);
}

/// The IPv4 pseudo-header of an answer's L4 checksum, into `out[..12]`.
pub fn pseudo_v4(ends: &Ends, protocol: u8, length: u16, out: &mut [u8]) {
    out[..4].copy_from_slice(&ends.local.ipv4_octets());
    out[4..8].copy_from_slice(&ends.remote.ipv4_octets());
    out[8] = 0;
    out[9] = protocol;
    out[10..12].copy_from_slice(&length.to_be_bytes());
}

/// The IPv6 pseudo-header of an answer's L4 checksum, into `out[..40]`.
pub fn pseudo_v6(ends: &Ends, protocol: u8, length: u16, out: &mut [u8]) {
    out[..16].copy_from_slice(&ends.local.bytes);
    out[16..32].copy_from_slice(&ends.remote.bytes);
    out[32..34].fill(0);
    out[34..36].copy_from_slice(&length.to_be_bytes());
    out[36..39].fill(0);
    out[39] = protocol;
}

fn ipv4_header(out: &mut [u8], total: u16, protocol: u8, ends: &Ends) {
    out[0] = 0x45;
    out[1] = 0;
    out[2..4].copy_from_slice(&total.to_be_bytes());
    // Identification 0, don't fragment.
    out[4..8].copy_from_slice(&[0, 0, 0x40, 0]);
    out[8] = TTL;
    out[9] = protocol;
    out[10..12].fill(0);
    out[12..16].copy_from_slice(&ends.local.ipv4_octets());
    out[16..20].copy_from_slice(&ends.remote.ipv4_octets());
}

fn ipv6_header(out: &mut [u8], payload: u16, next: u8, ends: &Ends) {
    out[..4].copy_from_slice(&[0x60, 0, 0, 0]);
    out[4..6].copy_from_slice(&payload.to_be_bytes());
    out[6] = next;
    out[7] = TTL;
    out[8..24].copy_from_slice(&ends.local.bytes);
    out[24..40].copy_from_slice(&ends.remote.bytes);
}

/// A reset with ACK of everything the segment `tcp` (with `payload` bytes of data) sent: its
/// SYN counts one.
fn reset(out: &mut [u8], tcp: &[u8; 20], payload: u16, ends: &Ends) {
    let sequence = u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]);
    let acknowledged = sequence.wrapping_add(1).wrapping_add(u32::from(payload));
    out[..2].copy_from_slice(&ends.local_port.to_ne_bytes());
    out[2..4].copy_from_slice(&ends.remote_port.to_ne_bytes());
    out[4..8].fill(0);
    out[8..12].copy_from_slice(&acknowledged.to_be_bytes());
    out[12] = 5 << 4;
    out[13] = TCP_RST_ACK;
    out[14..20].fill(0);
}

/// The ports of the quoted packet as its sender sent them (to `ends.local`); an ICMP echo's
/// identifier is not a port and stays.
fn quote_ports(l4: &mut [u8], protocol: u8, ends: &Ends) {
    if !matches!(protocol, PROTO_ICMP | PROTO_ICMPV6) {
        l4[..2].copy_from_slice(&ends.remote_port.to_ne_bytes());
        l4[2..4].copy_from_slice(&ends.local_port.to_ne_bytes());
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use super::*;
    use crate::PROTO_UDP;

    /// The internet checksum over `parts` joined, as a receiver computes it (zero: right).
    fn verify(parts: &[&[u8]]) -> u16 {
        let bytes: Vec<u8> = parts.iter().flat_map(|part| part.iter().copied()).collect();
        let sum = bytes
            .chunks(2)
            .map(|pair| u32::from(u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)])))
            .fold(0, internet_checksum::add);
        !internet_checksum::fold(sum)
    }

    /// The checksum of `parts` as a program stores it (in the field's own byte order).
    fn fill(out: &mut [u8], at: usize, parts: &[&[u8]]) {
        let checksum = verify(parts);
        out[at..at + 2].copy_from_slice(&checksum.to_be_bytes());
    }

    fn pseudo4(ends: &Ends) -> [u8; 12] {
        let mut pseudo = [0; 12];
        pseudo_v4(ends, PROTO_TCP, 20, &mut pseudo);
        pseudo
    }

    fn pseudo6(ends: &Ends) -> [u8; 40] {
        let mut pseudo = [0; 40];
        pseudo_v6(ends, PROTO_TCP, 20, &mut pseudo);
        pseudo
    }

    fn v4(a: [u8; 4]) -> Address {
        Address::ipv4(a)
    }

    fn ends_v4() -> Ends {
        Ends {
            local: v4([10, 22, 0, 5]),
            local_port: 389u16.to_be(),
            remote: v4([10, 23, 0, 7]),
            remote_port: 40_000u16.to_be(),
        }
    }

    fn ipv4(protocol: u8, source: [u8; 4], destination: [u8; 4]) -> [u8; 20] {
        let mut ip = [0u8; 20];
        ip[0] = 0x45;
        ip[2..4].copy_from_slice(&60u16.to_be_bytes());
        ip[8] = 63;
        ip[9] = protocol;
        ip[12..16].copy_from_slice(&source);
        ip[16..20].copy_from_slice(&destination);
        let checksum = verify(&[&ip]);
        ip[10..12].copy_from_slice(&checksum.to_be_bytes());
        ip
    }

    fn syn(sequence: u32) -> [u8; 20] {
        let mut tcp = [0u8; 20];
        tcp[..2].copy_from_slice(&40_000u16.to_be_bytes());
        tcp[2..4].copy_from_slice(&389u16.to_be_bytes());
        tcp[4..8].copy_from_slice(&sequence.to_be_bytes());
        tcp[12] = 10 << 4;
        tcp[13] = TCP_SYN;
        tcp
    }

    #[test]
    fn a_connections_opening_gets_a_reset_and_the_rest_a_prohibited() {
        let ip = ipv4(PROTO_TCP, [10, 23, 0, 7], [10, 22, 0, 5]);
        assert_eq!(kind_v4(&ip, &syn(1)), Kind::Reset);
        let mut ack = syn(1);
        ack[13] = TCP_ACK;
        assert_eq!(kind_v4(&ip, &ack), Kind::Prohibited, "a segment mid-stream");
        ack[13] = TCP_RST | TCP_ACK;
        assert_eq!(
            kind_v4(&ip, &ack),
            Kind::Nothing,
            "a reset is never answered"
        );
        let udp = ipv4(PROTO_UDP, [10, 23, 0, 7], [10, 22, 0, 5]);
        assert_eq!(kind_v4(&udp, &[0; 20]), Kind::Prohibited);
        let icmp = ipv4(PROTO_ICMP, [10, 23, 0, 7], [10, 22, 0, 5]);
        let mut echo = [0u8; 20];
        echo[0] = 8;
        assert_eq!(kind_v4(&icmp, &echo), Kind::Prohibited);
        echo[0] = 3;
        assert_eq!(kind_v4(&icmp, &echo), Kind::Nothing, "an ICMP error");
        let multicast = ipv4(PROTO_UDP, [10, 23, 0, 7], [224, 0, 0, 251]);
        assert_eq!(kind_v4(&multicast, &[0; 20]), Kind::Nothing);
        let mut later = udp;
        later[7] = 8;
        assert_eq!(kind_v4(&later, &[0; 20]), Kind::Nothing, "a later fragment");
        let mut options = udp;
        options[0] = 0x46;
        assert_eq!(kind_v4(&options, &[0; 20]), Kind::Nothing);
    }

    #[test]
    fn an_ipv4_reset_acknowledges_the_syn_from_the_address_it_was_sent_to() {
        let ends = ends_v4();
        let mut out = [0u8; ANSWER_MAX];
        reset_v4(&syn(0xffff_fffe), 0, &ends, &mut out);
        let out = &mut out[..RESET_V4_LEN];
        let header = out[..20].to_vec();
        fill(out, IPV4_CHECKSUM, &[&header]);
        let segment = out[L4_V4..].to_vec();
        fill(out, L4_V4 + TCP_CHECKSUM, &[&pseudo4(&ends), &segment]);
        assert_eq!(verify(&[&out[..20]]), 0, "IP header checksum");
        assert_eq!(verify(&[&pseudo4(&ends), &out[20..]]), 0, "TCP checksum");
        assert_eq!(
            &out[12..16],
            &[10, 22, 0, 5],
            "from the address it was sent to"
        );
        assert_eq!(&out[16..20], &[10, 23, 0, 7]);
        assert_eq!(u16::from_be_bytes([out[20], out[21]]), 389);
        assert_eq!(u16::from_be_bytes([out[22], out[23]]), 40_000);
        assert_eq!(&out[28..32], &0xffff_ffffu32.to_be_bytes(), "the SYN's one");
        assert_eq!(out[33], TCP_RST_ACK);
    }

    #[test]
    fn an_ipv4_prohibited_quotes_the_packet_as_its_sender_sent_it() {
        // Translated to the container already: the quote names the hostPort again.
        let translated = ipv4(PROTO_UDP, [10, 23, 0, 7], [10, 22, 0, 9]);
        let mut udp = [0u8; 8];
        udp[..2].copy_from_slice(&40_000u16.to_be_bytes());
        udp[2..4].copy_from_slice(&53u16.to_be_bytes());
        let ends = Ends {
            local: v4([203, 0, 113, 1]),
            local_port: 8053u16.to_be(),
            ..ends_v4()
        };
        let mut out = [0u8; ANSWER_MAX];
        prohibited_v4(&translated, &udp, &ends, &mut out);
        let out = &out[..PROHIBITED_V4_LEN];
        assert_eq!((out[20], out[21]), (3, 13));
        let quote = &out[28..];
        assert_eq!(&quote[16..20], &[203, 0, 113, 1]);
        assert_eq!(
            verify(&[&quote[..20]]),
            0,
            "the quoted header's checksum holds"
        );
        assert_eq!(u16::from_be_bytes([quote[22], quote[23]]), 8053);
        assert_eq!(u16::from_be_bytes([quote[20], quote[21]]), 40_000);
    }

    #[test]
    fn ipv6_answers_carry_their_pseudo_header() {
        let mut ip = [0u8; 40];
        ip[0] = 0x60;
        ip[4..6].copy_from_slice(&20u16.to_be_bytes());
        ip[6] = PROTO_TCP;
        ip[7] = 64;
        ip[8] = 0xfd;
        ip[24] = 0xfd;
        ip[39] = 5;
        let ends = Ends {
            local: Address::from_bytes([0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5]),
            local_port: 389u16.to_be(),
            remote: Address::from_bytes([0xfd; 16]),
            remote_port: 40_000u16.to_be(),
        };
        assert_eq!(kind_v6(&ip, &syn(7)), Kind::Reset);
        let mut out = [0u8; ANSWER_MAX];
        reset_v6(&syn(7), 0, &ends, &mut out);
        let segment = out[L4_V6..RESET_V6_LEN].to_vec();
        fill(&mut out, L4_V6 + TCP_CHECKSUM, &[&pseudo6(&ends), &segment]);
        assert_eq!(verify(&[&pseudo6(&ends), &out[L4_V6..RESET_V6_LEN]]), 0);
        assert_eq!(&out[8..24], &ends.local.bytes);
        let mut hop_by_hop = ip;
        hop_by_hop[6] = 0;
        assert_eq!(kind_v6(&hop_by_hop, &syn(7)), Kind::Nothing);
        let mut multicast = ip;
        multicast[24] = 0xff;
        assert_eq!(kind_v6(&multicast, &syn(7)), Kind::Nothing);
        let mut out = [0u8; ANSWER_MAX];
        prohibited_v6(&ip, &[0; 8], &ends, &mut out);
        assert_eq!((out[40], out[41]), (1, 1));
        assert_eq!(
            &out[48 + 24..48 + 40],
            &ends.local.bytes,
            "the quote's destination"
        );
    }
}
