//! Source address verification: the addresses an attachment's container may send from.

use std::{fmt, net::IpAddr};

/// What an attachment's source check admits: the container's own addresses — prevResult's
/// and its interface's IPv6 link-local ones. Everything it sends from another address (and its
/// ARP and neighbour advertisements for another) is dropped.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
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

    /// What one interface of a container admits: its own addresses, and those of the
    /// container's other checked attachments (`siblings`' own) — replies may leave by any of
    /// its interfaces, whatever address they carry.
    pub fn admitting<'a>(&self, siblings: impl IntoIterator<Item = &'a SourceCheck>) -> Self {
        Self::new(
            self.addresses
                .iter()
                .chain(siblings.into_iter().flat_map(|sibling| &sibling.addresses))
                .copied(),
        )
    }

    /// What each of a container's checked attachments admits when their own addresses are
    /// `owns` and `joining` (one being set up now, if any) joins them: its own and all the
    /// others', in the order of `owns`.
    pub fn each_admitting(owns: &[SourceCheck], joining: Option<&SourceCheck>) -> Vec<Self> {
        owns.iter()
            .enumerate()
            .map(|(position, own)| {
                let others = owns
                    .iter()
                    .enumerate()
                    .filter(|(other, _)| *other != position)
                    .map(|(_, other)| other)
                    .chain(joining);
                own.admitting(others)
            })
            .collect()
    }

    /// How many addresses of each family it holds: (IPv4, IPv6).
    pub fn counts(&self) -> (usize, usize) {
        let ipv4 = self.addresses.iter().filter(|addr| addr.is_ipv4()).count();
        (ipv4, self.addresses.len() - ipv4)
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
    fn an_interface_admits_its_siblings_addresses_once_each() {
        let check = |addresses: &[&str]| {
            SourceCheck::new(addresses.iter().map(|text| text.parse::<IpAddr>().unwrap()))
        };
        let eth0 = check(&["10.22.0.5", "fe80::5"]);
        let eth1 = check(&["10.22.0.6", "fe80::6"]);
        let admitted = eth0.admitting([&eth1, &check(&["10.22.0.5"])]);
        assert_eq!(
            admitted.to_string(),
            "10.22.0.5, 10.22.0.6, fe80::5, fe80::6"
        );
        assert_eq!(admitted.counts(), (2, 2));
        assert_eq!(eth0.admitting([]), eth0, "alone, its own");
        let eth2 = check(&["10.22.0.7"]);
        let all = eth0.admitting([&eth1, &eth2]);
        assert_eq!(
            SourceCheck::each_admitting(&[eth0.clone(), eth1.clone()], Some(&eth2)),
            [all.clone(), all],
            "every attachment admits the same addresses"
        );
        assert_eq!(
            SourceCheck::each_admitting(&[eth0.clone(), eth1.clone()], None),
            [eth0.admitting([&eth1]), eth1.admitting([&eth0])]
        );
    }

    #[test]
    fn addresses_are_kept_sorted_once_each() {
        let check = SourceCheck::new(
            ["fe80::1", "10.22.0.2", "fd00::2", "10.22.0.2"].map(|text| text.parse().unwrap()),
        );
        assert_eq!(check.to_string(), "10.22.0.2, fd00::2, fe80::1");
    }
}
