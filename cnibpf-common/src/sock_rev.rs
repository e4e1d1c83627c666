//! `sock_rev`: translations the socket hooks made, for showing the application the address it
//! asked for.
//!
//! Key: [`SockRevKey`] — (socket cookie, container address and port). Value: [`SockRevValue`] —
//! the hostIP:hostPort the application addressed. Written by the connect and sendmsg hooks;
//! read by recvmsg (the source of UDP replies) and getpeername. An LRU map: entries of closed
//! sockets age out.

use crate::{address::Address, impl_pod};

pub const MAP_NAME: &str = "sock_rev";
pub const MAX_ENTRIES: u32 = 16_384;

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
