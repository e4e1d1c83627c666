//! The node's own netfilter, asked about a packet's connection through conntrack's kfuncs
//! (`bpf_skb_ct_lookup`, kernel 6.0 and later; declared in the object's `.ksyms` section by
//! `cargo xtask build-ebpf`). The datapath's fast path is for the connections netfilter leaves
//! alone; one it translated (a Service's `dnat`, a `dnat` into a pod) or one the pod answers
//! stays with the host stack, where netfilter translates each packet both ways.

use aya_ebpf::{EbpfContext as _, bindings::bpf_sock_tuple, programs::TcContext};
use cnibpf_common::{FAMILY_IPV4, PROTO_TCP, PROTO_UDP};

use crate::packet::Flow;

/// `struct bpf_ct_opts` (net/netfilter/nf_conntrack_bpf.c), in its 16-byte form.
#[repr(C)]
struct CtOptions {
    /// The namespace to look in; `BPF_F_CURRENT_NETNS`: the packet's.
    netns_id: i32,
    /// Set by the kernel when the lookup fails.
    error: i32,
    l4proto: u8,
    /// Set by the kernel: the direction of the tuple that matched (`IP_CT_DIR_*`).
    direction: u8,
    zone_id: u16,
    zone_direction: u8,
    reserved: [u8; 3],
}

/// `struct nf_conn`, only ever handled by pointer.
#[repr(C)]
struct NfConn {
    _opaque: [u8; 0],
}

unsafe extern "C" {
    /// Finds the conntrack entry whose original or reply tuple is `tuple`, taking a reference
    /// that `bpf_ct_release` gives back; null when there is none.
    fn bpf_skb_ct_lookup(
        skb: *mut core::ffi::c_void,
        tuple: *mut bpf_sock_tuple,
        tuple_size: u32,
        options: *mut CtOptions,
        options_size: u32,
    ) -> *mut NfConn;
    fn bpf_ct_release(connection: *mut NfConn);
}

/// `BPF_F_CURRENT_NETNS`: the namespace of the packet's device, the host's.
const CURRENT_NETNS: i32 = -1;
/// `IP_CT_DIR_REPLY`.
const DIRECTION_REPLY: u8 = 1;

/// What the node's netfilter did with a packet's connection ([`view`]).
/// Netfilter tracks the connection under the tuple the packet has now, as its original
/// direction, or does not track it at all: it did not translate it, and the fast path may
/// take the connection's later packets.
pub const UNTRANSLATED: u8 = 0;
/// Netfilter tracks the connection under another tuple: it translated the packet (a `dnat`).
pub const TRANSLATED: u8 = 1;
/// The packet answers a connection the other side opened.
pub const ANSWER: u8 = 2;
/// Conntrack's kfuncs answer for TCP and UDP only.
pub const UNKNOWN: u8 = 3;

/// `lookup`'s answers.
const NOT_FOUND: u8 = 0;
const FOUND_ORIGINAL: u8 = 1;
const FOUND_REPLY: u8 = 2;

/// What the node's netfilter did with the connection of a packet it has just handed on (at an
/// uplink's egress): found under the packet's own tuple, the connection kept it; found only
/// as the reply of the tuple reversed, a `dnat` changed the packet's destination (the
/// connection is tracked under the tuple before the change, its reply under the one after).
/// A plain integer: a BPF call returns one register.
#[inline(never)]
pub fn view(ctx: &TcContext, flow: &Flow) -> u8 {
    if flow.protocol != PROTO_TCP && flow.protocol != PROTO_UDP {
        return UNKNOWN;
    }
    match lookup(ctx, flow, false) {
        FOUND_ORIGINAL => UNTRANSLATED,
        FOUND_REPLY => ANSWER,
        _ if lookup(ctx, flow, true) == NOT_FOUND => UNTRANSLATED,
        _ => TRANSLATED,
    }
}

/// Looks the packet's tuple (`reversed`: the tuple of its answer) up in the conntrack table of
/// the packet's namespace: in which direction of a connection it was found.
#[inline(always)]
fn lookup(ctx: &TcContext, flow: &Flow, reversed: bool) -> u8 {
    let ((saddr, sport), (daddr, dport)) = if reversed {
        ((flow.daddr, flow.dport), (flow.saddr, flow.sport))
    } else {
        ((flow.saddr, flow.sport), (flow.daddr, flow.dport))
    };
    // SAFETY: bpf_sock_tuple is plain old data; all-zero is a valid value.
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    let size = if flow.family == FAMILY_IPV4 {
        tuple.__bindgen_anon_1.ipv4.saddr = saddr.words()[0];
        tuple.__bindgen_anon_1.ipv4.daddr = daddr.words()[0];
        tuple.__bindgen_anon_1.ipv4.sport = sport;
        tuple.__bindgen_anon_1.ipv4.dport = dport;
        12
    } else {
        tuple.__bindgen_anon_1.ipv6.saddr = saddr.words();
        tuple.__bindgen_anon_1.ipv6.daddr = daddr.words();
        tuple.__bindgen_anon_1.ipv6.sport = sport;
        tuple.__bindgen_anon_1.ipv6.dport = dport;
        36
    };
    let mut options = CtOptions {
        netns_id: CURRENT_NETNS,
        error: 0,
        l4proto: flow.protocol,
        direction: 0,
        zone_id: 0,
        zone_direction: 0,
        reserved: [0; 3],
    };
    // SAFETY: the context is this program's skb; tuple and options are initialised structs of
    // the sizes given; an entry found is released below.
    let connection = unsafe {
        bpf_skb_ct_lookup(
            ctx.as_ptr(),
            &raw mut tuple,
            size,
            &raw mut options,
            size_of::<CtOptions>() as u32,
        )
    };
    if connection.is_null() {
        return NOT_FOUND;
    }
    // SAFETY: the entry the lookup returned, released exactly once.
    unsafe { bpf_ct_release(connection) };
    if options.direction == DIRECTION_REPLY {
        FOUND_REPLY
    } else {
        FOUND_ORIGINAL
    }
}
