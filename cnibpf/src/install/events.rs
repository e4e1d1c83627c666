//! What `install --watch` follows of the host beside the conf dir: the host's addresses
//! changing (rtnetlink's address groups: a node address a wildcard hostPort takes, a Service
//! address kube-proxy binds), and cnibpf's nftables tables deleted (netfilter's nftables
//! group, as `nft monitor` follows it: a firewall reload that flushed the ruleset).

use std::{io, os::fd::AsFd};

use netlink_sys::{
    Socket, SocketAddr,
    protocols::{NETLINK_NETFILTER, NETLINK_ROUTE},
};

use crate::nfnetlink::attribute;

/// `RTMGRP_IPV4_IFADDR` and `RTMGRP_IPV6_IFADDR`.
const ADDRESS_GROUPS: u32 = 0x10 | 0x100;
/// `NFNLGRP_NFTABLES`.
const NFTABLES_GROUP: u32 = 7;
/// `NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_DELTABLE`.
const DELETED_TABLE: u16 = 10 << 8 | 2;
const NFTA_TABLE_NAME: u16 = 1;
/// `struct nlmsghdr` and `struct nfgenmsg`.
const NFNETLINK_HEADER: usize = 16 + 4;

/// The two subscriptions, read without blocking.
pub struct HostEvents {
    addresses: Socket,
    tables: Socket,
    buffer: Vec<u8>,
}

impl HostEvents {
    pub fn subscribe() -> io::Result<Self> {
        let mut addresses = Socket::new(NETLINK_ROUTE)?;
        addresses.bind(&SocketAddr::new(0, ADDRESS_GROUPS))?;
        addresses.set_non_blocking(true)?;
        let mut tables = Socket::new(NETLINK_NETFILTER)?;
        tables.bind_auto()?;
        tables.add_membership(NFTABLES_GROUP)?;
        tables.set_non_blocking(true)?;
        Ok(Self {
            addresses,
            tables,
            buffer: Vec::with_capacity(64 * 1024),
        })
    }

    /// The descriptors to wait on: the addresses', the tables'.
    pub fn fds(&self) -> [std::os::fd::BorrowedFd<'_>; 2] {
        [self.addresses.as_fd(), self.tables.as_fd()]
    }

    /// Reads everything queued on both: whether any of it calls for a look at the instance —
    /// an address added or removed, or a table of cnibpf's deleted. Events the kernel dropped
    /// for a full queue (`ENOBUFS`) call for one too: what they said is unknown.
    pub fn drain(&mut self) -> io::Result<bool> {
        let mut look = false;
        loop {
            match receive(&self.addresses, &mut self.buffer) {
                Ok(Some(_)) => look = true,
                Ok(None) => break,
                Err(error) if error.raw_os_error() == Some(libc::ENOBUFS) => look = true,
                Err(error) => return Err(error),
            }
        }
        loop {
            match receive(&self.tables, &mut self.buffer) {
                Ok(Some(length)) => look |= deletes_a_table_of_ours(&self.buffer[..length]),
                Ok(None) => break,
                Err(error) if error.raw_os_error() == Some(libc::ENOBUFS) => look = true,
                Err(error) => return Err(error),
            }
        }
        Ok(look)
    }
}

/// One datagram from `socket` into `buffer`: its length, `None` when nothing is queued.
fn receive(socket: &Socket, buffer: &mut Vec<u8>) -> io::Result<Option<usize>> {
    buffer.clear();
    match socket.recv(buffer, 0) {
        Ok(length) => Ok(Some(length)),
        Err(error) if error.kind() == io::ErrorKind::WouldBlock => Ok(None),
        Err(error) => Err(error),
    }
}

/// Whether the messages in `datagram` delete table `cnibpf` (of any family).
fn deletes_a_table_of_ours(datagram: &[u8]) -> bool {
    let mut rest = datagram;
    while rest.len() >= NFNETLINK_HEADER {
        let length = u32::from_ne_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        if length < 16 || length > rest.len() {
            return false;
        }
        let kind = u16::from_ne_bytes([rest[4], rest[5]]);
        if kind == DELETED_TABLE
            && length >= NFNETLINK_HEADER
            && attribute(&rest[NFNETLINK_HEADER..length], NFTA_TABLE_NAME)
                == Some(b"cnibpf\0".as_slice())
        {
            return true;
        }
        rest = &rest[length.next_multiple_of(4).min(rest.len())..];
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(kind: u16, name: &[u8]) -> Vec<u8> {
        let mut attribute = Vec::new();
        attribute.extend(u16::try_from(4 + name.len()).expect("short").to_ne_bytes());
        attribute.extend(NFTA_TABLE_NAME.to_ne_bytes());
        attribute.extend(name);
        attribute.resize(attribute.len().next_multiple_of(4), 0);
        let length = NFNETLINK_HEADER + attribute.len();
        let mut bytes = Vec::new();
        bytes.extend(u32::try_from(length).expect("short").to_ne_bytes());
        bytes.extend(kind.to_ne_bytes());
        bytes.extend([0; 10]);
        bytes.extend([1, 0, 0, 0]);
        bytes.extend(attribute);
        bytes
    }

    #[test]
    fn only_the_deletion_of_a_table_named_cnibpf_is_ours() {
        assert!(deletes_a_table_of_ours(&message(
            DELETED_TABLE,
            b"cnibpf\0"
        )));
        assert!(!deletes_a_table_of_ours(&message(
            DELETED_TABLE,
            b"filter\0"
        )));
        assert!(
            !deletes_a_table_of_ours(&message(10 << 8, b"cnibpf\0")),
            "a new table"
        );
        let mut two = message(10 << 8 | 3, b"cnibpf\0");
        two.extend(message(DELETED_TABLE, b"cnibpf\0"));
        assert!(deletes_a_table_of_ours(&two));
    }
}
