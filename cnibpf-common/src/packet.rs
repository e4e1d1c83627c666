//! Not a map: what the programs decide from a packet's header fields alone — where a fragment
//! stands in its datagram, which ICMP messages are errors, echoes or link-local control, the
//! ports a masqueraded flow may take — kept here to be unit-tested on the host.

use crate::{PROTO_ICMP, PROTO_ICMPV6};

/// Where a packet stands in its datagram.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fragment {
    Whole = 0,
    /// The first fragment, which carries the L4 header.
    First,
    /// A later fragment: no L4 header, so no ports; only addresses can be rewritten.
    Later,
}

impl Fragment {
    /// From IPv4's flags and fragment offset (the header's bytes 6 and 7, host byte order).
    #[inline(always)]
    pub const fn of_ipv4(flags_and_offset: u16) -> Self {
        const OFFSET: u16 = 0x1fff;
        const MORE_FRAGMENTS: u16 = 0x2000;
        if flags_and_offset & OFFSET != 0 {
            Self::Later
        } else if flags_and_offset & MORE_FRAGMENTS != 0 {
            Self::First
        } else {
            Self::Whole
        }
    }

    /// From an IPv6 fragment header's offset and M flag (its bytes 2 and 3, host byte order).
    /// A fragment header with neither (an atomic fragment, RFC 6946) is a whole datagram.
    #[inline(always)]
    pub const fn of_ipv6(offset_and_more: u16) -> Self {
        if offset_and_more >> 3 != 0 {
            Self::Later
        } else if offset_and_more & 1 != 0 {
            Self::First
        } else {
            Self::Whole
        }
    }
}

/// Whether an ICMP (`protocol` [`PROTO_ICMP`]) or ICMPv6 message is an error quoting the
/// packet it is about: destination unreachable (fragmentation needed included), time
/// exceeded, parameter problem; for ICMPv6 also packet too big.
#[inline(always)]
pub const fn is_icmp_error(protocol: u8, icmp_type: u8) -> bool {
    match protocol {
        PROTO_ICMP => matches!(icmp_type, 3 | 11 | 12),
        PROTO_ICMPV6 => matches!(icmp_type, 1..=4),
        _ => false,
    }
}

/// Whether the message is an echo request (ping), whose identifier plays its source port.
#[inline(always)]
pub const fn is_echo_request(protocol: u8, icmp_type: u8) -> bool {
    matches!((protocol, icmp_type), (PROTO_ICMP, 8) | (PROTO_ICMPV6, 128))
}

/// Whether the message is an echo reply, whose identifier plays its destination port.
#[inline(always)]
pub const fn is_echo_reply(protocol: u8, icmp_type: u8) -> bool {
    matches!((protocol, icmp_type), (PROTO_ICMP, 0) | (PROTO_ICMPV6, 129))
}

/// Whether an ICMPv6 message is link-local control a filter always passes: multicast listener
/// discovery (130–132, 143), router and neighbour discovery and redirect (133–137).
#[inline(always)]
pub const fn is_icmpv6_link_control(icmp_type: u8) -> bool {
    matches!(icmp_type, 130..=137 | 143)
}

/// The first port and the number of ports a new masqueraded flow's port is chosen from: the
/// class of its own (below 512, below 1024, the rest), as the kernel's NAT keeps it; any
/// identifier but 0 for an ICMP echo.
#[inline(always)]
pub const fn masquerade_port_range(protocol: u8, original: u16) -> (u16, u32) {
    if protocol == PROTO_ICMP || protocol == PROTO_ICMPV6 {
        (1, 65_535)
    } else if original < 512 {
        (1, 511)
    } else if original < 1024 {
        (600, 424)
    } else {
        (1024, 64_512)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{PROTO_TCP, PROTO_UDP};

    #[test]
    fn ipv4_fragments_are_told_by_offset_then_more_fragments() {
        assert_eq!(Fragment::of_ipv4(0), Fragment::Whole);
        // Don't fragment alone.
        assert_eq!(Fragment::of_ipv4(0x4000), Fragment::Whole);
        assert_eq!(Fragment::of_ipv4(0x2000), Fragment::First);
        assert_eq!(Fragment::of_ipv4(0x2000 | 185), Fragment::Later);
        // The last fragment: an offset, no more fragments.
        assert_eq!(Fragment::of_ipv4(185), Fragment::Later);
    }

    #[test]
    fn ipv6_fragments_are_told_by_offset_then_the_m_flag() {
        assert_eq!(Fragment::of_ipv6(0), Fragment::Whole);
        assert_eq!(Fragment::of_ipv6(1), Fragment::First);
        assert_eq!(Fragment::of_ipv6((185 << 3) | 1), Fragment::Later);
        assert_eq!(Fragment::of_ipv6(185 << 3), Fragment::Later);
        // The two reserved bits say nothing.
        assert_eq!(Fragment::of_ipv6(0b110), Fragment::Whole);
    }

    #[test]
    fn errors_echoes_and_control_are_told_apart_per_version() {
        for error in [3, 11, 12] {
            assert!(is_icmp_error(PROTO_ICMP, error));
        }
        for error in 1..=4 {
            assert!(is_icmp_error(PROTO_ICMPV6, error));
        }
        assert!(!is_icmp_error(PROTO_ICMP, 4) && !is_icmp_error(PROTO_ICMPV6, 128));
        assert!(!is_icmp_error(PROTO_UDP, 3));
        assert!(is_echo_request(PROTO_ICMP, 8) && is_echo_request(PROTO_ICMPV6, 128));
        assert!(is_echo_reply(PROTO_ICMP, 0) && is_echo_reply(PROTO_ICMPV6, 129));
        assert!(!is_echo_request(PROTO_ICMPV6, 8) && !is_echo_reply(PROTO_ICMPV6, 0));
        assert!(!is_echo_request(PROTO_TCP, 8));
        for control in [130, 133, 135, 136, 137, 143] {
            assert!(is_icmpv6_link_control(control));
        }
        assert!(!is_icmpv6_link_control(128) && !is_icmpv6_link_control(138));
    }

    #[test]
    fn a_masqueraded_port_stays_in_its_class() {
        for (original, range) in [
            (53, (1, 511)),
            (511, (1, 511)),
            (512, (600, 424)),
            (1023, (600, 424)),
            (1024, (1024, 64_512)),
            (65_535, (1024, 64_512)),
        ] {
            let (low, span) = masquerade_port_range(PROTO_UDP, original);
            assert_eq!((low, span), range, "port {original}");
            assert!(u32::from(low) + span - 1 <= 65_535);
        }
        assert_eq!(masquerade_port_range(PROTO_ICMP, 7), (1, 65_535));
        assert_eq!(masquerade_port_range(PROTO_ICMPV6, 7), (1, 65_535));
    }
}
