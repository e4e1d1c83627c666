//! Port mapping (DNAT of hostIP:hostPort to containerIP:containerPort) at the uplinks.
//!
//! Ingress looks every packet up in `portmap` first, never in a cached flow, so a hostPort that
//! changed owner takes effect on the very next packet — also for a UDP client that keeps its
//! source port. The flow entry only serves to reverse the translation of replies at egress.

use aya_ebpf::{
    EbpfContext as _,
    bindings::{__sk_buff, BPF_ANY, BPF_FIB_LKUP_RET_NOT_FWDED, TC_ACT_OK, bpf_fib_lookup},
    helpers::{bpf_fib_lookup as fib_lookup, bpf_ktime_get_ns},
    programs::TcContext,
};
use cnibpf_common::{
    FAMILY_IPV4,
    nat_flow::{NatFlowKey, NatFlowValue},
    portmap::{PortMapKey, PortMapValue},
};

use crate::{
    maps,
    packet::{DatapathError, Ipv4Flow, ipv4_from_key_addr, ipv4_key_addr},
};

const AF_INET: u8 = 2;
/// How often a flow's `last_seen_ns` is refreshed: writing it on every packet would turn each
/// packet's lookup into a write that bounces the cache line between CPUs.
const FLOW_REFRESH_NS: u64 = 1_000_000_000;

pub fn try_uplink_ingress(ctx: &TcContext) -> Result<i32, DatapathError> {
    let Some(flow) = Ipv4Flow::parse(ctx)? else {
        return Ok(TC_ACT_OK);
    };
    let Some(mapping) = lookup_mapping(ctx, &flow) else {
        return Ok(TC_ACT_OK);
    };
    let container_addr = ipv4_from_key_addr(&mapping.container_addr);
    flow.rewrite_destination(ctx, container_addr, mapping.container_port.to_be())?;
    remember_flow(&flow, &mapping);
    Ok(TC_ACT_OK)
}

pub fn try_uplink_egress(ctx: &TcContext) -> Result<i32, DatapathError> {
    let Some(flow) = Ipv4Flow::parse(ctx)? else {
        return Ok(TC_ACT_OK);
    };
    let key = NatFlowKey {
        src_addr: ipv4_key_addr(flow.saddr),
        dst_addr: ipv4_key_addr(flow.daddr),
        src_port: u16::from_be(flow.sport),
        dst_port: u16::from_be(flow.dport),
        protocol: flow.protocol,
        family: FAMILY_IPV4,
        _pad: [0; 2],
    };
    let Some(entry) = maps::nat_flows.get_ptr(&key) else {
        return Ok(TC_ACT_OK);
    };
    // SAFETY: the pointer came from a successful lookup and is read once, right away; an LRU
    // eviction racing with this read can at worst yield another flow's bytes, which only the
    // packet being rewritten would see.
    let (orig_addr, orig_port) = unsafe { ((*entry).orig_addr, (*entry).orig_port) };
    flow.rewrite_source(ctx, ipv4_from_key_addr(&orig_addr), orig_port.to_be())?;
    Ok(TC_ACT_OK)
}

/// The mapping for the packet's destination: an exact host address first, then the wildcard,
/// which applies only when the destination is an address of this host.
fn lookup_mapping(ctx: &TcContext, flow: &Ipv4Flow) -> Option<PortMapValue> {
    let mut key = PortMapKey {
        host_addr: ipv4_key_addr(flow.daddr),
        host_port: u16::from_be(flow.dport),
        protocol: flow.protocol,
        family: FAMILY_IPV4,
    };
    if let Some(value) = maps::portmap.get_ptr(&key) {
        // SAFETY: read once right after the lookup; userspace replaces values whole.
        return Some(unsafe { *value });
    }
    key.host_addr = [0; 16];
    // SAFETY: as above.
    let wildcard = maps::portmap.get_ptr(&key).map(|value| unsafe { *value })?;
    is_local_destination(ctx, flow).then_some(wildcard)
}

/// Asks the FIB whether the destination is local, as `-m addrtype --dst-type LOCAL` does for
/// the reference portmap: traffic routed through the host must not be captured by a hostPort.
fn is_local_destination(ctx: &TcContext, flow: &Ipv4Flow) -> bool {
    // SAFETY: bpf_fib_lookup is plain old data; all-zero is its documented initial state.
    let mut params: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    params.family = AF_INET;
    params.l4_protocol = flow.protocol;
    params.sport = flow.sport;
    params.dport = flow.dport;
    params.__bindgen_anon_1.tot_len = flow.total_len;
    params.__bindgen_anon_3.ipv4_src = flow.saddr;
    params.__bindgen_anon_4.ipv4_dst = flow.daddr;
    let skb = ctx.as_ptr();
    // SAFETY: the context pointer is the __sk_buff the kernel handed to this program.
    params.ifindex = unsafe { (*skb.cast::<__sk_buff>()).ifindex };
    // SAFETY: skb is this program's context and params a correctly sized, initialised struct.
    let rc = unsafe {
        fib_lookup(
            skb.cast(),
            &raw mut params,
            size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    };
    rc == i64::from(BPF_FIB_LKUP_RET_NOT_FWDED)
}

/// Records how to reverse the translation for the flow's replies; refreshed at most once a
/// second per flow unless the mapping it came through changed.
fn remember_flow(flow: &Ipv4Flow, mapping: &PortMapValue) {
    let key = NatFlowKey {
        src_addr: mapping.container_addr,
        dst_addr: ipv4_key_addr(flow.saddr),
        src_port: mapping.container_port,
        dst_port: u16::from_be(flow.sport),
        protocol: flow.protocol,
        family: FAMILY_IPV4,
        _pad: [0; 2],
    };
    let orig_addr = ipv4_key_addr(flow.daddr);
    // SAFETY: bpf_ktime_get_ns has no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(entry) = maps::nat_flows.get_ptr(&key) {
        // SAFETY: read right after the lookup; a stale read only causes one extra update.
        let current = unsafe { *entry };
        if current.orig_addr == orig_addr
            && current.orig_port == u16::from_be(flow.dport)
            && current.owner == mapping.owner
            && now.wrapping_sub(current.last_seen_ns) < FLOW_REFRESH_NS
        {
            return;
        }
    }
    let value = NatFlowValue {
        orig_addr,
        owner: mapping.owner,
        last_seen_ns: now,
        orig_port: u16::from_be(flow.dport),
        _pad: [0; 6],
    };
    // A full LRU map evicts; an insert failure leaves the previous entry, which still reverses
    // this flow correctly unless the mapping changed, so there is nothing better to do here.
    let _ = maps::nat_flows.insert(&key, &value, u64::from(BPF_ANY));
}
