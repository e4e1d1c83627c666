//! Source address verification: the addresses an attachment's container may send from.

use std::{fmt, net::IpAddr};

/// What an attachment's source check admits: the container's own addresses — prevResult's
/// and its interface's IPv6 link-local ones. Everything it sends from another address (and its
/// ARP and neighbour advertisements for another) is dropped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourceCheck {
    /// Sorted, without repeats.
    pub addresses: Vec<IpAddr>,
}

impl SourceCheck {
    pub fn new(addresses: impl IntoIterator<Item = IpAddr>) -> Self {
        let mut addresses: Vec<IpAddr> = addresses.into_iter().collect();
        addresses.sort_unstable();
        addresses.dedup();
        Self { addresses }
    }
}

impl fmt::Display for SourceCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (position, address) in self.addresses.iter().enumerate() {
            if position > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{address}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_kept_sorted_once_each() {
        let check = SourceCheck::new(
            ["fe80::1", "10.22.0.2", "fd00::2", "10.22.0.2"].map(|text| text.parse().unwrap()),
        );
        assert_eq!(check.to_string(), "10.22.0.2, fd00::2, fe80::1");
    }
}
