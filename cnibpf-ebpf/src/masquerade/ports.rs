//! The masquerade port of a new flow: its own source port when free, else random ones of the
//! same class, never one a host socket or a hostPort holds.

use aya_ebpf::{
    EbpfContext as _,
    bindings::{BPF_ANY, BPF_F_CURRENT_NETNS, BPF_NOEXIST, bpf_sock_tuple},
    btf_maps::PerCpuArray,
    cty::c_void,
    helpers::{
        bpf_get_prandom_u32, bpf_loop, bpf_sk_lookup_udp, bpf_sk_release, bpf_skc_lookup_tcp,
    },
    macros::btf_map,
    programs::TcContext,
};
use cnibpf_common::{
    FAMILY_IPV4, PROTO_TCP, PROTO_UDP,
    address::Address,
    connections::{ConnectionKey, PART_SNAT},
    masquerade::{CLAIM_GRACE_SECONDS, MasqReply, ReplyKey},
    packet::masquerade_port_range,
};

use super::{Plan, count};
use crate::{clock, connections, maps, packet::Flow};

/// Candidate ports tried before a new flow is given up (the first is its own source port).
const PORT_ATTEMPTS: u32 = 24;

/// The state of a search for a free masquerade port (`port_search`).
pub struct PortSearch {
    /// The reply tuple of the flow; its destination port is the candidate.
    pub reverse: ReplyKey,
    /// The `masq_replies` entry the flow gets.
    pub reply: MasqReply,
    /// The `connections` key of the flow holding the candidate, when one does (here rather
    /// than on the stack, which the search's call chain has used up).
    pub holder: ConnectionKey,
    pub span: u32,
    pub low: u16,
    /// Non-zero once `reverse` is claimed.
    pub claimed: u8,
}

/// Scratch space of the port search (see [`claim_port`]); private to each loaded object, not
/// pinned.
#[expect(
    non_upper_case_globals,
    reason = "the static's name is the map's name, like the pinned ones"
)]
#[btf_map]
pub static port_search: PerCpuArray<PortSearch, 1> = PerCpuArray::new();

/// Whether a socket of the host holds the flow's own source port on the masquerade address
/// for its remote address and port (a connection, or a listener or unconnected socket on the
/// port): its replies would be taken for the container's. The masquerade state knows only
/// masqueraded flows; the host's own connections are the kernel's.
#[inline(never)]
pub(super) fn host_socket_holds(ctx: &TcContext, flow: &Flow, nat_addr: &Address) -> bool {
    if flow.protocol != PROTO_TCP && flow.protocol != PROTO_UDP {
        return false;
    }
    // SAFETY: bpf_sock_tuple is plain old data; all-zero is a valid value.
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    // The tuple as a reply would carry it: from the remote side to the masquerade address.
    let size = if flow.family == FAMILY_IPV4 {
        tuple.__bindgen_anon_1.ipv4.saddr = flow.daddr.words()[0];
        tuple.__bindgen_anon_1.ipv4.daddr = nat_addr.words()[0];
        tuple.__bindgen_anon_1.ipv4.sport = flow.dport;
        tuple.__bindgen_anon_1.ipv4.dport = flow.sport;
        12
    } else {
        tuple.__bindgen_anon_1.ipv6.saddr = flow.daddr.words();
        tuple.__bindgen_anon_1.ipv6.daddr = nat_addr.words();
        tuple.__bindgen_anon_1.ipv6.sport = flow.dport;
        tuple.__bindgen_anon_1.ipv6.dport = flow.sport;
        36
    };
    let skb = ctx.as_ptr();
    let netns = BPF_F_CURRENT_NETNS as u64;
    // SAFETY: skb is this program's context and tuple a correctly sized, initialised struct;
    // a socket found is released below.
    let socket = unsafe {
        if flow.protocol == PROTO_TCP {
            bpf_skc_lookup_tcp(skb, &raw mut tuple, size, netns, 0)
        } else {
            bpf_sk_lookup_udp(skb, &raw mut tuple, size, netns, 0)
        }
    };
    if socket.is_null() {
        return false;
    }
    // SAFETY: a socket the lookup returned, released exactly once.
    unsafe { bpf_sk_release(socket.cast()) };
    true
}

/// Finds and claims a free masquerade port for a new flow in at most `PORT_ATTEMPTS` tries:
/// its own source port when free, else random ones of the same class, as the kernel's NAT
/// does.
///
/// The search state lives in the per-CPU `port_search` map: on the stack it would push the
/// call chain past the verifier's 512 bytes.
#[inline(never)]
pub(super) fn claim_port(flow: &Flow, plan: &Plan, keep_own_port: bool) -> Option<u16> {
    let search = port_search.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
    let search = unsafe { &mut *search };
    let original = u16::from_be(flow.sport);
    let (low, span) = masquerade_port_range(flow.protocol, original);
    search.reverse = ReplyKey {
        src_addr: flow.daddr,
        dst_addr: plan.nat_addr,
        src_port: u16::from_be(flow.dport),
        // Port 0 is never claimed: the search goes straight to random ports.
        dst_port: if keep_own_port { original } else { 0 },
        protocol: flow.protocol,
        family: flow.family,
        _pad: 0,
    };
    search.reply = MasqReply {
        container_addr: flow.saddr,
        owner: plan.source.owner,
        host_ifindex: plan.source.host_ifindex,
        container_port: original,
        _pad: 0,
        container_mac: plan.source.container_mac,
        gateway_mac: plan.source.gateway_mac,
        claimed_at: claim_clock(),
    };
    search.span = span;
    search.low = low;
    search.claimed = 0;
    // bpf_loop: the verifier checks the callback once instead of every iteration.
    // SAFETY: the callback has the signature bpf_loop expects and takes no context.
    unsafe {
        bpf_loop(
            PORT_ATTEMPTS,
            try_port as *mut c_void,
            core::ptr::null_mut(),
            0,
        )
    };
    (search.claimed != 0).then_some(search.reverse.dst_port)
}

/// One attempt of the port search (`bpf_loop` callback): the flow's own port first, then
/// random ones; returns 1 to stop.
extern "C" fn try_port(attempt: u64, _context: *mut c_void) -> i64 {
    let Some(search) = port_search.get_ptr_mut(0) else {
        return 1;
    };
    // SAFETY: this CPU's slot, filled by `claim_port` before the loop.
    let search = unsafe { &mut *search };
    if attempt > 0 {
        // SAFETY: bpf_get_prandom_u32 has no preconditions.
        let random = unsafe { bpf_get_prandom_u32() };
        let offset = random.checked_rem(search.span).unwrap_or(0);
        search.reverse.dst_port = search.low.wrapping_add(offset as u16);
    }
    if claim(&search.reverse, &search.reply, &mut search.holder) {
        search.claimed = 1;
        return 1;
    }
    count(|stats| &mut stats.port_collisions);
    0
}

/// Takes the reply tuple `reverse` for the flow: free, or held by this very flow or by one
/// whose masquerade is gone or expired. A hostPort of the masquerade address is never taken.
fn claim(reverse: &ReplyKey, reply: &MasqReply, holder_key: &mut ConnectionKey) -> bool {
    if reverse.dst_port == 0
        || maps::is_host_port(
            &reverse.dst_addr,
            reverse.dst_port,
            reverse.protocol,
            reverse.family,
        )
    {
        return false;
    }
    if maps::masq_replies
        .insert(reverse, reply, u64::from(BPF_NOEXIST))
        .is_ok()
    {
        return true;
    }
    let Some(holder) = maps::masq_replies.get_ptr(reverse) else {
        return maps::masq_replies
            .insert(reverse, reply, u64::from(BPF_NOEXIST))
            .is_ok();
    };
    // SAFETY: points into `masq_replies`, read at once.
    let holder = unsafe { &*holder };
    let reusable = if holder.container_addr == reply.container_addr
        && holder.container_port == reply.container_port
    {
        true
    } else if is_fresh(holder.claimed_at, reply.claimed_at) {
        // Another CPU's flow claimed it a moment ago and is writing its connection state: the
        // missing state is no sign of a gone flow yet.
        false
    } else {
        holder_key.container_addr = holder.container_addr;
        holder_key.remote_addr = reverse.src_addr;
        holder_key.container_port = holder.container_port;
        holder_key.remote_port = reverse.src_port;
        holder_key.protocol = reverse.protocol;
        holder_key.family = reverse.family;
        holder_key._pad = 0;
        let now = clock::now_ns();
        let state = connections::find(holder_key);
        // SAFETY: points into `connections`, read at once.
        state.is_null()
            || unsafe {
                !(*state).has(holder.owner, PART_SNAT) || (*state).is_expired(reverse.protocol, now)
            }
    };
    reusable
        && maps::masq_replies
            .insert(reverse, reply, u64::from(BPF_ANY))
            .is_ok()
}

/// The clock of `MasqReply::claimed_at`: CLOCK_MONOTONIC's second, plus one so that zero stays
/// "not said".
fn claim_clock() -> u32 {
    ((clock::now_ns() / 1_000_000_000) as u32).wrapping_add(1)
}

/// Whether a claim made at `claimed_at` is younger than the grace at `now` (both
/// [`claim_clock`] readings); an unsaid one (zero) is old.
fn is_fresh(claimed_at: u32, now: u32) -> bool {
    claimed_at != 0 && now.wrapping_sub(claimed_at) < CLAIM_GRACE_SECONDS
}
