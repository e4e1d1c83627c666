//! Addresses as keys and values store them (see the crate docs), for userspace: the one place
//! that knows an IPv4 address sits in the first four of sixteen bytes.

use core::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::{FAMILY_IPV4, FAMILY_IPV6};

/// The sixteen bytes that store `addr`.
pub fn to_bytes(addr: IpAddr) -> [u8; 16] {
    match addr {
        IpAddr::V4(addr) => {
            let mut out = [0; 16];
            out[..4].copy_from_slice(&addr.octets());
            out
        }
        IpAddr::V6(addr) => addr.octets(),
    }
}

/// The address `bytes` store, read as `family` says (anything but [`FAMILY_IPV4`] is IPv6).
pub fn from_bytes(bytes: [u8; 16], family: u8) -> IpAddr {
    if family == FAMILY_IPV4 {
        IpAddr::V4(Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3]))
    } else {
        IpAddr::V6(Ipv6Addr::from(bytes))
    }
}

/// The `family` field of a key holding `addr`.
pub fn family_of(addr: IpAddr) -> u8 {
    if addr.is_ipv4() {
        FAMILY_IPV4
    } else {
        FAMILY_IPV6
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip_with_their_family() {
        for text in ["10.22.0.2", "0.0.0.0", "fd00::2", "::ffff:10.0.0.1", "::"] {
            let addr: IpAddr = text.parse().unwrap();
            assert_eq!(from_bytes(to_bytes(addr), family_of(addr)), addr, "{text}");
        }
    }

    #[test]
    fn ipv4_occupies_the_first_four_bytes() {
        let bytes = to_bytes("192.0.2.7".parse().unwrap());
        assert_eq!(bytes[..4], [192, 0, 2, 7]);
        assert_eq!(bytes[4..], [0; 12]);
    }
}
