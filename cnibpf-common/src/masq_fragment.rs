//! `masq_fragments`: where the later fragments of a fragmented datagram arriving at an uplink
//! go — a reply to a masqueraded flow, or a datagram to a hostPort.
//!
//! Key: [`FragmentKey`] — the datagram's addresses as it arrives (remote to masquerade or
//! hostPort address), protocol and identification. Value:
//! [`MasqReply`](crate::masq_reply::MasqReply) — the container the datagram's first fragment was
//! translated for. Written by `uplink_ingress` when it translates a first fragment (which
//! carries the ports); read for the later fragments, which carry none. Later fragments that arrive before the first are not
//! translated. An LRU map: entries live as long as fragments of the datagram keep coming.

use crate::impl_pod;

pub const MAP_NAME: &str = "masq_fragments";
pub const MAX_ENTRIES: u32 = 4_096;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragmentKey {
    pub src_addr: [u8; 16],
    pub dst_addr: [u8; 16],
    /// IPv4 identification (16 bits) or IPv6 fragment identification, as on the wire.
    pub id: u32,
    pub protocol: u8,
    pub family: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(size_of::<FragmentKey>() == 40);

impl_pod!(FragmentKey);
