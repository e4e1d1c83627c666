//! hostPort conditions (the reference portmap's `conditionsV4` / `conditionsV6`): whether a
//! client may reach the hostPorts of an attachment that has them. Every path that translates
//! to a hostPort asks: from outside, hairpin, and host processes' sockets.

use aya_ebpf::{cty::c_void, helpers::bpf_loop};
use cnibpf_common::{
    address::Address,
    portmap::{
        FLAG_CONDITIONED, PortConditions, PortConditionsKey, PortMapValue,
        conditions::{KIND_DESTINATION, KIND_IN_INTERFACE, KIND_SOURCE, MAX_TERMS},
    },
};

use crate::maps;

/// Whether `mapping` translates traffic from a client at `source` that sent to `destination`
/// and came in on `in_ifindex` (zero for a host process): always, unless the mapping is
/// conditioned and a clause of its attachment's conditions does not hold.
#[inline(always)]
pub fn admit(
    mapping: &PortMapValue,
    source: &Address,
    destination: &Address,
    in_ifindex: u32,
    family: u8,
) -> bool {
    mapping.flags & FLAG_CONDITIONED == 0
        || conditions_hold(mapping.owner, source, destination, in_ifindex, family)
}

/// Whether every clause of the conditions of `owner`'s hostPorts of `family` holds; conditions
/// that cannot be read keep the port closed. Five plain arguments, the most a BPF call takes
/// (a struct of them would cost its callers stack the deepest call chains do not have).
#[inline(never)]
fn conditions_hold(
    owner: u64,
    source: &Address,
    destination: &Address,
    in_ifindex: u32,
    family: u8,
) -> bool {
    let key = PortConditionsKey {
        owner,
        family,
        _pad: 0,
        _pad2: 0,
        _pad3: 0,
    };
    let Some(conditions) = maps::port_conditions.get_ptr(&key) else {
        return false;
    };
    let mut search = TermSearch {
        conditions,
        source,
        destination,
        in_ifindex,
        matched: 0,
    };
    // bpf_loop: the verifier checks the callback once instead of every term, whose outcomes
    // it would otherwise follow in every combination.
    // SAFETY: the callback has the signature bpf_loop expects; its context is `search`, which
    // outlives the call.
    unsafe {
        bpf_loop(
            MAX_TERMS as u32,
            match_term as *mut c_void,
            (&raw mut search).cast(),
            0,
        )
    };
    // SAFETY: points into `port_conditions`; userspace replaces entries whole (no
    // preallocation, so a reader keeps the old entry until it is done).
    let conditions = unsafe { &*conditions };
    let all = match 1u16.checked_shl(u32::from(conditions.clause_count)) {
        Some(bit) => bit.wrapping_sub(1),
        None => u16::MAX,
    };
    (search.matched ^ conditions.negated) & all == all
}

/// The `bpf_loop` context of [`conditions_hold`] (which must be on the stack): the terms, the
/// packet, and the clauses a term of matched so far (a bit each).
#[repr(C)]
struct TermSearch {
    conditions: *const PortConditions,
    source: *const Address,
    destination: *const Address,
    in_ifindex: u32,
    matched: u16,
}

/// One term of [`conditions_hold`] (`bpf_loop` callback); returns 1 past the last.
extern "C" fn match_term(position: u64, context: *mut c_void) -> i64 {
    // SAFETY: `conditions_hold` passes its `TermSearch`, alive for the whole loop; its
    // pointers are the `port_conditions` element and the caller's addresses.
    let (search, conditions) = unsafe {
        let search = &mut *context.cast::<TermSearch>();
        let conditions = &*search.conditions;
        (search, conditions)
    };
    let Some(term) = usize::try_from(position)
        .ok()
        .filter(|position| *position < usize::from(conditions.term_count))
        .and_then(|position| conditions.terms.get(core::hint::black_box(position)))
    else {
        return 1;
    };
    // SAFETY: the caller's addresses, alive for the whole loop.
    let (source, destination) = unsafe { (&*search.source, &*search.destination) };
    let hit = match term.kind {
        KIND_SOURCE => in_network(source, &term.addr, &term.mask),
        KIND_DESTINATION => in_network(destination, &term.addr, &term.mask),
        KIND_IN_INTERFACE => search.in_ifindex != 0 && search.in_ifindex == term.ifindex,
        _ => false,
    };
    if hit {
        search.matched |= 1u16.checked_shl(u32::from(term.clause)).unwrap_or(0);
    }
    0
}

/// Whether `addr` is in `network`/`mask`, word by word. An IPv4 term's mask is zero past its
/// first word, and so are an IPv4 address's words.
#[inline(always)]
fn in_network(addr: &Address, network: &Address, mask: &Address) -> bool {
    let ([a, b, c, d], [m, n, o, p]) = (addr.words(), mask.words());
    Address::from_words([a & m, b & n, c & o, d & p]) == *network
}
