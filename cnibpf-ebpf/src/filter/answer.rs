//! The answer to a packet a REJECT rule refused (see `cnibpf_common::rejection`): the packet
//! is rewritten in place into a TCP reset or an ICMP/ICMPv6 "administratively prohibited" from
//! the address it was sent to, and sent back the way it came, while the attachment's answer
//! budget (`answer_budgets`) lasts. What cannot be answered — a packet never to be answered, a
//! budget spent, a packet the kernel will not resize (GSO) — is dropped as it would have been.
//! The hooks that refuse only say so ([`refused`]); the answer is made by a program of its own,
//! `reject_answer`, which their entry points tail-call (`answer_programs`), so that its code is
//! loaded once rather than in each of them.

use aya_ebpf::{
    EbpfContext as _,
    bindings::{BPF_CSUM_LEVEL_RESET, BPF_F_INGRESS, BPF_F_RECOMPUTE_CSUM},
    btf_maps::PerCpuArray,
    helpers::{
        bpf_csum_diff, bpf_csum_level, bpf_redirect, bpf_skb_change_tail, bpf_skb_load_bytes,
    },
    macros::btf_map,
    programs::TcContext,
};
use cnibpf_common::{
    PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP,
    address::Address,
    internet_checksum,
    rejection::{
        self, ANSWER_MAX, Ends, ICMP_CHECKSUM, IPV4_CHECKSUM, Kind, L4_V4, L4_V6,
        PROHIBITED_V4_LEN, PROHIBITED_V6_LEN, RESET_V4_LEN, RESET_V6_LEN, TCP_CHECKSUM,
    },
};

use super::filter_scratch;
use crate::{
    clock, maps,
    packet::{DROP, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, load_anywhere, redirect_to_peer, set_macs},
};

/// Which way a refused packet's answer goes.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Way {
    /// The container sent the packet (its veth's ingress): into the container.
    IntoContainer,
    /// The veth was to deliver the packet to its container (its egress): into the host stack
    /// by the container's gateway (its bridge; the veth itself when it has none), as if the
    /// container answered, which routes it to the sender.
    FromContainer,
    /// It came in by this interface, an uplink: back out of it.
    OutOfUplink,
}

/// `Subject::answer` of a packet a REJECT rule refused, until [`answer_refused`] answers it.
pub const WANTED: u8 = 1;

/// The verdict [`refused`] gives a packet whose answer is wanted: no TC verdict takes it. The
/// hook's entry point passes the packet on to [`answer_refused`] ([`answered`]).
pub const TO_ANSWER: i32 = i32::MIN + 2;

/// The headers of a refused packet and its answer being made; private to each loaded object.
#[repr(C)]
pub struct AnswerScratch {
    /// The answer's ends: the packet's own, or those a translation's sender used
    /// ([`ends_slot`]).
    ends: Ends,
    /// The [`Way`] the answer goes, and whether `ends` were written for it (1) or are the
    /// packet's own (0): what [`refused`] hands [`answer_refused`].
    way: u32,
    translated: u32,
    /// The IP header (IPv4's in its first 20 bytes).
    ip: [u8; 40],
    l4: [u8; 20],
    macs: [u8; 12],
    out: [u8; ANSWER_MAX],
    pseudo: [u8; 40],
}

#[expect(
    non_upper_case_globals,
    reason = "the static's name is the map's name, like the pinned ones"
)]
#[btf_map]
pub static answer_scratch: PerCpuArray<AnswerScratch, 1> = PerCpuArray::new();

/// Where a hook writes the ends a translated packet's sender used (the hostPort it sent to,
/// its own), for [`refused`] with `translated`.
pub fn ends_slot() -> Option<&'static mut Ends> {
    let scratch = answer_scratch.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
    Some(unsafe { &mut (*scratch).ends })
}

/// The verdict for a packet the filter refused: [`TO_ANSWER`] when its answer is wanted — to
/// go `way`, between the ends a hook wrote in [`ends_slot`] when `translated`, else the
/// packet's own — or a drop.
#[inline(never)]
pub fn refused(way: Way, translated: bool) -> i32 {
    let (Some(subject), Some(scratch)) =
        (filter_scratch.get_ptr_mut(0), answer_scratch.get_ptr_mut(0))
    else {
        return DROP;
    };
    // SAFETY: this CPU's scratches, the filter's filled for the packet at hand.
    let (subject, scratch) = unsafe { (&*subject, &mut *scratch) };
    if subject.answer != WANTED {
        return DROP;
    }
    scratch.way = way as u32;
    scratch.translated = u32::from(translated);
    TO_ANSWER
}

/// Whether a hook's verdict lets the packet on: neither dropped nor refused (answered or not),
/// so that what it was translated by is worth remembering.
#[inline(always)]
pub fn lets_on(verdict: i32) -> bool {
    verdict != DROP && verdict != TO_ANSWER
}

/// A hook's verdict as the kernel gets it: one of [`TO_ANSWER`] goes on to the answer program
/// (a tail call: one copy of the answer's code for every hook), or is dropped unanswered when
/// that program is missing. Inlined into each entry point, where a tail call leaves no frame
/// of the hook's below the answer's.
#[inline(always)]
pub fn answered(ctx: &TcContext, verdict: i32) -> i32 {
    if verdict == TO_ANSWER {
        // SAFETY: a tail call into `answer_programs`' only program, which reads nothing of
        // this one's but the per-CPU scratches; it returns only when there is none.
        unsafe { maps::answer_programs.tail_call(ctx, ANSWER_PROGRAM) };
        return DROP;
    }
    verdict
}

/// The answer program's slot in `answer_programs`.
const ANSWER_PROGRAM: u32 = 0;

/// The answer program's work for the packet [`refused`] made ready: its answer sent the way
/// it named, while the attachment's budget lasts, or a drop.
pub fn answer_refused(ctx: &TcContext) -> i32 {
    let (Some(subject), Some(scratch)) =
        (filter_scratch.get_ptr_mut(0), answer_scratch.get_ptr_mut(0))
    else {
        return DROP;
    };
    // SAFETY: this CPU's scratches, filled by the hook that tail-called this program.
    let (subject, scratch) = unsafe { (&mut *subject, &*scratch) };
    if subject.answer != WANTED {
        return DROP;
    }
    subject.answer = 0;
    let (way, translated) = (scratch.way, scratch.translated != 0);
    let Some(budget) = maps::answer_budgets.get_ptr_mut(&subject.ifindex) else {
        return DROP;
    };
    // Made before the budget is asked, which counts only the answers there are to send.
    let length = answer(ctx, translated);
    // SAFETY: this CPU's budget of the attachment; programs on one CPU do not overlap.
    if length == 0 || !unsafe { &mut *budget }.spend(clock::now_ns()) || !send(ctx, length) {
        return DROP;
    }
    let ifindex = crate::packet::ifindex(ctx);
    match way {
        way if way == Way::IntoContainer as u32 => redirect_to_peer(ifindex),
        way if way == Way::FromContainer as u32 => into_gateway(ctx, ifindex),
        // SAFETY: bpf_redirect has no memory arguments.
        _ => unsafe { bpf_redirect(ifindex, 0) as i32 },
    }
}

/// An answer from the container behind veth `ifindex`, into the host stack by its gateway:
/// addressed to the gateway's MAC (a frame the stack takes for itself), from the container's.
fn into_gateway(ctx: &TcContext, ifindex: u32) -> i32 {
    let endpoint = maps::endpoint(ifindex);
    // SAFETY: points into `endpoints`, read at once.
    let Some(endpoint) = (unsafe { endpoint.as_ref() }) else {
        return DROP;
    };
    let (gateway, gateway_mac, container_mac) = (
        endpoint.gateway_ifindex,
        endpoint.gateway_mac,
        endpoint.container_mac,
    );
    if set_macs(ctx, &gateway_mac, &container_mac).is_err() {
        return DROP;
    }
    // SAFETY: bpf_redirect has no memory arguments.
    unsafe { bpf_redirect(gateway, u64::from(BPF_F_INGRESS)) as i32 }
}

/// Makes the packet's answer in the scratch; its length from the IP header on, 0 for a packet
/// never to be answered. (A plain answer of each of these calls: the verifier takes one
/// register back from a BPF call, and LLVM returns a `Result` in two.)
#[inline(never)]
fn answer(ctx: &TcContext, translated: bool) -> usize {
    try_answer(ctx, translated).unwrap_or(0)
}

#[inline(always)]
fn try_answer(ctx: &TcContext, translated: bool) -> Result<usize, ()> {
    let scratch = answer_scratch.get_ptr_mut(0).ok_or(())?;
    // SAFETY: this CPU's slot of a per-CPU array; programs on one CPU do not overlap.
    let scratch = unsafe { &mut *scratch };
    let ethertype: u16 = load_anywhere(ctx, 12).map_err(drop)?;
    Ok(match u16::from_be(ethertype) {
        ETH_P_IP => answer_v4(ctx, scratch, translated),
        ETH_P_IPV6 => answer_v6(ctx, scratch, translated),
        _ => 0,
    })
}

/// Rewrites the packet into the answer of `length` bytes [`answer`] made; whether it was.
#[inline(never)]
fn send(ctx: &TcContext, length: usize) -> bool {
    try_send(ctx, length).is_ok()
}

#[inline(always)]
fn try_send(ctx: &TcContext, length: usize) -> Result<(), ()> {
    let scratch = answer_scratch.get_ptr_mut(0).ok_or(())?;
    // SAFETY: as in `try_answer`.
    let scratch = unsafe { &mut *scratch };
    load_into(ctx, 0, &mut scratch.macs)?;
    scratch.macs.rotate_left(6);
    // SAFETY: the context is this program's __sk_buff; the helper resizes the packet (it
    // refuses a GSO packet, which is then dropped).
    if unsafe { bpf_skb_change_tail(ctx.as_ptr().cast(), (ETH_HLEN + length) as u32, 0) } != 0 {
        return Err(());
    }
    ctx.store(0, &scratch.macs, 0).map_err(drop)?;
    match length {
        RESET_V4_LEN => store::<RESET_V4_LEN>(ctx, &scratch.out)?,
        PROHIBITED_V4_LEN => store::<PROHIBITED_V4_LEN>(ctx, &scratch.out)?,
        RESET_V6_LEN => store::<RESET_V6_LEN>(ctx, &scratch.out)?,
        _ => store::<PROHIBITED_V6_LEN>(ctx, &scratch.out)?,
    }
    // The checksums are this answer's; the hardware's verdict on the packet it was is not.
    // SAFETY: the context pointer is this program's __sk_buff.
    unsafe { bpf_csum_level(ctx.as_ptr().cast(), u64::from(BPF_CSUM_LEVEL_RESET)) };
    Ok(())
}

/// Writes the answer's first `N` bytes behind the Ethernet header.
fn store<const N: usize>(ctx: &TcContext, out: &[u8; ANSWER_MAX]) -> Result<(), ()> {
    let bytes: &[u8; N] = out[..N].try_into().map_err(drop)?;
    ctx.store(ETH_HLEN, bytes, u64::from(BPF_F_RECOMPUTE_CSUM))
        .map_err(drop)
}

/// An IPv4 packet's answer in `scratch.out`; its length from the IP header on, 0 for none.
#[inline(never)]
fn answer_v4(ctx: &TcContext, scratch: &mut AnswerScratch, translated: bool) -> usize {
    try_answer_v4(ctx, scratch, translated).unwrap_or(0)
}

#[inline(always)]
fn try_answer_v4(
    ctx: &TcContext,
    scratch: &mut AnswerScratch,
    translated: bool,
) -> Result<usize, ()> {
    load_into(ctx, ETH_HLEN, &mut scratch.ip[..20])?;
    load_l4(ctx, ETH_HLEN + 20, scratch.ip[9], &mut scratch.l4)?;
    let ip: &[u8; 20] = scratch.ip[..20].try_into().map_err(drop)?;
    if !translated {
        scratch.ends = Ends {
            local: Address::ipv4([ip[16], ip[17], ip[18], ip[19]]),
            local_port: u16::from_ne_bytes([scratch.l4[2], scratch.l4[3]]),
            remote: Address::ipv4([ip[12], ip[13], ip[14], ip[15]]),
            remote_port: u16::from_ne_bytes([scratch.l4[0], scratch.l4[1]]),
        };
    }
    let ends = &scratch.ends;
    let (length, protocol) = match rejection::kind_v4(ip, &scratch.l4) {
        Kind::Nothing => return Ok(0),
        Kind::Reset => {
            let total = u16::from_be_bytes([ip[2], ip[3]]);
            let header = u16::from(scratch.l4[12] >> 4) * 4;
            let payload = total.saturating_sub(20 + header);
            rejection::reset_v4(&scratch.l4, payload, ends, &mut scratch.out);
            (RESET_V4_LEN, PROTO_TCP)
        }
        Kind::Prohibited => {
            let l4: &[u8; 8] = scratch.l4[..8].try_into().map_err(drop)?;
            rejection::prohibited_v4(ip, l4, ends, &mut scratch.out);
            (PROHIBITED_V4_LEN, PROTO_ICMP)
        }
    };
    let header = checksum(&scratch.out[..20], 0)?;
    scratch.out[IPV4_CHECKSUM..IPV4_CHECKSUM + 2].copy_from_slice(&header.to_ne_bytes());
    if protocol == PROTO_TCP {
        rejection::pseudo_v4(&scratch.ends, PROTO_TCP, 20, &mut scratch.pseudo[..12]);
        let seed = partial(&scratch.pseudo[..12], 0)?;
        let tcp = checksum(&scratch.out[L4_V4..RESET_V4_LEN], seed)?;
        let at = L4_V4 + TCP_CHECKSUM;
        scratch.out[at..at + 2].copy_from_slice(&tcp.to_ne_bytes());
    } else {
        let icmp = checksum(&scratch.out[L4_V4..PROHIBITED_V4_LEN], 0)?;
        let at = L4_V4 + ICMP_CHECKSUM;
        scratch.out[at..at + 2].copy_from_slice(&icmp.to_ne_bytes());
    }
    Ok(length)
}

/// An IPv6 packet's answer in `scratch.out`; its length from the IP header on, 0 for none.
#[inline(never)]
fn answer_v6(ctx: &TcContext, scratch: &mut AnswerScratch, translated: bool) -> usize {
    try_answer_v6(ctx, scratch, translated).unwrap_or(0)
}

#[inline(always)]
fn try_answer_v6(
    ctx: &TcContext,
    scratch: &mut AnswerScratch,
    translated: bool,
) -> Result<usize, ()> {
    load_into(ctx, ETH_HLEN, &mut scratch.ip)?;
    load_l4(ctx, ETH_HLEN + 40, scratch.ip[6], &mut scratch.l4)?;
    if !translated {
        let ip = &scratch.ip;
        scratch.ends.local.bytes.copy_from_slice(&ip[24..40]);
        scratch.ends.remote.bytes.copy_from_slice(&ip[8..24]);
        scratch.ends.local_port = u16::from_ne_bytes([scratch.l4[2], scratch.l4[3]]);
        scratch.ends.remote_port = u16::from_ne_bytes([scratch.l4[0], scratch.l4[1]]);
    }
    let (ip, ends) = (&scratch.ip, &scratch.ends);
    let (length, protocol, span) = match rejection::kind_v6(ip, &scratch.l4) {
        Kind::Nothing => return Ok(0),
        Kind::Reset => {
            let total = u16::from_be_bytes([ip[4], ip[5]]);
            let header = u16::from(scratch.l4[12] >> 4) * 4;
            rejection::reset_v6(
                &scratch.l4,
                total.saturating_sub(header),
                ends,
                &mut scratch.out,
            );
            (RESET_V6_LEN, PROTO_TCP, 20)
        }
        Kind::Prohibited => {
            let l4: &[u8; 8] = scratch.l4[..8].try_into().map_err(drop)?;
            rejection::prohibited_v6(ip, l4, ends, &mut scratch.out);
            (PROHIBITED_V6_LEN, PROTO_ICMPV6, PROHIBITED_V6_LEN - L4_V6)
        }
    };
    rejection::pseudo_v6(&scratch.ends, protocol, span as u16, &mut scratch.pseudo);
    let seed = partial(&scratch.pseudo, 0)?;
    let (sum, at) = if protocol == PROTO_TCP {
        (
            checksum(&scratch.out[L4_V6..RESET_V6_LEN], seed)?,
            L4_V6 + TCP_CHECKSUM,
        )
    } else {
        (
            checksum(&scratch.out[L4_V6..PROHIBITED_V6_LEN], seed)?,
            L4_V6 + ICMP_CHECKSUM,
        )
    };
    scratch.out[at..at + 2].copy_from_slice(&sum.to_ne_bytes());
    Ok(length)
}

/// The start of the packet's L4 header at `offset`: a TCP header's 20 bytes, the first 8
/// of anything else (what a quote carries; the rest zero). A packet too short has no answer.
#[inline(always)]
fn load_l4(ctx: &TcContext, offset: usize, protocol: u8, l4: &mut [u8; 20]) -> Result<(), ()> {
    if protocol == PROTO_TCP {
        load_into(ctx, offset, l4)
    } else {
        l4[8..].fill(0);
        load_into(ctx, offset, &mut l4[..8])
    }
}

/// The packet's bytes at `offset` into `into` (of a length the verifier knows at each caller):
/// a packet too short for them is an error.
#[inline(always)]
fn load_into(ctx: &TcContext, offset: usize, into: &mut [u8]) -> Result<(), ()> {
    // SAFETY: `into` is memory of this program of the length given.
    let loaded = unsafe {
        bpf_skb_load_bytes(
            ctx.as_ptr().cast(),
            offset as u32,
            into.as_mut_ptr().cast(),
            into.len() as u32,
        )
    };
    if loaded == 0 { Ok(()) } else { Err(()) }
}

/// The ones' complement sum of `bytes` (a multiple of 4 long) on `seed`, unfolded.
fn partial(bytes: &[u8], seed: u32) -> Result<u32, ()> {
    // SAFETY: `bytes` is memory of this program (a map value) of the length given.
    let sum = unsafe {
        bpf_csum_diff(
            core::ptr::null_mut(),
            0,
            bytes.as_ptr().cast_mut().cast(),
            bytes.len() as u32,
            seed,
        )
    };
    u32::try_from(sum).map_err(drop)
}

/// The internet checksum of `bytes` on `seed`, as stored (the words as they lie in memory).
fn checksum(bytes: &[u8], seed: u32) -> Result<u16, ()> {
    Ok(!internet_checksum::fold(partial(bytes, seed)?))
}
