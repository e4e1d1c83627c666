//! The FIB's recent answers, per CPU (`next_hops`; see `route`), in slots chosen by a hash of
//! the question: a later question for another slot's flow replaces the answer kept there.
//! Private to each loaded object, not pinned: a new object starts with none.

use cnibpf_common::address::Address;

/// log2 of the slots per CPU.
pub const NEXT_HOP_SLOTS_LOG2: u32 = 8;
pub const NEXT_HOP_SLOTS: u32 = 1 << NEXT_HOP_SLOTS_LOG2;

/// One FIB lookup: what was asked, when, and what the FIB answered.
#[repr(C)]
pub struct NextHop {
    /// The question: the flow's addresses and ports (network byte order), protocol and
    /// family, the interface its packet entered by, and whether the FIB chose the source.
    pub query_source: Address,
    pub query_destination: Address,
    /// `clock::now_ns` of the lookup.
    pub looked_up_ns: u64,
    pub query_ifindex: u32,
    pub query_source_port: u16,
    pub query_destination_port: u16,
    pub query_family: u8,
    pub query_protocol: u8,
    pub query_choose_source: u8,
    pub _pad: u8,
    /// The answer: `bpf_fib_lookup`'s return code (`BPF_FIB_LKUP_RET_*`), and on success or
    /// an unresolved neighbour the output interface; on success the MACs; when the source was
    /// to be chosen, the address the host sends from on that route.
    pub answer: u32,
    pub ifindex: u32,
    /// The MACs as a frame to the neighbour carries them: the neighbour's, then the output
    /// interface's.
    pub frame_macs: [u8; 12],
    pub source: Address,
    /// The output interface's MTU as the MTU check last reported it for this answer, zero
    /// until then.
    pub mtu: u32,
    pub _pad2: u32,
}
const _: () = assert!(size_of::<NextHop>() == 96);
