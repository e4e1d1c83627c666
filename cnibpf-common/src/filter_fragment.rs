//! `filter_fragments`: fragmented datagrams whose first fragment the filter let through.
//!
//! Key: [`FilterFragmentKey`] — the attachment's host-side ifindex, the datagram's addresses,
//! protocol and identification. Value: `u64` owner id of the attachment. Written by the
//! programs when a first fragment (which carries the ports the rules look at) passes a filtered
//! attachment; read for the later fragments, which pass only when their first did (a later
//! fragment that overtakes its first is dropped). An LRU map; entries of an attachment are
//! deleted by the CNI plugin on DEL and GC.

use crate::impl_pod;

pub const MAP_NAME: &str = "filter_fragments";
pub const MAX_ENTRIES: u32 = 4_096;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FilterFragmentKey {
    pub src_addr: [u8; 16],
    pub dst_addr: [u8; 16],
    /// IPv4 identification (16 bits) or IPv6 fragment identification, as on the wire.
    pub id: u32,
    pub ifindex: u32,
    pub protocol: u8,
    pub family: u8,
    pub _pad: [u8; 6],
}
const _: () = assert!(size_of::<FilterFragmentKey>() == 48);

impl_pod!(FilterFragmentKey);
