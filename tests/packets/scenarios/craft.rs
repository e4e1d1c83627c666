//! Crafting a row's packets: peers resolved per family, transports, ICMP messages quoting
//! other packets, and the Ethernet frame each hook receives.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use cnibpf_tests::{
    packet::{
        ETH_P_IP, ETH_P_IPV6, ICMP, ICMPV6, SCTP, TCP, UDP, ethernet, icmp, icmpv6, ipv4, ipv6,
        sctp, tcp, udp,
    },
    topology::{
        GATEWAY, GATEWAY6, HOST_UPLINK_ADDR, HOST_UPLINK_ADDR6, OUTSIDE_ADDR, OUTSIDE_ADDR6,
    },
};

use super::{Bench, Hook};
use crate::OUTSIDE_MAC;

/// A place on the simulated host's network, resolved per family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    /// The outside client (`cbt-*-out`).
    Outside,
    /// The host's uplink address.
    Uplink,
    /// The first container, and its neighbour on the bridge.
    C1,
    C2,
    /// The bridge's address: the containers' gateway.
    Gateway,
    /// A server beyond the outside namespace (masquerade's destinations).
    Far,
    /// A destination inside `ipMasqExclude` (192.168.0.0/16, fd00:99::/64 in the areas that
    /// set it).
    Excluded,
    /// An address no one on the simulated host owns.
    Stranger,
    /// An address named by the row itself.
    At(&'static str),
}

/// The transport of a crafted packet.
#[derive(Clone, Copy, Debug)]
pub enum Body {
    /// TCP with these flags.
    Tcp(u8),
    Udp,
    Sctp,
    /// ICMP(v6) echo request; the identifier is the source port.
    EchoRequest,
    /// ICMP(v6) echo reply; the identifier is the destination port.
    EchoReply,
    /// ICMP(v6) destination (port) unreachable quoting a packet.
    Unreachable(&'static Packet),
    /// ICMP fragmentation needed / ICMPv6 packet too big, with the next hop's MTU.
    TooBig(u16, &'static Packet),
}

/// A crafted IPv4 or IPv6 packet between two peers.
#[derive(Clone, Copy, Debug)]
pub struct Packet {
    pub v6: bool,
    pub src: Peer,
    pub sport: u16,
    pub dst: Peer,
    pub dport: u16,
    pub body: Body,
}

/// A packet from `src`:`sport` to `dst`:`dport` (IPv4).
pub const fn v4(src: Peer, sport: u16, dst: Peer, dport: u16, body: Body) -> Packet {
    Packet {
        v6: false,
        src,
        sport,
        dst,
        dport,
        body,
    }
}

/// [`v4`] over IPv6.
pub const fn v6(src: Peer, sport: u16, dst: Peer, dport: u16, body: Body) -> Packet {
    Packet {
        v6: true,
        src,
        sport,
        dst,
        dport,
        body,
    }
}

impl Bench {
    pub fn address(&self, peer: Peer, v6: bool) -> IpAddr {
        let pick = |four: Ipv4Addr, six: Ipv6Addr| {
            if v6 {
                IpAddr::V6(six)
            } else {
                IpAddr::V4(four)
            }
        };
        match peer {
            Peer::Outside => pick(OUTSIDE_ADDR, OUTSIDE_ADDR6),
            Peer::Uplink => pick(HOST_UPLINK_ADDR, HOST_UPLINK_ADDR6),
            Peer::C1 => pick(self.c1.address, self.c1.address6),
            Peer::C2 => pick(self.c2.address, self.c2.address6),
            Peer::Gateway => pick(GATEWAY, GATEWAY6),
            Peer::Far => pick(
                Ipv4Addr::new(198, 51, 100, 9),
                Ipv6Addr::new(0x2001, 0xdb8, 9, 0, 0, 0, 0, 9),
            ),
            Peer::Excluded => pick(
                Ipv4Addr::new(192, 168, 7, 7),
                Ipv6Addr::new(0xfd00, 0x99, 0, 0, 0, 0, 0, 7),
            ),
            Peer::Stranger => pick(
                Ipv4Addr::new(203, 0, 113, 77),
                Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x77),
            ),
            Peer::At(text) => text.parse().expect("a row's address"),
        }
    }

    /// The IP packet of `packet`, without the Ethernet header.
    pub fn ip(&self, packet: &Packet) -> Vec<u8> {
        let (src, dst) = (
            self.address(packet.src, packet.v6),
            self.address(packet.dst, packet.v6),
        );
        let l4 = match packet.body {
            Body::Tcp(flags) => tcp(src, dst, packet.sport, packet.dport, flags, b""),
            Body::Udp => udp(src, dst, packet.sport, packet.dport, b"datagram", true),
            Body::Sctp => sctp(packet.sport, packet.dport, b"chunk"),
            Body::EchoRequest => {
                let [high, low] = packet.sport.to_be_bytes();
                icmp_message(src, dst, Icmp::EchoRequest, [high, low, 0, 1], b"ping")
            }
            Body::EchoReply => {
                let [high, low] = packet.dport.to_be_bytes();
                icmp_message(src, dst, Icmp::EchoReply, [high, low, 0, 1], b"ping")
            }
            Body::Unreachable(about) => {
                icmp_message(src, dst, Icmp::PortUnreachable, [0; 4], &self.ip(about))
            }
            Body::TooBig(mtu, about) => {
                let rest = if packet.v6 {
                    u32::from(mtu).to_be_bytes()
                } else {
                    let [high, low] = mtu.to_be_bytes();
                    [0, 0, high, low]
                };
                icmp_message(src, dst, Icmp::TooBig, rest, &self.ip(about))
            }
        };
        let protocol = match packet.body {
            Body::Tcp(_) => TCP,
            Body::Udp => UDP,
            Body::Sctp => SCTP,
            _ if packet.v6 => ICMPV6,
            _ => ICMP,
        };
        match (src, dst) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => ipv4(src, dst, protocol, &[], (false, 0), &l4),
            (IpAddr::V6(src), IpAddr::V6(dst)) => ipv6(src, dst, protocol, &l4),
            _ => panic!("a row mixes families: {packet:?}"),
        }
    }

    /// The Ethernet frame `packet` arrives in at `hook`.
    pub fn frame(&self, hook: Hook, packet: &Packet) -> Vec<u8> {
        let ethertype = if packet.v6 { ETH_P_IPV6 } else { ETH_P_IP };
        let (dst_mac, src_mac) = match hook {
            Hook::FromContainer => (self.gateway_mac, self.mac_of(packet.src)),
            Hook::ToContainer => (self.mac_of(packet.dst), self.gateway_mac),
            Hook::UplinkIngress => (self.uplink_mac, OUTSIDE_MAC),
            Hook::UplinkEgress => (OUTSIDE_MAC, self.uplink_mac),
        };
        ethernet(dst_mac, src_mac, ethertype, &self.ip(packet))
    }

    fn mac_of(&self, peer: Peer) -> [u8; 6] {
        if peer == Peer::C2 {
            self.macs[1]
        } else {
            self.macs[0]
        }
    }

    /// A frame c1 sends, whatever it holds.
    pub fn c1_frame(&self, ethertype: u16, payload: &[u8]) -> Vec<u8> {
        ethernet(self.gateway_mac, self.macs[0], ethertype, payload)
    }

    /// A frame from outside to the uplink, whatever it holds.
    pub fn outside_frame(&self, ethertype: u16, payload: &[u8]) -> Vec<u8> {
        ethernet(self.uplink_mac, OUTSIDE_MAC, ethertype, payload)
    }

    pub fn c1_mac(&self) -> [u8; 6] {
        self.macs[0]
    }
}

/// The ICMP messages rows craft.
#[derive(Clone, Copy)]
enum Icmp {
    EchoRequest,
    EchoReply,
    PortUnreachable,
    /// IPv4's fragmentation needed, IPv6's packet too big.
    TooBig,
}

/// An ICMP or ICMPv6 message (by the family of `src`) of `kind`, with its checksum.
fn icmp_message(src: IpAddr, dst: IpAddr, kind: Icmp, rest: [u8; 4], quoted: &[u8]) -> Vec<u8> {
    match (src, dst) {
        (IpAddr::V6(src), IpAddr::V6(dst)) => {
            let (kind, code) = match kind {
                Icmp::EchoRequest => (128, 0),
                Icmp::EchoReply => (129, 0),
                Icmp::PortUnreachable => (1, 4),
                Icmp::TooBig => (2, 0),
            };
            icmpv6(src, dst, kind, code, rest, quoted)
        }
        _ => {
            let (kind, code) = match kind {
                Icmp::EchoRequest => (8, 0),
                Icmp::EchoReply => (0, 0),
                Icmp::PortUnreachable => (3, 3),
                Icmp::TooBig => (3, 4),
            };
            icmp(kind, code, rest, quoted)
        }
    }
}
