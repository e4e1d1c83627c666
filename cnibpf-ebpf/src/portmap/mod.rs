//! Port mapping (DNAT of hostIP:hostPort to containerIP:containerPort): translating a packet to
//! a hostPort towards its container, remembering the flow, and translating its replies back.
//! The hooks decide when each step runs and hand translated packets over.
//!
//! Every packet towards a hostPort is looked up in `portmap`, never in a cached flow, so a
//! hostPort that changed owner takes effect on the very next packet — also for a UDP client
//! that keeps its source port. The connection's DNAT part (in `connections`) only serves to
//! reverse the translation of replies.
//!
//! Datagrams in fragments: the later fragments carry the first one's ports from the parser
//! (`fragments`), so each is translated as its first was, its transport header left alone.
//! Hairpin traffic is translated whole only.

mod conditions;
mod host;

use aya_ebpf::{btf_maps::PerCpuArray, macros::btf_map, programs::TcContext};
use cnibpf_common::{
    FAMILY_IPV4, PROTO_TCP,
    address::Address,
    connections::{Connection, ConnectionKey, PART_DNAT, conntrack},
    endpoints::{EndpointInfo, FLAG_NO_HAIRPIN_SNAT},
    filter::{DIRECTION_EGRESS, DIRECTION_INGRESS},
    portmap::{PortMapKey, PortMapValue},
    rejection::Ends,
};

use crate::{
    connections, maps,
    packet::{
        Answer, DatapathError, Flow, Fragment, Handover, NEXT, ifindex, mark_translated, or_verdict,
    },
    route::{Route, forward, route},
};

/// How a flow translated to a hostPort was addressed (in [`translation_scratch`]), kept
/// between its translation and the record of the flow, which waits until the packet was handed over (a dropped packet leaves no
/// state).
pub struct Translation {
    /// The attachment owning the mapping.
    pub owner: u64,
    /// The hostIP the client sent to.
    pub original_addr: Address,
    /// The client's own address.
    pub client_addr: Address,
    /// The hostPort, network byte order.
    pub original_port: u16,
    /// The client's own port, network byte order.
    pub client_port: u16,
    /// For hairpin traffic, the client container's host-side veth; zero: replies are routed.
    pub reply_ifindex: u32,
    pub client_mac: [u8; 6],
    pub gateway_mac: [u8; 6],
}
/// Scratch space of a hostPort translation (see [`Translation`]); private to each loaded
/// object, not pinned.
#[expect(
    non_upper_case_globals,
    reason = "the static's name is the map's name, like the pinned ones"
)]
#[btf_map]
pub static translation_scratch: PerCpuArray<Translation, 1> = PerCpuArray::new();

/// A packet from outside, at an uplink: translated towards the container behind its hostPort
/// (`Answer::TO_CONTAINER`, `container` filled in), or `Answer::NOT_MINE`; with the
/// `connections` entry of the connection it is translated into, null when there is none yet.
/// Its flow is recorded by [`remember_translation`] once the packet was handed over. A packet
/// of no connection of the mapping's attachment (the first of a connection) is translated only
/// to one of the node's own addresses for a wildcard hostPort, and not when it belongs to a
/// connection of the host's own (`host`). Inlined into the hook, which takes the entry on.
#[inline(always)]
pub fn translate_from_outside(
    ctx: &TcContext,
    flow: &mut Flow,
    container: &mut Handover,
) -> Result<(Answer, *mut Connection), DatapathError> {
    let none = core::ptr::null_mut();
    let Some((mapping, wildcard)) = lookup_mapping(flow) else {
        return Ok((Answer::NOT_MINE, none));
    };
    // SAFETY: mapping points into portmap and is read at once; see `lookup_mapping`.
    let mapping = unsafe { &*mapping };
    let connection = translated_connection(flow, mapping);
    if !carries(connection, mapping.owner, flow) && not_the_host_ports(ctx, flow, wildcard) {
        return Ok((Answer::NOT_MINE, none));
    }
    if !admit(mapping, &flow.saddr, &flow.daddr, ifindex(ctx), flow.family) {
        return Ok((Answer::NOT_MINE, none));
    }
    if begin_translation(flow, mapping.owner, 0).is_none() {
        return Ok((Answer::NOT_MINE, none));
    }
    flow.rewrite_destination(ctx, &mapping.container_addr, mapping.container_port.to_be())?;
    hand_to(container, mapping);
    Ok((Answer::TO_CONTAINER, connection))
}

/// The `connections` entry of the connection `mapping` translates a packet from outside into:
/// the container's side the mapping's, the remote the packet's source. Null when there is none.
#[inline(never)]
fn translated_connection(flow: &Flow, mapping: &PortMapValue) -> *mut Connection {
    connections::find(&ConnectionKey {
        container_addr: mapping.container_addr,
        remote_addr: flow.saddr,
        container_port: mapping.container_port,
        remote_port: u16::from_be(flow.sport),
        protocol: flow.protocol,
        family: flow.family,
        _pad: 0,
    })
}

/// Whether a packet to a hostPort that carries none of its attachment's connections is not
/// the hostPort's: a wildcard one's to an address that is not the node's own, or one of a
/// connection of the host's own (`host`).
#[inline(always)]
fn not_the_host_ports(ctx: &TcContext, flow: &Flow, wildcard: bool) -> bool {
    wildcard && !host::is_node_address(ctx, flow) || host::owns_connection(ctx, flow)
}

/// Whether `connection` (null: none) is a live connection to a hostPort of `owner`'s that the
/// packet goes on, rather than opens anew.
#[inline(always)]
fn carries(connection: *mut Connection, owner: u64, flow: &Flow) -> bool {
    // SAFETY: points into `connections`, read at once.
    unsafe { connection.as_ref() }.is_some_and(|connection| {
        connection.has(owner, PART_DNAT)
            && connection.takes_part(owner, flow.protocol, flow.tcp_flags, flow.now)
    })
}

/// Hairpin traffic: a container's packet to a hostPort of this host, translated towards the
/// target container (`Answer::TO_CONTAINER`, `target` filled in; recorded by [`remember_translation`]
/// once handed over), or `Answer::NOT_MINE`. A container whose traffic is shaped (`via_stack`) sends it
/// on through the host stack instead (`NEXT`), already translated and recorded — unless it
/// reaches itself: its source is then the gateway, an address the stack would not forward.
#[inline(never)]
pub fn translate_hairpin(
    ctx: &TcContext,
    flow: &mut Flow,
    via_stack: bool,
    target: &mut Handover,
) -> Answer {
    try_translate_hairpin(ctx, flow, via_stack, target).unwrap_or_else(|error| error.answer(ctx))
}

#[inline(always)]
fn try_translate_hairpin(
    ctx: &TcContext,
    flow: &mut Flow,
    via_stack: bool,
    target: &mut Handover,
) -> Result<Answer, DatapathError> {
    let Some((mapping, wildcard)) = lookup_mapping(flow) else {
        return Ok(Answer::NOT_MINE);
    };
    let ifindex = ifindex(ctx);
    let Some(client) = maps::endpoints.get_ptr(&ifindex) else {
        return Ok(Answer::NEXT);
    };
    // SAFETY: both point into maps and are read right away; see `lookup_mapping`.
    let (mapping, client) = unsafe { (&*mapping, &*client) };
    if !admit(
        mapping,
        &flow.saddr,
        &flow.daddr,
        client.gateway_ifindex,
        flow.family,
    ) {
        return Ok(Answer::NEXT);
    }
    // A container reaching its own hostPort would receive a packet from its own address, which
    // its stack drops as martian: the source becomes its gateway instead (unless `snat: false`).
    let to_itself = mapping.container_addr == flow.saddr;
    let source = if to_itself && client.flags & FLAG_NO_HAIRPIN_SNAT == 0 {
        match gateway(client, flow.family) {
            Some(gateway) => gateway,
            None => return Ok(Answer::NEXT),
        }
    } else {
        flow.saddr
    };
    let (owner, client_mac, gateway_mac) =
        (mapping.owner, client.container_mac, client.gateway_mac);
    if !hairpin_carries(flow, mapping, &source) && not_the_host_ports(ctx, flow, wildcard) {
        return Ok(Answer::NEXT);
    }
    let Some(translation) = begin_translation(flow, owner, ifindex) else {
        return Ok(Answer::NEXT);
    };
    translation.client_mac = client_mac;
    translation.gateway_mac = gateway_mac;
    flow.rewrite_destination(ctx, &mapping.container_addr, mapping.container_port.to_be())?;
    flow.rewrite_source(ctx, &source, flow.sport)?;
    if via_stack && !to_itself {
        remember_translation(flow, core::ptr::null_mut());
        mark_translated(ctx);
        return Ok(Answer::NEXT);
    }
    hand_to(target, mapping);
    Ok(Answer::TO_CONTAINER)
}

/// A container's reply to a translated flow, translated back: towards the client container of a
/// hairpin flow (`Answer::TO_CONTAINER`, `client` filled in), sent on to its next hop from the FIB, or
/// left to the host stack untranslated (`NEXT`: `uplink_egress` translates it on its way out;
/// always so from a container whose traffic is shaped, `via_stack`); `Answer::NOT_MINE` when the packet
/// is no such reply. `connection` is the packet's `connections` entry as the hook found it. Not
/// inlined: the verifier caps the stack of a call chain at 512 bytes.
#[inline(never)]
pub fn translate_reply(
    ctx: &TcContext,
    flow: &mut Flow,
    via_stack: bool,
    client: &mut Handover,
    connection: *mut Connection,
) -> Answer {
    let Some(entry) = reverse_of(flow, connection) else {
        return Answer::NOT_MINE;
    };
    // SAFETY: entry points into connections; it is copied out field by field before any
    // rewrite.
    let entry = unsafe { &*entry };
    let (orig_addr, orig_port) = (entry.orig_addr, entry.orig_port.to_be());
    if entry.peer_ifindex != 0 {
        let (peer_addr, peer_port) = (entry.peer_addr, entry.peer_port.to_be());
        client.host_ifindex = entry.peer_ifindex;
        client.container_mac = entry.peer_mac;
        client.gateway_mac = entry.gateway_mac;
        // Also from a shaped container: with a local source address the reply could not cross
        // the host stack (it would be dropped as martian).
        or_verdict!(ctx, flow.rewrite_source(ctx, &orig_addr, orig_port));
        or_verdict!(ctx, flow.rewrite_destination(ctx, &peer_addr, peer_port));
        return Answer::TO_CONTAINER;
    }
    if via_stack {
        return Answer::NEXT;
    }
    // Routed as it will leave, from the hostPort's address; the packet is not written before
    // the route is known.
    let (reply_addr, reply_port) = (flow.saddr, flow.sport);
    (flow.saddr, flow.sport) = (orig_addr, orig_port);
    let next_hop = route(ctx, flow, false);
    (flow.saddr, flow.sport) = (reply_addr, reply_port);
    // Where the datapath cannot route it (or its TTL runs out), the host stack gets it
    // untranslated (a local source address would be dropped as martian); uplink_egress
    // translates it on the way out.
    if matches!(next_hop, Route::Other)
        || !or_verdict!(
            ctx,
            flow.rewrite_forwarded_source(ctx, &orig_addr, orig_port)
        )
    {
        return Answer::NEXT;
    }
    Answer::verdict(or_verdict!(ctx, forward(ctx, &next_hop)).unwrap_or(NEXT))
}

/// A reply the host stack routed out of an uplink untranslated (when the container's hook did
/// not route it itself): it gets the hostPort address back as its source (`NEXT`), or
/// `Answer::NOT_MINE`.
pub fn translate_routed_reply(ctx: &TcContext, flow: &mut Flow) -> Result<Answer, DatapathError> {
    let connection = connections::of_packet(flow, DIRECTION_EGRESS);
    let Some(entry) = reverse_of(flow, connection) else {
        return Ok(Answer::NOT_MINE);
    };
    // SAFETY: entry points into connections; the fields are copied out before any rewrite.
    let (orig_addr, orig_port) = unsafe { ((*entry).orig_addr, (*entry).orig_port.to_be()) };
    flow.rewrite_source(ctx, &orig_addr, orig_port)?;
    Ok(Answer::NEXT)
}

/// The translation a container's packet reverses: the DNAT part of its connection
/// (`connection`, its entry as the hook found it), whose state the packet moves on (replies
/// keep the connection alive too). The pointer is into `connections`. Inlined: as a BPF call,
/// LLVM returns the option in two registers, and a BPF call returns one.
#[inline(always)]
fn reverse_of(flow: &Flow, connection: *mut Connection) -> Option<*const Connection> {
    // SAFETY: points into `connections`; racing writers only refresh the same fields.
    let connection = unsafe { connection.as_mut() }?;
    if connection.parts & PART_DNAT == 0 {
        return None;
    }
    let flags = flow.tcp_flags;
    // A connection the container opens on a closed one's tuple is its own, not a reply.
    if connection.reopened_by(flags) {
        return None;
    }
    let side = connection.side(DIRECTION_EGRESS);
    conntrack::advance(connection, flow.protocol, flags, side, flow.now);
    Some(core::ptr::from_mut(connection).cast_const())
}

/// A packet towards a container that did not come through a hostPort: a TCP connection
/// opening, or any UDP datagram, on a 5-tuple that has a translation remembered means that
/// translation is stale (the client now talks to the container directly with the same
/// ports), and its replies must not be rewritten: the connection loses its DNAT part.
/// `connection` is the packet's `connections` entry as the hook found it.
pub fn forget_stale_translation(flow: &Flow, connection: *mut Connection) {
    let opens = match flow.protocol {
        PROTO_TCP => flow.is_tcp_syn(),
        _ => true,
    };
    if flow.fragment != Fragment::Whole || !opens {
        return;
    }
    // SAFETY: points into `connections`; the fields are written at once.
    if let Some(connection) = unsafe { connection.as_mut() }
        && connection.parts & PART_DNAT != 0
    {
        connection.parts &= !PART_DNAT;
    }
}

/// Records how to reverse the translation of `flow` (already translated, as the translation
/// scratch describes it) for its replies, as the DNAT part of its connection (the filter's may
/// be there), and moves the connection's state on. `found` is the packet's `connections` entry
/// as the hook found it, or null: looked up here.
#[inline(never)]
pub fn remember_translation(flow: &Flow, found: *mut Connection) {
    let Some(translation) = translation_scratch.get_ptr(0) else {
        return;
    };
    // SAFETY: this CPU's slot, filled by the translation of this very packet.
    let translation = unsafe { &*translation };
    let now = flow.now;
    let flags = flow.tcp_flags;
    // The key is put together only where the hook's entry will not do (a connection's first
    // packet).
    let (entry, fresh) =
        if connections::takes_part(found, translation.owner, flow.protocol, flags, now) {
            (found, false)
        } else {
            connections::for_part(
                &connections::key_of(flow, DIRECTION_INGRESS),
                translation.owner,
                flow.protocol,
                DIRECTION_INGRESS,
                flags,
                now,
            )
        };
    if entry.is_null() {
        return;
    }
    // SAFETY: points into `connections` (racing writers write the same), or this CPU's
    // scratch for a new entry.
    let connection = unsafe { &mut *entry };
    let orig_port = u16::from_be(translation.original_port);
    // Written only when it changed: a write on every packet would bounce the entry's cache
    // line between CPUs.
    if connection.parts & PART_DNAT == 0
        || connection.orig_port != orig_port
        || connection.orig_addr != translation.original_addr
        || connection.peer_ifindex != translation.reply_ifindex
    {
        connection.orig_addr = translation.original_addr;
        connection.peer_addr = translation.client_addr;
        connection.peer_ifindex = translation.reply_ifindex;
        connection.orig_port = orig_port;
        connection.peer_port = u16::from_be(translation.client_port);
        connection.peer_mac = translation.client_mac;
        connection.gateway_mac = translation.gateway_mac;
        connection.parts |= PART_DNAT;
    }
    if fresh {
        connections::insert(&connections::key_of(flow, DIRECTION_INGRESS), entry);
    } else {
        let side = connection.side(DIRECTION_INGRESS);
        conntrack::advance(connection, flow.protocol, flags, side, now);
    }
}

/// Whether a hairpin packet goes on a live connection of `mapping`'s attachment (translated,
/// its source becomes `source`), rather than opens one. Not inlined: the key's stack slot is
/// then not held under the translation's calls.
#[inline(never)]
fn hairpin_carries(flow: &Flow, mapping: &PortMapValue, source: &Address) -> bool {
    let connection = connections::find(&ConnectionKey {
        container_addr: mapping.container_addr,
        remote_addr: *source,
        container_port: mapping.container_port,
        remote_port: u16::from_be(flow.sport),
        protocol: flow.protocol,
        family: flow.family,
        _pad: 0,
    });
    carries(connection, mapping.owner, flow)
}

fn gateway(endpoint: &EndpointInfo, family: u8) -> Option<Address> {
    let address = if family == FAMILY_IPV4 {
        Address::ipv4(endpoint.gateway_v4)
    } else {
        endpoint.gateway_v6
    };
    (address != Address::UNSPECIFIED).then_some(address)
}

/// The mapping for the packet's destination, and whether it is the port's wildcard one: the
/// wildcard, which applies only to the node's own addresses (the caller asks, `host`), else
/// the one of that exact address. The wildcard is asked first because it is the common mapping
/// and the two never coexist (a wildcard hostIP overlaps every other: an attachment's own list
/// refuses the pair, another attachment's ADD the holder's port).
///
/// The pointer is into `portmap`; callers read what they need at once. Userspace replaces
/// values whole, and a value freed under a reader can at worst misdirect the packet at hand.
#[inline(always)]
pub fn lookup_mapping(flow: &Flow) -> Option<(*const PortMapValue, bool)> {
    let mut key = PortMapKey {
        host_addr: Address::UNSPECIFIED,
        host_port: u16::from_be(flow.dport),
        protocol: flow.protocol,
        family: flow.family,
    };
    if let Some(wildcard) = maps::portmap.get_ptr(&key) {
        return Some((wildcard, true));
    }
    key.host_addr = flow.daddr;
    maps::portmap.get_ptr(&key).map(|mapping| (mapping, false))
}

pub use conditions::admit;
pub use host::remember_host_datagram;

/// Writes the addresses the sender of the packet just translated used (see [`Translation`])
/// into `ends`: the hostPort it sent to, its own. What the filter's answer to it goes between.
#[inline(never)]
pub fn translation_ends(ends: &mut Ends) {
    let Some(translation) = translation_scratch.get_ptr(0) else {
        return;
    };
    // SAFETY: this CPU's slot, filled by the translation of this very packet.
    let translation = unsafe { &*translation };
    ends.local = translation.original_addr;
    ends.local_port = translation.original_port;
    ends.remote = translation.client_addr;
    ends.remote_port = translation.client_port;
}

/// Fills in where a packet translated by `mapping` goes: the mapping's container.
#[inline(always)]
fn hand_to(container: &mut Handover, mapping: &PortMapValue) {
    container.host_ifindex = mapping.host_ifindex;
    container.container_mac = mapping.container_mac;
    container.gateway_mac = mapping.gateway_mac;
}

/// This CPU's translation scratch, holding what the replies of `flow` (about to be translated
/// by `owner`'s mapping) will need to be translated back; `reply_ifindex` is the client
/// container's veth for hairpin traffic, else zero.
#[inline(always)]
fn begin_translation(
    flow: &Flow,
    owner: u64,
    reply_ifindex: u32,
) -> Option<&'static mut Translation> {
    let translation = translation_scratch.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
    let translation = unsafe { &mut *translation };
    translation.owner = owner;
    translation.original_addr = flow.daddr;
    translation.client_addr = flow.saddr;
    translation.original_port = flow.dport;
    translation.client_port = flow.sport;
    translation.reply_ifindex = reply_ifindex;
    Some(translation)
}
