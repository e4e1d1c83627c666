//! The host a hostPort shares its addresses and port numbers with, asked only of a packet
//! cnibpf has no connection of (the first packet of a connection to a hostPort, or one whose
//! state was lost):
//! - whether its destination is one of the node's own addresses, for a wildcard hostPort: the
//!   addresses the plugin recorded (`host_addrs`), and the one the host answers the packet's
//!   source from, out of the interface the packet came in by — an uplink's new address is
//!   served at its first packet, with no call — as long as the kernel still delivers it
//!   locally; a Service address (kube-proxy's IPVS mode binds them to a dummy interface) is
//!   neither;
//! - whether it belongs to a connection of a host socket: the answer to a connection the host
//!   opened from a port that is a hostPort's number, a held connection's later packet. That
//!   is the host's, as conntrack matches a connection before a DNAT rule. A listening or
//!   unconnected socket on the port does not outrank the hostPort.

use aya_ebpf::{
    EbpfContext as _,
    bindings::{
        BPF_F_CURRENT_NETNS, BPF_TCP_CLOSE, BPF_TCP_LISTEN, BPF_TCP_TIME_WAIT, bpf_sock_tuple,
    },
    helpers::{bpf_sk_lookup_udp, bpf_sk_release, bpf_skc_lookup_tcp},
    programs::TcContext,
};
use cnibpf_common::{FAMILY_IPV4, PROTO_TCP, PROTO_UDP, connections::conntrack};

use crate::{
    maps,
    packet::Flow,
    route::{LOCAL_SOURCE, NOT_LOCAL, local_destination},
};

/// Whether the flow's destination is one of the node's own addresses (see the module).
#[inline(always)]
pub fn is_node_address(ctx: &TcContext, flow: &Flow) -> bool {
    let destination = local_destination(ctx, flow);
    destination == LOCAL_SOURCE
        || destination != NOT_LOCAL && maps::is_host_address(&flow.daddr, flow.family)
}

/// Whether the packet, as it arrived, belongs to a connection of a socket of the host (see
/// the module): TCP, a socket that is neither listening nor closed (for a connection's
/// opening, nor in TIME_WAIT either: a new connection may take a closed one's tuple); UDP, a
/// socket connected to the packet's source.
#[inline(never)]
pub fn owns_connection(ctx: &TcContext, flow: &Flow) -> bool {
    if flow.protocol != PROTO_TCP && flow.protocol != PROTO_UDP {
        return false;
    }
    // SAFETY: bpf_sock_tuple is plain old data; all-zero is a valid value.
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    let size = if flow.family == FAMILY_IPV4 {
        tuple.__bindgen_anon_1.ipv4.saddr = flow.saddr.words()[0];
        tuple.__bindgen_anon_1.ipv4.daddr = flow.daddr.words()[0];
        tuple.__bindgen_anon_1.ipv4.sport = flow.sport;
        tuple.__bindgen_anon_1.ipv4.dport = flow.dport;
        12
    } else {
        tuple.__bindgen_anon_1.ipv6.saddr = flow.saddr.words();
        tuple.__bindgen_anon_1.ipv6.daddr = flow.daddr.words();
        tuple.__bindgen_anon_1.ipv6.sport = flow.sport;
        tuple.__bindgen_anon_1.ipv6.dport = flow.dport;
        36
    };
    let skb = ctx.as_ptr();
    let netns = BPF_F_CURRENT_NETNS as u64;
    // SAFETY: skb is this program's context and tuple an initialised struct of that size; a
    // socket found is read, then released exactly once.
    unsafe {
        if flow.protocol == PROTO_TCP {
            let socket = bpf_skc_lookup_tcp(skb, &raw mut tuple, size, netns, 0);
            if socket.is_null() {
                return false;
            }
            let state = (*socket).state;
            bpf_sk_release(socket.cast());
            let closed = state == BPF_TCP_CLOSE
                || conntrack::is_opening(flow.tcp_flags) && state == BPF_TCP_TIME_WAIT;
            state != BPF_TCP_LISTEN && !closed
        } else {
            let socket = bpf_sk_lookup_udp(skb, &raw mut tuple, size, netns, 0);
            if socket.is_null() {
                return false;
            }
            let connected = (*socket).dst_port != 0;
            bpf_sk_release(socket.cast());
            connected
        }
    }
}
