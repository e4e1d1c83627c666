//! `nat_fragments`: where the later fragments of a container's fragmented reply to a hostPort
//! flow go.
//!
//! Key: [`FragmentKey`](crate::masq_fragment::FragmentKey) — the reply datagram as the
//! container sends it (container to client), protocol and identification. Value:
//! [`NatFlowValue`](crate::nat_flow::NatFlowValue) — the translation its first fragment (which
//! carries the ports) took from `nat_flows`. Written by `from_container` and `uplink_egress`
//! when they translate a reply's first fragment; read for its later fragments, which carry no
//! ports and get the same addresses. Later fragments that arrive before the first are not
//! translated. An LRU map; the plugin removes an attachment's entries on DEL and GC.

pub const MAP_NAME: &str = "nat_fragments";
pub const MAX_ENTRIES: u32 = 4_096;
