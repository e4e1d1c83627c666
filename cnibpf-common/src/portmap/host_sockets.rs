//! `sock_rev`: translations the socket hooks made, for showing the application the address it
//! asked for.
//!
//! Key: [`SockRevKey`] — (socket cookie, container address and port). Value: [`SockRevValue`] —
//! the hostIP:hostPort the application addressed. Written by the connect and sendmsg hooks;
//! read by recvmsg (the source of UDP replies) and getpeername. An LRU map: entries of closed
//! sockets age out.

use crate::map_spec::{Dimension, MapKind, MapSpec, Sizing};
use crate::{address::Address, impl_pod};

pub const HOST_SOCKETS: MapSpec =
    MapSpec::new::<SockRevKey, SockRevValue>("sock_rev", MapKind::LruHash, 16_384)
        .sized(Sizing::Over(Dimension::Flows, 4));

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevKey {
    pub cookie: u64,
    pub addr: Address,
    pub port: u16,
    pub family: u8,
    pub _pad: u8,
    pub _pad2: u32,
}
const _: () = assert!(size_of::<SockRevKey>() == 32);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRevValue {
    pub orig_addr: Address,
    pub orig_port: u16,
    pub _pad: u16,
    pub _pad2: u32,
}
const _: () = assert!(size_of::<SockRevValue>() == 24);

impl_pod!(SockRevKey, SockRevValue);
