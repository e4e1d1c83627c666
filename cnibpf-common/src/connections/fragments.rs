//! `fragments`: the ports of fragmented datagrams, for their later fragments, which carry none.
//!
//! Key: [`FragmentKey`] — the datagram's addresses as a hook sees them, its protocol and its
//! identification. Value: [`FirstFragment`] — the ports its first fragment carried there, when
//! that was seen, and whether the filter let it through each way. Written by every TC program
//! that parses a first fragment (and, where a translation changed the addresses, by the filter
//! under the translated ones); read when a later fragment is parsed, which then takes the path a
//! whole datagram of its flow takes, its transport header left alone. An LRU map describing
//! datagrams in flight, not attachments: no owner, nothing for DEL to remove; an entry older
//! than [`TIMEOUT_NS`] (the kernel's reassembly time) describes no datagram any more.

use crate::map_spec::{Dimension, MapKind, MapSpec, Sizing};
use crate::{address::Address, impl_pod};

pub const FRAGMENTS: MapSpec =
    MapSpec::new::<FragmentKey, FirstFragment>("fragments", MapKind::LruHash, 8_192)
        .sized(Sizing::Over(Dimension::Flows, 8));

/// How long the fragments of one datagram may keep coming after its first (the kernel's
/// `ipfrag_time`, 30 s).
pub const TIMEOUT_NS: u64 = 30_000_000_000;

/// [`FirstFragment::passed`] bits: the filter let the first fragment through, as egress (what
/// a container sends) or as ingress (what it receives). A datagram between two containers
/// passes one filter each way under the same addresses.
pub const PASSED_EGRESS: u8 = 1;
pub const PASSED_INGRESS: u8 = 2;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragmentKey {
    pub src_addr: Address,
    pub dst_addr: Address,
    /// IPv4 identification (16 bits) or IPv6 fragment identification, as on the wire.
    pub id: u32,
    pub protocol: u8,
    pub family: u8,
    pub _pad: u16,
}
const _: () = assert!(size_of::<FragmentKey>() == 40);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FirstFragment {
    /// CLOCK_MONOTONIC (coarse) when the first fragment was seen.
    pub seen_ns: u64,
    /// Host byte order (an ICMP echo: its identifier in the place of the side that chose it).
    pub src_port: u16,
    pub dst_port: u16,
    /// `PASSED_*` bits.
    pub passed: u8,
    pub _pad: u8,
    pub _pad2: u16,
}
const _: () = assert!(size_of::<FirstFragment>() == 16);

impl FirstFragment {
    /// Whether the entry still describes a datagram whose fragments may be arriving.
    pub const fn is_live(&self, now_ns: u64) -> bool {
        now_ns.saturating_sub(self.seen_ns) <= TIMEOUT_NS
    }
}

impl_pod!(FragmentKey, FirstFragment);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_describes_its_datagram_for_the_reassembly_time() {
        let first = FirstFragment {
            seen_ns: 1_000,
            ..FirstFragment::default()
        };
        assert!(first.is_live(1_000 + TIMEOUT_NS));
        assert!(!first.is_live(1_000 + TIMEOUT_NS + 1));
        // A clock read before the entry was written (another CPU) is no expiry.
        assert!(first.is_live(0));
    }
}
