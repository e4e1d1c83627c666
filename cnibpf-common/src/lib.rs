//! The datapath's state, shared by the cnibpf eBPF programs and userspace: one module per
//! capability — port mapping, masquerade, the filter, the source check, connection tracking,
//! the endpoints — holding its maps' keys, values and [`map_spec::MapSpec`]s, and what the
//! datapath as a whole keeps (drops, layout, settings).
//!
//! Every type is `#[repr(C)]` with explicit padding so both sides agree on the bytes, and so
//! that bpftool prints named fields from the BTF the eBPF object carries. Addresses are
//! [`address::Address`], 16 bytes aligned to a word; an IPv4 address occupies the first four
//! bytes, and a `family` field says which it is. Ports are in host byte order, so that
//! `bpftool map dump` shows them as people write them; the programs convert when they compare.
//!
//! A spec's `max_entries` is the size the object declares. For the maps that grow with the
//! node — flows, attachments, hostPorts — it is the default: the loader sizes them by their
//! [`map_spec::Sizing`] from the operator's `maxFlows`, `maxAttachments` and `maxHostPorts`, so
//! a pinned map may have another size.
#![no_std]

#[cfg(feature = "user")]
pub mod addr;
pub mod address;
pub mod connections;
pub mod datapath;
pub mod drops;
pub mod endpoints;
pub mod filter;
pub mod internet_checksum;
pub mod map_spec;
pub mod masquerade;
pub mod packet;
pub mod portmap;
pub mod rejection;
pub mod sctp_checksum;
pub mod sources;

use map_spec::MapSpec;

/// Every pinned map, by capability.
pub const CAPABILITIES: [&[MapSpec]; 8] = [
    &portmap::MAPS,
    &masquerade::MAPS,
    &filter::MAPS,
    &sources::MAPS,
    &connections::MAPS,
    &endpoints::MAPS,
    &drops::MAPS,
    &datapath::MAPS,
];

/// Every pinned map.
pub fn maps() -> impl Iterator<Item = &'static MapSpec> {
    CAPABILITIES.iter().flat_map(|maps| maps.iter())
}

/// The pinned map named `name`.
pub fn map(name: &str) -> Option<&'static MapSpec> {
    maps().find(|spec| spec.name == name)
}

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
