//! The addresses a source-checked container may send from: [`SourceSet`], held in its host-side
//! interface's `endpoints` record (`EndpointInfo::sources`), so that the packet's one lookup of
//! that record serves the check too.
//!
//! Written by the CNI plugin on ADD (the record replaced whole, from prevResult's addresses and
//! the interface's IPv6 link-local ones; for an attachment that opts out, `sourceCheck: false`,
//! a set marked [`FLAG_UNCHECKED`]), cleared on DEL and GC; read by `from_container`, which
//! drops what the container sends from any other address: an IPv4 or IPv6 source, an ARP
//! sender address, a neighbour advertisement's target. A record whose set is not marked
//! [`FLAG_RECORDED`] is not checked (its attachment was made by a cnibpf without source
//! checks, and is checked from its next ADD).
//!
//! A container attached more than once (eth0 and eth1, one network or several) may send from
//! any of its addresses by any of its interfaces — its routes pick the interface, not the
//! address — so each of its sets admits the addresses of all of its checked attachments: its
//! own first (`own_ipv4_count`, `own_ipv6_count`, valid with [`FLAG_OWN_COUNTED`]), then its
//! siblings'. ADD and DEL of one rewrite the others'.

pub mod drops;

pub use drops::{DROPS, SourceDrops};

use crate::map_spec::MapSpec;

/// The maps of the source check (its sets live in `endpoints`).
pub const MAPS: [MapSpec; 1] = [DROPS];

use crate::{address::Address, impl_pod};

/// Addresses of each family one container may have checked.
pub const MAX_ADDRESSES: usize = 8;

/// `SourceSet::flags`: `sourceCheck: false` — the container may send from any address.
pub const FLAG_UNCHECKED: u32 = 1;
/// `SourceSet::flags`: the set counts its attachment's own addresses apart from its
/// siblings' (a set without it, written before siblings were admitted, holds only its own).
pub const FLAG_OWN_COUNTED: u32 = 2;
/// `SourceSet::flags`: the record holds its interface's set; without it the interface is not
/// checked.
pub const FLAG_RECORDED: u32 = 4;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SourceSet {
    /// Owner id of the attachment.
    pub owner: u64,
    /// How many of `ipv4` are in use.
    pub ipv4_count: u32,
    /// How many of `ipv6` are in use.
    pub ipv6_count: u32,
    /// `FLAG_*`.
    pub flags: u32,
    /// How many of `ipv4`, from the first, are the attachment's own (with `FLAG_OWN_COUNTED`).
    pub own_ipv4_count: u16,
    /// The same of `ipv6`.
    pub own_ipv6_count: u16,
    pub ipv4: [[u8; 4]; MAX_ADDRESSES],
    pub ipv6: [Address; MAX_ADDRESSES],
}
const _: () = assert!(size_of::<SourceSet>() == 24 + 4 * MAX_ADDRESSES + 16 * MAX_ADDRESSES);

impl SourceSet {
    /// Whether the container's sources are checked against this set at all.
    pub fn checks(&self) -> bool {
        self.flags & FLAG_RECORDED != 0 && self.flags & FLAG_UNCHECKED == 0
    }

    /// Whether `addr` is one of the set's IPv4 addresses. Compared as integers, not as
    /// arrays: an array comparison may become a `memcmp` call, which BPF has not.
    pub fn holds_ipv4(&self, addr: [u8; 4]) -> bool {
        let wanted = u32::from_ne_bytes(addr);
        let mut position = 0;
        while position < MAX_ADDRESSES && (position as u32) < self.ipv4_count {
            if u32::from_ne_bytes(self.ipv4[position]) == wanted {
                return true;
            }
            position += 1;
        }
        false
    }

    /// Whether `addr` is one of the set's IPv6 addresses.
    pub fn holds_ipv6(&self, addr: &Address) -> bool {
        let mut position = 0;
        while position < MAX_ADDRESSES && (position as u32) < self.ipv6_count {
            if self.ipv6[position] == *addr {
                return true;
            }
            position += 1;
        }
        false
    }
}

impl_pod!(SourceSet);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_recorded_set_that_is_not_unchecked_checks() {
        let set = |flags| SourceSet {
            flags,
            ..SourceSet::default()
        };
        assert!(
            !set(0).checks(),
            "no set: a record of a build without checks"
        );
        assert!(!set(FLAG_OWN_COUNTED).checks());
        assert!(
            set(FLAG_RECORDED).checks(),
            "a migrated set of an older build"
        );
        assert!(set(FLAG_RECORDED | FLAG_OWN_COUNTED).checks());
        assert!(!set(FLAG_RECORDED | FLAG_UNCHECKED | FLAG_OWN_COUNTED).checks());
    }

    #[test]
    fn a_set_holds_only_the_addresses_it_counts() {
        let mut set = SourceSet {
            ipv4_count: 1,
            ipv6_count: 1,
            ..SourceSet::default()
        };
        set.ipv4[0] = [10, 22, 0, 2];
        set.ipv4[1] = [10, 22, 0, 3];
        set.ipv6[0].bytes[15] = 2;
        assert!(set.holds_ipv4([10, 22, 0, 2]));
        assert!(!set.holds_ipv4([10, 22, 0, 3]), "past the count");
        let mut own6 = [0; 16];
        own6[15] = 2;
        assert!(set.holds_ipv6(&Address::from_bytes(own6)));
        assert!(!set.holds_ipv6(&Address::UNSPECIFIED));
    }
}
