//! Addresses as keys and values store them ([`Address`]), for userspace: the one place that
//! knows an IPv4 address sits in the first four of sixteen bytes.

use core::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::{FAMILY_IPV4, FAMILY_IPV6, address::Address};

/// The stored form of `addr`.
pub fn to_address(addr: IpAddr) -> Address {
    match addr {
        IpAddr::V4(addr) => Address::ipv4(addr.octets()),
        IpAddr::V6(addr) => Address::from_bytes(addr.octets()),
    }
}

/// The address `stored` holds, read as `family` says (anything but [`FAMILY_IPV4`] is IPv6).
pub fn from_address(stored: Address, family: u8) -> IpAddr {
    if family == FAMILY_IPV4 {
        IpAddr::V4(Ipv4Addr::from(stored.ipv4_octets()))
    } else {
        IpAddr::V6(Ipv6Addr::from(stored.bytes))
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
            assert_eq!(
                from_address(to_address(addr), family_of(addr)),
                addr,
                "{text}"
            );
        }
    }

    #[test]
    fn ipv4_occupies_the_first_four_bytes() {
        let stored = to_address("192.0.2.7".parse().unwrap());
        assert_eq!(stored.bytes[..4], [192, 0, 2, 7]);
        assert_eq!(stored.bytes[4..], [0; 12]);
    }
}
