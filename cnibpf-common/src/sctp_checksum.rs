//! SCTP's checksum (CRC32c, RFC 9260 appendix A) updated for new ports without reading the
//! payload — not a map: the arithmetic both the programs and their tests need.
//!
//! A CRC is linear over GF(2): for two messages of one length, the CRCs differ by the CRC
//! (zero initial value, no final inversion) of their difference. Ports are the first four
//! bytes of the packet, so the difference is those four bytes' xor `d` followed by zeros to
//! the packet's end, and its CRC is `d · x^(8 · length) mod P` (reflected: `d` read
//! little-endian). The power comes from two tables of 256 (by the length's low and high
//! byte), so a change costs two products of 32 branch-free steps each, which the programs run
//! with `bpf_loop` (see [`Product`]).

/// CRC32c's polynomial, bit-reversed (the CRC runs least significant bit first).
const POLYNOMIAL: u32 = 0x82F6_3B78;

/// `a · b mod P`, in the reflected form (bit 31 is the coefficient of x^0).
const fn multiply(a: u32, b: u32) -> u32 {
    let mut product = Product::new(a, b);
    let mut bit = 0;
    while bit < Product::STEPS {
        product.step(bit);
        bit += 1;
    }
    product.value()
}

/// `factor^i mod P` for i = 0..256.
const fn powers(factor: u32) -> [u32; 256] {
    let mut table = [0; 256];
    // x^0, reflected.
    table[0] = 1 << 31;
    let mut i = 1;
    while i < 256 {
        table[i] = multiply(table[i - 1], factor);
        i += 1;
    }
    table
}

/// `x^(8 · i) mod P`: x^8 is x^1 (reflected) squared three times.
static LOW_POWERS: [u32; 256] = {
    let x2 = multiply(1 << 30, 1 << 30);
    let x4 = multiply(x2, x2);
    powers(multiply(x4, x4))
};

/// `x^(8 · 256 · i) mod P`.
static HIGH_POWERS: [u32; 256] = powers(multiply(LOW_POWERS[255], LOW_POWERS[1]));

/// A product `a · b mod P` computed one step (one bit of `a`) at a time.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Product {
    a: u32,
    b: u32,
    value: u32,
}

impl Product {
    pub const STEPS: u32 = 32;

    pub const fn new(a: u32, b: u32) -> Self {
        Self { a, b, value: 0 }
    }

    /// Takes bit `bit` of `a` (steps in order, 0 to `STEPS - 1`).
    pub const fn step(&mut self, bit: u32) {
        self.value ^= self.b & 0u32.wrapping_sub((self.a >> (31 - (bit & 31))) & 1);
        self.b = (self.b >> 1) ^ (POLYNOMIAL & 0u32.wrapping_sub(self.b & 1));
    }

    pub const fn value(&self) -> u32 {
        self.value
    }
}

/// The two products of a port change of an SCTP packet of `length` (< 65,536) bytes, its
/// common header and chunks: first `low · high` (their factors), then that times `difference`.
pub fn length_factors(length: u32) -> (u32, u32) {
    (
        LOW_POWERS[(length & 0xff) as usize],
        HIGH_POWERS[((length >> 8) & 0xff) as usize],
    )
}

/// The ports' difference as the product's other factor.
pub fn difference(old: [u8; 4], new: [u8; 4]) -> u32 {
    u32::from_le_bytes([
        old[0] ^ new[0],
        old[1] ^ new[1],
        old[2] ^ new[2],
        old[3] ^ new[3],
    ])
}

/// What to xor into the checksum of an SCTP packet of `length` bytes whose ports (its first
/// four bytes, as on the wire) change from `old` to `new`. The checksum field holds the CRC
/// little-endian: read it as a little-endian `u32`, xor, write it back the same way.
pub fn port_change(old: [u8; 4], new: [u8; 4], length: u32) -> u32 {
    let (low, high) = length_factors(length);
    multiply(multiply(low, high), difference(old, new))
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use super::*;

    /// CRC32c of a whole packet, bit by bit, as RFC 9260 computes it.
    fn crc32c(bytes: &[u8]) -> u32 {
        let mut crc = !0u32;
        for byte in bytes {
            crc ^= u32::from(*byte);
            for _ in 0..8 {
                crc = (crc >> 1) ^ (POLYNOMIAL & 0u32.wrapping_sub(crc & 1));
            }
        }
        !crc
    }

    fn packet(ports: [u8; 4], length: usize, seed: u32) -> Vec<u8> {
        let mut state = seed;
        let mut packet: Vec<u8> = (0..length)
            .map(|_| {
                state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                (state >> 16) as u8
            })
            .collect();
        packet[..4].copy_from_slice(&ports);
        packet[8..12].fill(0);
        let crc = crc32c(&packet);
        packet[8..12].copy_from_slice(&crc.to_le_bytes());
        packet
    }

    fn checksum(packet: &[u8]) -> u32 {
        u32::from_le_bytes([packet[8], packet[9], packet[10], packet[11]])
    }

    #[test]
    fn the_updated_checksum_is_the_recomputed_one() {
        for (length, seed) in [
            (12, 1),
            (28, 2),
            (100, 3),
            (1452, 4),
            (9000, 5),
            (65_535, 6),
        ] {
            let old = [0x23, 0x8c, 0x00, 0x84];
            let new = [0x23, 0x8c, 0x1f, 0x90];
            let before = packet(old, length, seed);
            let updated = checksum(&before) ^ port_change(old, new, length as u32);
            assert_eq!(
                updated,
                checksum(&packet(new, length, seed)),
                "length {length}"
            );
        }
    }

    #[test]
    fn unchanged_ports_change_nothing() {
        assert_eq!(port_change([1, 2, 3, 4], [1, 2, 3, 4], 1500), 0);
    }
}
