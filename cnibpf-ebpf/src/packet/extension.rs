//! IPv6 extension headers, walked to the transport header one header per `bpf_loop` step: the
//! verifier checks the step once, not every header at every path that parses, and each
//! program carries the step once.

use aya_ebpf::{
    EbpfContext as _,
    cty::c_void,
    helpers::{bpf_loop, bpf_skb_load_bytes},
    programs::TcContext,
};

use super::{DatapathError, ETH_HLEN, Fragment, IPV6_HLEN, load_anywhere};

/// The IPv6 fragment header's next-header value.
const IPV6_FRAGMENT_HEADER: u8 = 44;
const IPV6_FRAGMENT_HLEN: u32 = 8;
/// IPv6 extension headers a translation may pass: hop-by-hop options, destination options, a
/// routing header with no segments left (the destination is final), and a fragment header.
const IPV6_HOP_BY_HOP: u8 = 0;
const IPV6_ROUTING: u8 = 43;
const IPV6_DESTINATION_OPTIONS: u8 = 60;
/// How many extension headers are walked: a packet with more is left alone.
const MAX_EXTENSION_HEADERS: u32 = 4;
/// Where the transport header can start at most: each header walked is at most 2,048 bytes.
const MAX_L4_OFF: u32 = (ETH_HLEN + IPV6_HLEN) as u32 + MAX_EXTENSION_HEADERS * 2_048;

/// Where an IPv6 packet's transport header is.
pub struct Walked {
    pub protocol: u8,
    pub l4_off: usize,
    /// Where the packet stands in its datagram, and the datagram's identification (zero for
    /// a whole one).
    pub fragment: Fragment,
    pub fragment_id: u32,
}

/// Walks an IPv6 packet's extension headers to its transport header; `None` for a routing
/// header with segments left (its destination is not the final one), or more headers than
/// are walked. Read with `bpf_skb_load_bytes`: the headers need not be linear.
#[inline(always)]
pub fn extension_headers(ctx: &TcContext) -> Result<Option<Walked>, DatapathError> {
    let next_header: u8 = load_anywhere(ctx, ETH_HLEN + 6)?;
    let mut walk = Walk {
        skb: ctx.as_ptr(),
        offset: (ETH_HLEN + IPV6_HLEN) as u32,
        fragment_id: 0,
        next_header,
        fragment: Fragment::Whole,
        outcome: WALKING,
    };
    if is_extension_header(next_header) {
        // SAFETY: the callback has the signature bpf_loop expects; its context is `walk`,
        // which outlives the call.
        unsafe {
            bpf_loop(
                MAX_EXTENSION_HEADERS,
                step as *mut c_void,
                (&raw mut walk).cast(),
                0,
            )
        };
    } else {
        walk.outcome = FOUND;
    }
    match walk.outcome {
        TRUNCATED => Err(DatapathError::Truncated),
        // The bound, checked here, is what lets the caller read at the offset directly.
        FOUND if walk.offset <= MAX_L4_OFF => Ok(Some(Walked {
            protocol: walk.next_header,
            l4_off: walk.offset as usize,
            fragment: walk.fragment,
            fragment_id: walk.fragment_id,
        })),
        _ => Ok(None),
    }
}

fn is_extension_header(next_header: u8) -> bool {
    matches!(
        next_header,
        IPV6_HOP_BY_HOP | IPV6_DESTINATION_OPTIONS | IPV6_ROUTING | IPV6_FRAGMENT_HEADER
    )
}

/// The state of a walk, the `bpf_loop` context (on the walker's stack).
#[repr(C)]
struct Walk {
    skb: *mut c_void,
    /// Where the header `next_header` names starts.
    offset: u32,
    fragment_id: u32,
    next_header: u8,
    fragment: Fragment,
    outcome: u8,
}

/// `Walk::outcome`: still walking (after the last step: too many headers), the transport
/// header found, a header refused, or the packet ending inside a header.
const WALKING: u8 = 0;
const FOUND: u8 = 1;
const REFUSED: u8 = 2;
const TRUNCATED: u8 = 3;

/// One header of the walk (`bpf_loop` callback); returns 1 once the walk is over.
extern "C" fn step(_: u64, context: *mut c_void) -> i64 {
    // SAFETY: `extension_headers` passes its `Walk`, alive for the whole loop.
    let walk = unsafe { &mut *context.cast::<Walk>() };
    let length = match walk.next_header {
        IPV6_HOP_BY_HOP | IPV6_DESTINATION_OPTIONS | IPV6_ROUTING => 4,
        IPV6_FRAGMENT_HEADER => 8,
        _ => {
            walk.outcome = FOUND;
            return 1;
        }
    };
    let mut header = [0u8; 8];
    // SAFETY: `skb` is the program's context, `header` 8 bytes of this frame's stack, at
    // least `length`; the helper checks the packet's bounds itself.
    let read =
        unsafe { bpf_skb_load_bytes(walk.skb, walk.offset, header.as_mut_ptr().cast(), length) };
    if read != 0 {
        walk.outcome = TRUNCATED;
        return 1;
    }
    if walk.next_header == IPV6_FRAGMENT_HEADER {
        walk.fragment = Fragment::of_ipv6(u16::from_be_bytes([header[2], header[3]]));
        walk.fragment_id = u32::from_ne_bytes([header[4], header[5], header[6], header[7]]);
        walk.offset += IPV6_FRAGMENT_HLEN;
    } else if walk.next_header == IPV6_ROUTING && header[3] != 0 {
        // Segments left: the destination is not the final one.
        walk.outcome = REFUSED;
        return 1;
    } else {
        // Length in 8-byte units beyond the first 8.
        walk.offset += (u32::from(header[1]) + 1) * 8;
    }
    walk.next_header = header[0];
    0
}
