//! The internet checksum (RFC 1071) updated for changed 16-bit words (RFC 1624, eqn. 3) — not a
//! map: the arithmetic the programs use where one write of a header replaces several checksum
//! helper calls, and that their tests check against a full computation.
//!
//! Words are taken as they lie in memory (`u16::from_ne_bytes` of the two bytes): the ones'
//! complement sum is the same in either byte order, so the result is stored as it came.

/// The checksum `checksum` becomes when one word of what it covers changes from `old` to
/// `new`.
pub const fn replace(checksum: u16, old: u16, new: u16) -> u16 {
    // HC' = ~(~HC + ~m + m')
    let sum = (!checksum) as u32 + (!old) as u32 + new as u32;
    !fold(sum)
}

/// [`replace`] for a 32-bit field (two words).
pub const fn replace4(checksum: u16, old: [u8; 4], new: [u8; 4]) -> u16 {
    let first = replace(
        checksum,
        u16::from_ne_bytes([old[0], old[1]]),
        u16::from_ne_bytes([new[0], new[1]]),
    );
    replace(
        first,
        u16::from_ne_bytes([old[2], old[3]]),
        u16::from_ne_bytes([new[2], new[3]]),
    )
}

/// The ones' complement sum of two 32-bit partial sums (the end-around carry added back).
pub const fn add(a: u32, b: u32) -> u32 {
    let (sum, carry) = a.overflowing_add(b);
    sum.wrapping_add(carry as u32)
}

/// A 32-bit ones' complement sum folded to 16 bits (twice: the first fold can carry).
pub const fn fold(sum: u32) -> u16 {
    let once = (sum & 0xffff) + (sum >> 16);
    ((once & 0xffff) + (once >> 16)) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_sums_add_and_fold_as_ones_complement() {
        assert_eq!(add(1, 2), 3);
        // The carry out of bit 31 comes back in at bit 0.
        assert_eq!(add(0xffff_ffff, 1), 1);
        assert_eq!(add(0x8000_0000, 0x8000_0001), 2);
        assert_eq!(fold(0x0001_fffe), 0xffff);
        assert_eq!(fold(0xffff_ffff), 0xffff);
        assert_eq!(fold(0x1234), 0x1234);
        // Folding a sum of words gives the sum a 16-bit accumulator would.
        let words = [0xffffu32, 0xffff, 0x0002];
        let wide = words.iter().fold(0, |sum, word| add(sum, *word));
        let narrow = words.iter().fold(0u16, |sum, word| {
            let (total, carry) = sum.overflowing_add(*word as u16);
            total + u16::from(carry)
        });
        assert_eq!(fold(wide), narrow);
    }

    /// The checksum of `bytes` computed whole, as a sender does.
    fn checksum(bytes: &[u8]) -> u16 {
        let mut sum = 0u32;
        for pair in bytes.chunks(2) {
            sum += u32::from(u16::from_ne_bytes([pair[0], *pair.get(1).unwrap_or(&0)]));
        }
        !fold(sum)
    }

    /// An IPv4 header with its checksum (bytes 10..12) filled in.
    fn header(ttl: u8, source: [u8; 4]) -> [u8; 20] {
        let mut header = [
            0x45, 0, 0, 60, 0x1c, 0x46, 0x40, 0, ttl, 6, 0, 0, 0, 0, 0, 0, 198, 51, 100, 7,
        ];
        header[12..16].copy_from_slice(&source);
        let sum = checksum(&header);
        header[10..12].copy_from_slice(&sum.to_ne_bytes());
        header
    }

    fn stored(header: &[u8; 20]) -> u16 {
        u16::from_ne_bytes([header[10], header[11]])
    }

    #[test]
    fn a_masqueraded_header_gets_the_checksum_a_sender_would_compute() {
        let sources = [
            [10, 22, 0, 5],
            [0, 0, 0, 0],
            [255, 255, 255, 255],
            [203, 0, 113, 1],
        ];
        for old_source in sources {
            for new_source in sources {
                for ttl in [2u8, 64, 255] {
                    let before = header(ttl, old_source);
                    let after = header(ttl - 1, new_source);
                    let ttl_word = |header: &[u8; 20]| u16::from_ne_bytes([header[8], header[9]]);
                    let updated = replace4(
                        replace(stored(&before), ttl_word(&before), ttl_word(&after)),
                        old_source,
                        new_source,
                    );
                    let mut rewritten = after;
                    rewritten[10..12].copy_from_slice(&updated.to_ne_bytes());
                    assert_eq!(
                        checksum(&rewritten),
                        0,
                        "{old_source:?} -> {new_source:?}, TTL {ttl}: the header no longer sums to zero"
                    );
                }
            }
        }
    }

    #[test]
    fn an_unchanged_word_leaves_the_checksum_alone() {
        let before = header(64, [10, 22, 0, 5]);
        assert_eq!(
            replace4(stored(&before), [10, 22, 0, 5], [10, 22, 0, 5]),
            stored(&before)
        );
    }
}
