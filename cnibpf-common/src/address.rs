//! [`Address`]: an IPv4 or IPv6 address as every map key and value, and every program, holds it.

/// 16 bytes in network order: an IPv6 address, or an IPv4 address in the first four bytes with
/// zeros after (a `family` field beside it says which). Aligned to four bytes, so that the BPF
/// target copies and compares it a word at a time — a plain `[u8; 16]`, aligned to one, is
/// moved and compared byte by byte, 32 instructions a copy. Every map type keeps its addresses
/// at offsets that are multiples of four, so the bytes of each type are what they were as
/// arrays; `bpftool map dump` shows them as `bytes`.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, Hash, PartialOrd, Ord)]
#[expect(
    clippy::derived_hash_with_manual_eq,
    reason = "`eq` holds exactly when the bytes are equal, which is what `Hash` hashes"
)]
pub struct Address {
    pub bytes: [u8; 16],
}
const _: () = assert!(size_of::<Address>() == 16 && align_of::<Address>() == 4);

impl Address {
    /// The unspecified address (`0.0.0.0` or `::`), which keys use for "any".
    pub const UNSPECIFIED: Self = Self { bytes: [0; 16] };

    #[inline(always)]
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        Self { bytes }
    }

    /// An IPv4 address, in the first word.
    #[inline(always)]
    pub const fn ipv4(octets: [u8; 4]) -> Self {
        Self::from_words([u32::from_ne_bytes(octets), 0, 0, 0])
    }

    /// The four words in memory order (each in network byte order): what BPF helper
    /// structures take, and how this type is copied and compared.
    #[inline(always)]
    pub const fn words(&self) -> [u32; 4] {
        // SAFETY: `Address` is 16 bytes aligned to 4, the size and alignment of `[u32; 4]`,
        // and every bit pattern is a valid `[u32; 4]`.
        unsafe { *(&raw const *self).cast::<[u32; 4]>() }
    }

    #[inline(always)]
    pub const fn from_words(words: [u32; 4]) -> Self {
        // SAFETY: as in `words`, the other way.
        unsafe { core::mem::transmute::<[u32; 4], Self>(words) }
    }

    /// An IPv4 address's four bytes (the first word).
    #[inline(always)]
    pub const fn ipv4_octets(&self) -> [u8; 4] {
        self.words()[0].to_ne_bytes()
    }

    #[inline(always)]
    pub const fn is_unspecified(&self) -> bool {
        let [a, b, c, d] = self.words();
        a | b | c | d == 0
    }

    /// Whether an IPv6 address is link-local (fe80::/10): no source for what leaves its link.
    #[inline(always)]
    pub const fn is_ipv6_link_local(&self) -> bool {
        self.bytes[0] == 0xfe && self.bytes[1] & 0xc0 == 0x80
    }
}

/// Compared a word at a time, without a branch per word (equal exactly when the bytes are, as
/// the derived order sees them).
impl PartialEq for Address {
    #[inline(always)]
    fn eq(&self, other: &Self) -> bool {
        let ([a, b, c, d], [e, f, g, h]) = (self.words(), other.words());
        (a ^ e) | (b ^ f) | (c ^ g) | (d ^ h) == 0
    }
}

impl Eq for Address {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_the_bytes_in_memory_order() {
        let address = Address::ipv4([10, 22, 0, 2]);
        assert_eq!(
            address.bytes,
            [10, 22, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(address.ipv4_octets(), [10, 22, 0, 2]);
        assert_eq!(Address::from_words(address.words()), address);
        assert!(Address::UNSPECIFIED.is_unspecified() && !address.is_unspecified());
        let mut link_local = Address::UNSPECIFIED;
        link_local.bytes[..2].copy_from_slice(&[0xfe, 0x80]);
        assert!(link_local.is_ipv6_link_local() && !address.is_ipv6_link_local());
        link_local.bytes[1] = 0xc0;
        assert!(
            !link_local.is_ipv6_link_local(),
            "fec0::/10 is not fe80::/10"
        );
        let mut other = address;
        other.bytes[15] = 1;
        assert_ne!(other, address);
    }
}
