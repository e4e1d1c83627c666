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
//!   opened from a port that is a hostPort's number, a held connection's later packet, the
//!   answer to a datagram an unconnected UDP socket sent from it to that remote (a host flow,
//!   [`PART_HOST_FLOW`], which the sendmsg hook remembers). That is the host's, as conntrack
//!   matches a connection before a DNAT rule. A listening socket, or an unconnected one that
//!   sent nothing to the packet's source, does not outrank the hostPort.

use aya_ebpf::{
    EbpfContext as _,
    bindings::{
        BPF_ANY, BPF_F_CURRENT_NETNS, BPF_TCP_CLOSE, BPF_TCP_LISTEN, BPF_TCP_TIME_WAIT,
        bpf_sock_tuple,
    },
    helpers::{bpf_sk_lookup_udp, bpf_sk_release, bpf_skc_lookup_tcp},
    programs::TcContext,
};
use cnibpf_common::{
    FAMILY_IPV4, PROTO_TCP, PROTO_UDP,
    address::Address,
    connections::{
        Connection, ConnectionKey, HOST, PART_HOST_FLOW,
        conntrack::{self, SIDE_ORIGIN, SIDE_REPLY, STATE_OPENING},
    },
    filter::{DIRECTION_EGRESS, DIRECTION_INGRESS},
};

use crate::{
    clock, connections, maps,
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
/// socket connected to the packet's source, or an unconnected one that sent to it (a live
/// host flow).
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
            connected || answers_host_flow(flow)
        }
    }
}

/// Whether the UDP packet answers a live host flow (see [`remember_host_datagram`]): one of
/// the address it came to, or of the wildcard its socket may be bound to. The flow is
/// refreshed as conntrack refreshes a connection its answer matches.
#[inline(never)]
fn answers_host_flow(flow: &Flow) -> bool {
    let mut key = connections::key_of(flow, DIRECTION_INGRESS);
    if answered(&key, flow.now) {
        return true;
    }
    key.container_addr = Address::UNSPECIFIED;
    answered(&key, flow.now)
}

fn answered(key: &ConnectionKey, now: u64) -> bool {
    // SAFETY: points into `connections`; racing writers only refresh the same fields.
    match unsafe { connections::find(key).as_mut() } {
        Some(entry) if is_live_host_flow(entry, now) => {
            conntrack::advance(entry, PROTO_UDP, 0, SIDE_REPLY, now);
            true
        }
        _ => false,
    }
}

fn is_live_host_flow(entry: &Connection, now: u64) -> bool {
    entry.has(HOST, PART_HOST_FLOW) && !entry.is_expired(PROTO_UDP, now)
}

/// A datagram a host socket sends, unconnected, from `key`'s container side (its address, all
/// zero when bound to the wildcard, and its port) to `key`'s remote: when that port is a UDP
/// hostPort's number, the datagram opens or refreshes a host flow (a `connections` entry of
/// owner [`HOST`] with [`PART_HOST_FLOW`]), whose answers [`owns_connection`] gives the host
/// until it expires by UDP's timeouts — what conntrack's entry for the datagram does. Any
/// other datagram leaves nothing. The entry is put together on the stack: a socket hook runs
/// in process context, where a packet's program on the same CPU may use the shared scratch.
#[inline(always)]
pub fn remember_host_datagram(key: &ConnectionKey) {
    if !maps::is_host_port_number(
        &key.container_addr,
        key.container_port,
        key.protocol,
        key.family,
    ) {
        return;
    }
    let now = clock::now_ns();
    // SAFETY: points into `connections`; racing writers only refresh the same fields.
    if let Some(entry) = unsafe { connections::find(key).as_mut() }
        && entry.owner == HOST
        && !entry.is_expired(PROTO_UDP, now)
    {
        // A host flow moved off a container's port keeps its own part beside this one.
        entry.parts |= PART_HOST_FLOW;
        conntrack::advance(entry, PROTO_UDP, 0, SIDE_ORIGIN, now);
        return;
    }
    let flow = Connection {
        owner: HOST,
        last_seen_ns: now,
        parts: PART_HOST_FLOW,
        origin: DIRECTION_EGRESS,
        state: STATE_OPENING,
        ..Connection::default()
    };
    // A full LRU map evicts the least recently used connection; should the insert still fail,
    // the answers go to the hostPort, as before the host flow was known.
    let _ = maps::connections.insert(key, &flow, u64::from(BPF_ANY));
}
