//! Per-CPU scratch space of the programs: what a call chain needs that would push it past the
//! verifier's 512-byte stack. One packet is handled at a time per CPU, so each program finds
//! its slot free. The maps holding these are in `super`, private to each loaded object.

use cnibpf_common::{
    filter_flow::FilterFlowKey, masq_reply::MasqReply, masq_source::MasqSource,
    nat_flow::NatFlowKey,
};

/// The filter's view of the packet at hand, and the state of its rule search. Kept in the
/// per-CPU `filter_scratch` map: on the stack it would push call chains past the verifier's
/// 512 bytes. One packet is judged at a time per CPU.
#[repr(C)]
pub struct Subject {
    /// The packet's connection, the container's side first.
    pub key: FilterFlowKey,
    /// Source and destination as the rules name them, as 32-bit words.
    pub source: [u32; 4],
    pub destination: [u32; 4],
    pub now: u64,
    pub bytes: u32,
    /// Host byte order.
    pub source_port: u16,
    pub destination_port: u16,
    /// `DIRECTION_*` of the packet.
    pub direction: u8,
    /// TCP flags, zero for other protocols.
    pub flags: u8,
    /// Answers of the rule search: the first rule matching a connection's first packet and
    /// its later ones (positions, `RULE_DEFAULT` when none).
    pub new: u16,
    pub established: u16,
}

/// What `masquerade::established` found of a container packet's source, for
/// `masquerade::from_container`, which runs after the hostPort checks (`masquerade_scratch`):
/// carried by the hook, the answer would make the verifier walk those checks once for each.
pub struct MasqueradedSource {
    /// The `masq_sources` entry of the source address, when `found` is [`SOURCE_FOUND`].
    pub source: MasqSource,
    /// `SOURCE_*`.
    pub found: u32,
}

/// [`MasqueradedSource::found`]: the source is not masqueraded through the interface at hand.
pub const SOURCE_NOT_MASQUERADED: u32 = 0;
/// It is, as `source` says.
pub const SOURCE_FOUND: u32 = 1;
/// The endpoint's record says its traffic is masqueraded, and `masq_sources` was not asked.
pub const SOURCE_NOT_LOOKED_UP: u32 = 2;

/// The state of a search for a free masquerade port (`port_search`).
pub struct PortSearch {
    /// The reply tuple of the flow; its destination port is the candidate.
    pub reverse: NatFlowKey,
    /// The `masq_replies` entry the flow gets.
    pub reply: MasqReply,
    pub span: u32,
    pub low: u16,
    /// Non-zero once `reverse` is claimed.
    pub claimed: u8,
}

/// An ICMP error quoting a TCP, UDP or ICMP echo packet, read with `bpf_skb_load_bytes`
/// (the quoted packet need not be in the linear area). Kept in the per-CPU
/// `icmp_error_scratch` map: on the stack it would push the call chain past 512 bytes.
pub struct IcmpError {
    pub family: u8,
    /// Offset of the ICMP header.
    pub icmp_off: usize,
    /// Offset of the quoted IP header.
    pub inner_off: usize,
    /// Offset of the quoted L4 header.
    pub inner_l4_off: usize,
    pub inner_protocol: u8,
    /// The error's own destination.
    pub daddr: [u8; 16],
    pub inner_saddr: [u8; 16],
    pub inner_daddr: [u8; 16],
    /// Network byte order; an echo's identifier as its source port.
    pub inner_sport: u16,
    pub inner_dport: u16,
}

/// How a flow translated to a hostPort was addressed, kept between its translation and the
/// record of the flow, which waits until the packet was handed over (a dropped packet leaves no
/// state).
pub struct Translation {
    /// The attachment owning the mapping.
    pub owner: u64,
    /// The hostIP the client sent to.
    pub original_addr: [u8; 16],
    /// The client's own address.
    pub client_addr: [u8; 16],
    /// The hostPort, network byte order.
    pub original_port: u16,
    /// The client's own port, network byte order.
    pub client_port: u16,
    /// For hairpin traffic, the client container's host-side veth; zero: replies are routed.
    pub reply_ifindex: u32,
    pub client_mac: [u8; 6],
    pub gateway_mac: [u8; 6],
}
