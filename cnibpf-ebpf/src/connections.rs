//! The one connection table (`connections`): finding a packet's connection, and adding a
//! feature's part to it. Each feature fills its own fields; the entry, its owner and its
//! state are shared. A hook finds a packet's entry once ([`of_packet`]) and hands it to every
//! feature that reads it; a feature that adds a part to an entry the hook did not find (a
//! connection's first packet) looks again ([`for_part`]), since another feature may have
//! added one in between.

use aya_ebpf::{bindings::BPF_ANY, btf_maps::PerCpuArray, macros::btf_map};
use cnibpf_common::{
    PROTO_TCP,
    connections::{
        Connection, ConnectionKey,
        conntrack::{self, STATE_ESTABLISHED, STATE_OPENING},
    },
    filter::DIRECTION_EGRESS,
};

use crate::{maps, packet::Flow};

/// Where a new entry is put together before it is inserted: on the stack it would push the
/// deeper call chains past the verifier's 512 bytes. Private to each loaded object, not
/// pinned.
#[expect(
    non_upper_case_globals,
    reason = "the static's name is the map's name, like the pinned ones"
)]
#[btf_map]
pub static connection_scratch: PerCpuArray<Connection, 1> = PerCpuArray::new();

/// The `connections` key of a packet travelling `direction` (`DIRECTION_*`): egress, the
/// container sent it; ingress, it is for the container.
#[inline(always)]
pub fn key_of(flow: &Flow, direction: u8) -> ConnectionKey {
    let ((container_addr, container_port), (remote_addr, remote_port)) =
        if direction == DIRECTION_EGRESS {
            ((flow.saddr, flow.sport), (flow.daddr, flow.dport))
        } else {
            ((flow.daddr, flow.dport), (flow.saddr, flow.sport))
        };
    ConnectionKey {
        container_addr,
        remote_addr,
        container_port: u16::from_be(container_port),
        remote_port: u16::from_be(remote_port),
        protocol: flow.protocol,
        family: flow.family,
        _pad: 0,
    }
}

/// The entry of the connection of a packet travelling `direction` (`DIRECTION_*`), null when
/// there is none. Not inlined: the key's stack slot is then not held under the caller's calls.
#[inline(never)]
pub fn of_packet(flow: &Flow, direction: u8) -> *mut Connection {
    find(&key_of(flow, direction))
}

/// The entry of `key`, null when there is none. (A raw pointer: an `Option` returned from a
/// BPF call comes back in a form the verifier rejects.) An LRU entry may be recycled under a
/// reader; the worst that does is misjudge or misdirect the packet at hand.
#[inline(always)]
pub fn find(key: &ConnectionKey) -> *mut Connection {
    maps::connections
        .get_ptr_mut(key)
        .unwrap_or(core::ptr::null_mut())
}

/// The entry of `key` to which `owner` adds a part ([`Connection::takes_part`]), or else a
/// [`fresh`] one in this CPU's scratch for [`insert`]; the second value says which.
#[inline(always)]
pub fn for_part(
    key: &ConnectionKey,
    owner: u64,
    protocol: u8,
    direction: u8,
    flags: u8,
    now: u64,
) -> (*mut Connection, bool) {
    let entry = find(key);
    if takes_part(entry, owner, protocol, flags, now) {
        return (entry, false);
    }
    (fresh(owner, protocol, direction, flags, now), true)
}

/// Whether `entry` (the packet's as its hook found it, or null) is one to which `owner` adds
/// a part as it is ([`Connection::takes_part`]): a closed connection's entry, when its tuple
/// opens again, the filter may have replaced since the hook found it.
#[inline(always)]
pub fn takes_part(entry: *mut Connection, owner: u64, protocol: u8, flags: u8, now: u64) -> bool {
    // SAFETY: points into `connections`, read at once.
    unsafe { entry.as_ref() }.is_some_and(|entry| entry.takes_part(owner, protocol, flags, now))
}

/// A new entry of `owner` in this CPU's scratch, for [`insert`]: opened by a packet travelling
/// `direction` with TCP `flags` (a TCP connection met mid-stream, its state lost, is taken as
/// established, like the kernel's `nf_conntrack_tcp_loose`). Null when the scratch cannot be
/// had.
#[inline(always)]
pub fn fresh(owner: u64, protocol: u8, direction: u8, flags: u8, now: u64) -> *mut Connection {
    let Some(fresh) = connection_scratch.get_ptr_mut(0) else {
        return core::ptr::null_mut();
    };
    // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap. Zeroed
    // in place, field by field: a `Connection` literal would be built on the stack first.
    let connection = unsafe {
        core::ptr::write_bytes(fresh, 0, 1);
        &mut *fresh
    };
    connection.owner = owner;
    connection.last_seen_ns = now;
    connection.origin = direction;
    connection.state = if protocol == PROTO_TCP && !conntrack::is_opening(flags) {
        STATE_ESTABLISHED
    } else {
        STATE_OPENING
    };
    fresh
}

/// Inserts the new entry [`for_part`] put together in the scratch. A full LRU map evicts the
/// least recently used connection; should the insert still fail, the next packet finds none.
#[inline(always)]
pub fn insert(key: &ConnectionKey, fresh: *mut Connection) {
    // SAFETY: this CPU's scratch slot, filled by `for_part` and the caller.
    let _ = maps::connections.insert(key, unsafe { &*fresh }, u64::from(BPF_ANY));
}
