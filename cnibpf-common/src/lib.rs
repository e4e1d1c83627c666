//! Map key and value types shared by the cnibpf eBPF programs and userspace.
//!
//! One module per map. Every type is `#[repr(C)]` with explicit padding so both sides agree on
//! the bytes, and so that bpftool prints named fields from the BTF the eBPF object carries.
//! Addresses are stored as 16 bytes: an IPv4 address occupies the first four bytes, the rest is
//! zero, and a `family` field says which it is. Ports are in host byte order, so that
//! `bpftool map dump` shows them as people write them; the programs convert when they compare.
//!
//! A module's `MAX_ENTRIES` is the size the object declares. For the maps that grow with the
//! node — flows, attachments, hostPorts — it is the default: the loader sizes them from the
//! operator's `maxFlows`, `maxAttachments` and `maxHostPorts` (userspace
//! `backend::ebpf::sizes`), so a pinned map may have another size.
#![no_std]

#[cfg(feature = "user")]
pub mod addr;
pub mod address;
pub mod connection;
pub mod conntrack;
pub mod drop_event_budget;
pub mod drop_stats;
pub mod endpoint;
pub mod filter;
pub mod filter_event;
pub mod filter_hits;
pub mod filter_stats;
pub mod fragment;
pub mod host_addr;
pub mod internet_checksum;
pub mod layout;
pub mod masq_exclude;
pub mod masq_reply;
pub mod masq_source;
pub mod masq_stats;
pub mod owner;
pub mod owner_port;
pub mod packet;
pub mod port_claim;
pub mod port_condition;
pub mod portmap;
#[cfg(feature = "user")]
pub mod retired_flows;
pub mod sctp_checksum;
pub mod settings;
pub mod sock_rev;
pub mod source;
pub mod source_drop;
pub mod uplink;

/// `AF_INET`, as stored in the `family` field of keys.
pub const FAMILY_IPV4: u8 = 2;
/// `AF_INET6`, as stored in the `family` field of keys.
pub const FAMILY_IPV6: u8 = 10;

/// IANA protocol numbers used in keys.
pub const PROTO_ICMP: u8 = 1;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_ICMPV6: u8 = 58;
pub const PROTO_SCTP: u8 = 132;

/// Implements `aya::Pod` for a map type on the userspace side.
macro_rules! impl_pod {
    ($($ty:ty),+ $(,)?) => {
        $(
            #[cfg(feature = "user")]
            // SAFETY: the type is `repr(C)`, `Copy`, made of integers and byte arrays only, with
            // every padding byte spelled out as a field, so any bit pattern is a valid value.
            unsafe impl aya::Pod for $ty {}
        )+
    };
}
pub(crate) use impl_pod;
