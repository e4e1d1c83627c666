//! Addresses in the 16-byte map form (IPv4 in the first four bytes).

use super::zero;

/// An IPv4 address in the 16-byte map form.
pub fn widen(addr: [u8; 4]) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[0] = addr[0];
    out[1] = addr[1];
    out[2] = addr[2];
    out[3] = addr[3];
    out
}

/// [`widen`] as one 128-bit integer, for the per-packet path: the zero array `widen` starts
/// from becomes a `memset` call (see [`zero`]). (Not `widen` itself: the registers LLVM then
/// picks elsewhere hand the verifier bits it sees unset.)
#[inline(always)]
pub(super) fn widen_fast(addr: [u8; 4]) -> [u8; 16] {
    u128::from(u32::from_le_bytes(addr)).to_le_bytes()
}

/// Sets `addr` to the unspecified address (see [`zero`]).
#[inline(always)]
pub fn clear_address(addr: &mut [u8; 16]) {
    // SAFETY: the 16 bytes of `addr`.
    unsafe { zero(addr.as_mut_ptr(), addr.len()) };
}

/// An address as the four 32-bit words BPF helper structures take.
pub fn words(addr: &[u8; 16]) -> [u32; 4] {
    [
        u32::from_ne_bytes([addr[0], addr[1], addr[2], addr[3]]),
        u32::from_ne_bytes([addr[4], addr[5], addr[6], addr[7]]),
        u32::from_ne_bytes([addr[8], addr[9], addr[10], addr[11]]),
        u32::from_ne_bytes([addr[12], addr[13], addr[14], addr[15]]),
    ]
}

/// The address `words` made: the words' bytes in order.
pub fn unwords(words: [u32; 4]) -> [u8; 16] {
    let mut addr = [0u8; 16];
    for (index, word) in words.iter().enumerate() {
        let bytes = word.to_ne_bytes();
        addr[index * 4] = bytes[0];
        addr[index * 4 + 1] = bytes[1];
        addr[index * 4 + 2] = bytes[2];
        addr[index * 4 + 3] = bytes[3];
    }
    addr
}
