//! Host processes reaching hostPorts: cgroup sock_addr hooks translate the address a socket of
//! the host namespace connects or sends to (127.0.0.1, ::1, any host address, or a mapping's
//! hostIP) into the container's, and show the application the address it asked for on
//! recvmsg and getpeername. Packets then carry the container address from the start, so
//! loopback needs neither route_localnet nor any packet rewriting. A datagram an unconnected
//! socket sends from a hostPort's number is remembered as a host flow, whose answers are the
//! host's.
//!
//! These hooks never deny: whatever they cannot translate proceeds unchanged.

use core::ptr::{read_volatile, write_volatile};

use aya_ebpf::{
    EbpfContext as _,
    bindings::{BPF_ANY, bpf_sock_addr},
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    programs::SockAddrContext,
};
use cnibpf_common::{
    FAMILY_IPV4, PROTO_UDP,
    address::Address,
    connections::ConnectionKey,
    portmap::{PortMapKey, SockRevKey, SockRevValue},
};

use crate::{maps, portmap};

/// The verdict that lets the syscall proceed.
pub const ALLOW: i32 = 1;

/// connect: a hostPort of this host becomes the container behind it. Inlined into each
/// program, where `family` is a constant: what is left is one family's code, whose context
/// reads and writes the verifier sees at constant offsets.
#[inline(always)]
pub fn to_container(ctx: &SockAddrContext, family: u8) {
    if in_host_namespace(ctx) {
        translate(ctx, family);
    }
}

/// sendmsg (a datagram with a destination: an unconnected UDP socket's): as connect, and the
/// datagram, as it leaves, opens or refreshes a host flow when its source port is a UDP
/// hostPort's number (`portmap::remember_host_datagram`) — conntrack's entry for it, which
/// makes the answers the host's. Inlined as [`to_container`] is.
#[inline(always)]
pub fn datagram_to(ctx: &SockAddrContext, family: u8) {
    if in_host_namespace(ctx) {
        translate(ctx, family);
        remember_host_flow(ctx.sock_addr, family);
    }
}

/// The address the syscall names, when it is a hostPort of this host, becomes the container
/// behind it; the translation is remembered for recvmsg and getpeername.
#[inline(always)]
fn translate(ctx: &SockAddrContext, family: u8) {
    let sock = ctx.sock_addr;
    // SAFETY: sock is the bpf_sock_addr context the kernel handed to this program.
    let protocol = unsafe { read_volatile(&raw const (*sock).protocol) } as u8;
    let (addr, port) = user_address(sock, family);
    let mut key = PortMapKey {
        host_addr: addr,
        host_port: port,
        protocol,
        family,
    };
    let mapping = match maps::portmap.get_ptr(&key) {
        Some(mapping) => mapping,
        None => {
            if !is_loopback(&addr, family) && !maps::is_host_address(&addr, family) {
                return;
            }
            key.host_addr = Address::UNSPECIFIED;
            match maps::portmap.get_ptr(&key) {
                Some(mapping) => mapping,
                None => return,
            }
        }
    };
    // SAFETY: read at once; userspace replaces portmap values whole.
    let mapping = unsafe { &*mapping };
    // A host process comes in on no interface; its source is the address its socket is bound
    // to or, for an unbound one, the local destination itself (which the kernel then picks).
    let bound = bound_address(sock, family);
    let source = if bound == Address::UNSPECIFIED {
        &addr
    } else {
        &bound
    };
    if !portmap::admit(mapping, source, &addr, 0, family) {
        return;
    }
    let (container_addr, container_port) = (mapping.container_addr, mapping.container_port);
    set_user_address(sock, family, &container_addr, container_port);
    let reverse_key = SockRevKey {
        // SAFETY: bpf_get_socket_cookie accepts the sock_addr context.
        cookie: unsafe { bpf_get_socket_cookie(ctx.as_ptr()) },
        addr: container_addr,
        port: container_port,
        family,
        _pad: 0,
        _pad2: 0,
    };
    let original = SockRevValue {
        orig_addr: addr,
        orig_port: port,
        _pad: 0,
        _pad2: 0,
    };
    // A full LRU map evicts the oldest socket's entry; failing here only means the application
    // sees the container address in recvmsg/getpeername, so the connection proceeds regardless.
    let _ = maps::sock_rev.insert(&reverse_key, &original, u64::from(BPF_ANY));
}

/// recvmsg and getpeername: the container address becomes the hostPort the socket asked for
/// (inlined as [`to_container`] is).
#[inline(always)]
pub fn to_host_port(ctx: &SockAddrContext, family: u8) {
    if !in_host_namespace(ctx) {
        return;
    }
    let sock = ctx.sock_addr;
    let (addr, port) = user_address(sock, family);
    let key = SockRevKey {
        // SAFETY: bpf_get_socket_cookie accepts the sock_addr context.
        cookie: unsafe { bpf_get_socket_cookie(ctx.as_ptr()) },
        addr,
        port,
        family,
        _pad: 0,
        _pad2: 0,
    };
    if let Some(original) = maps::sock_rev.get_ptr(&key) {
        // SAFETY: read at once from the entry just looked up.
        let (orig_addr, orig_port) = unsafe { ((*original).orig_addr, (*original).orig_port) };
        set_user_address(sock, family, &orig_addr, orig_port);
    }
}

/// The datagram leaving `sock` (to the destination as translated) as a host flow, if it
/// leaves a UDP socket from a hostPort's number: its source the address the socket is bound
/// to, else the one the sender asked for (`IP_PKTINFO`), else the wildcard.
#[inline(always)]
fn remember_host_flow(sock: *mut bpf_sock_addr, family: u8) {
    // SAFETY: sock is the context; protocol is readable in every sock_addr hook.
    let protocol = unsafe { read_volatile(&raw const (*sock).protocol) } as u8;
    if protocol != PROTO_UDP {
        return;
    }
    let (remote_addr, remote_port) = user_address(sock, family);
    let bound = bound_address(sock, family);
    let container_addr = if bound == Address::UNSPECIFIED {
        message_source(sock, family)
    } else {
        bound
    };
    portmap::remember_host_datagram(&ConnectionKey {
        container_addr,
        remote_addr,
        container_port: local_port(sock),
        remote_port,
        protocol,
        family,
        _pad: 0,
    });
}

/// Only sockets of the host's network namespace are translated: a process in a container
/// connecting to its own 127.0.0.1 means its own loopback.
fn in_host_namespace(ctx: &SockAddrContext) -> bool {
    // SAFETY: bpf_get_netns_cookie accepts the sock_addr context.
    let cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    maps::settings.get(0).is_some_and(|settings| {
        settings.host_netns_cookie != 0 && settings.host_netns_cookie == cookie
    })
}

/// The address and port (host byte order) the syscall names, in the 16-byte map form.
fn user_address(sock: *mut bpf_sock_addr, family: u8) -> (Address, u16) {
    // SAFETY: sock is the context; user_ip4, user_ip6 and user_port are readable in every
    // sock_addr hook, 4 bytes at a time. Volatile reads keep each one a load at a constant
    // offset from the context, the only form the verifier accepts.
    unsafe {
        let port = u16::from_be(read_volatile(&raw const (*sock).user_port) as u16);
        if family == FAMILY_IPV4 {
            (
                Address::ipv4(read_volatile(&raw const (*sock).user_ip4).to_ne_bytes()),
                port,
            )
        } else {
            let words = [
                read_volatile(&raw const (*sock).user_ip6[0]),
                read_volatile(&raw const (*sock).user_ip6[1]),
                read_volatile(&raw const (*sock).user_ip6[2]),
                read_volatile(&raw const (*sock).user_ip6[3]),
            ];
            (Address::from_words(words), port)
        }
    }
}

/// The local address the socket is bound to (all zero when unbound).
fn bound_address(sock: *mut bpf_sock_addr, family: u8) -> Address {
    // SAFETY: `sk` of a sock_addr context is always a valid socket the program may read.
    unsafe {
        let socket = (*sock).__bindgen_anon_1.sk;
        if family == FAMILY_IPV4 {
            Address::ipv4(read_volatile(&raw const (*socket).src_ip4).to_ne_bytes())
        } else {
            Address::from_words([
                read_volatile(&raw const (*socket).src_ip6[0]),
                read_volatile(&raw const (*socket).src_ip6[1]),
                read_volatile(&raw const (*socket).src_ip6[2]),
                read_volatile(&raw const (*socket).src_ip6[3]),
            ])
        }
    }
}

/// The local port of the socket (host byte order; bound by the time sendmsg runs).
fn local_port(sock: *mut bpf_sock_addr) -> u16 {
    // SAFETY: `sk` of a sock_addr context is always a valid socket the program may read.
    unsafe { read_volatile(&raw const (*(*sock).__bindgen_anon_1.sk).src_port) as u16 }
}

/// The source address a sendmsg names (`IP_PKTINFO`, `IPV6_PKTINFO`); all zero when it names
/// none.
fn message_source(sock: *mut bpf_sock_addr, family: u8) -> Address {
    // SAFETY: sock is the context; msg_src_ip4 (sendmsg4) and msg_src_ip6 (sendmsg6) are
    // readable 4 bytes at a time in the sendmsg hook of their family, the only callers.
    unsafe {
        if family == FAMILY_IPV4 {
            Address::ipv4(read_volatile(&raw const (*sock).msg_src_ip4).to_ne_bytes())
        } else {
            Address::from_words([
                read_volatile(&raw const (*sock).msg_src_ip6[0]),
                read_volatile(&raw const (*sock).msg_src_ip6[1]),
                read_volatile(&raw const (*sock).msg_src_ip6[2]),
                read_volatile(&raw const (*sock).msg_src_ip6[3]),
            ])
        }
    }
}

fn set_user_address(sock: *mut bpf_sock_addr, family: u8, addr: &Address, port: u16) {
    // SAFETY: sock is the context; these fields are writable in connect, sendmsg, recvmsg and
    // getpeername hooks, 4 bytes at a time.
    unsafe {
        let [first, second, third, fourth] = addr.words();
        if family == FAMILY_IPV4 {
            write_volatile(&raw mut (*sock).user_ip4, first);
        } else {
            write_volatile(&raw mut (*sock).user_ip6[0], first);
            write_volatile(&raw mut (*sock).user_ip6[1], second);
            write_volatile(&raw mut (*sock).user_ip6[2], third);
            write_volatile(&raw mut (*sock).user_ip6[3], fourth);
        }
        write_volatile(&raw mut (*sock).user_port, u32::from(port.to_be()));
    }
}

fn is_loopback(addr: &Address, family: u8) -> bool {
    if family == FAMILY_IPV4 {
        addr.bytes[0] == 127
    } else {
        *addr == Address::from_words([0, 0, 0, 1u32.to_be()])
    }
}
