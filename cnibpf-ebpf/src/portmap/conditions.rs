//! hostPort conditions (the reference portmap's `conditionsV4` / `conditionsV6`): whether a
//! client may reach the hostPorts of an attachment that has them. Every path that translates
//! to a hostPort asks: from outside, hairpin, and host processes' sockets.

use cnibpf_common::{
    address::Address,
    port_condition::{
        KIND_DESTINATION, KIND_IN_INTERFACE, KIND_SOURCE, MAX_TERMS, PortConditionsKey,
    },
    portmap::{FLAG_CONDITIONED, PortMapValue},
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
        _pad: [0; 7],
    };
    let Some(conditions) = maps::port_conditions.get_ptr(&key) else {
        return false;
    };
    // SAFETY: points into `port_conditions`; userspace replaces entries whole (no preallocation,
    // so a reader keeps the old entry until it is done).
    let conditions = unsafe { &*conditions };
    let mut matched: u16 = 0;
    let count = usize::from(conditions.term_count);
    // An index loop with a constant bound: the verifier follows it, not a slice iterator's
    // end pointer.
    for index in 0..MAX_TERMS {
        if index >= count {
            break;
        }
        let Some(term) = conditions.terms.get(index) else {
            break;
        };
        let hit = match term.kind {
            KIND_SOURCE => in_network(source, &term.addr, &term.mask),
            KIND_DESTINATION => in_network(destination, &term.addr, &term.mask),
            KIND_IN_INTERFACE => in_ifindex != 0 && in_ifindex == term.ifindex,
            _ => false,
        };
        if hit {
            matched |= 1u16.checked_shl(u32::from(term.clause)).unwrap_or(0);
        }
    }
    let all = match 1u16.checked_shl(u32::from(conditions.clause_count)) {
        Some(bit) => bit.wrapping_sub(1),
        None => u16::MAX,
    };
    (matched ^ conditions.negated) & all == all
}

/// Whether `addr` is in `network`/`mask`: word by word, without a branch. An IPv4 term's mask
/// is zero past its first word, and so are an IPv4 address's words.
#[inline(always)]
fn in_network(addr: &Address, network: &Address, mask: &Address) -> bool {
    let ([a, b, c, d], [m, n, o, p]) = (addr.words(), mask.words());
    Address::from_words([a & m, b & n, c & o, d & p]) == *network
}
