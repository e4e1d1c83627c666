//! Reading packet fields from the linear area: bounds checked against its end as the verifier
//! follows them, and read a word at a time.
//!
//! Packet fields are rarely aligned (an IPv4 address sits two bytes off a word boundary
//! behind the 14-byte Ethernet header). Rust reads an unaligned value one byte at a time on
//! this target, three instructions a byte to put it back together, and reading it as an
//! aligned value would be undefined behaviour. The kernel reads packets at any alignment on
//! the machines cnibpf runs on (and the verifier in strict mode assumes the IP header at a
//! word boundary), so a field is read with one load of its width, written as inline assembly,
//! which promises the compiler nothing about alignment.

use core::{arch::asm, mem::transmute_copy};

use aya_ebpf::programs::TcContext;

use super::DatapathError;

/// A header's bytes in the linear area, checked once against its end; its fields are read at
/// constant offsets from its start.
#[derive(Clone, Copy)]
pub struct Header {
    start: usize,
    len: usize,
}

impl Header {
    /// The `len` bytes at `offset`; `Truncated` when the linear area ends before them.
    #[inline(always)]
    pub fn at(ctx: &TcContext, offset: usize, len: usize) -> Result<Self, DatapathError> {
        let start = ctx.data() + offset;
        if start + len > ctx.data_end() {
            return Err(DatapathError::Truncated);
        }
        Ok(Self { start, len })
    }

    /// The field of type `T` at `offset` into the header (network byte order, as stored).
    /// The offset is a constant at every caller, so the check folds away.
    #[inline(always)]
    pub fn field<T: Copy>(&self, offset: usize) -> Result<T, DatapathError> {
        if offset + size_of::<T>() > self.len {
            return Err(DatapathError::Truncated);
        }
        // SAFETY: within the bytes `at` checked against the end of the linear area.
        Ok(unsafe { read((self.start + offset) as *const u8) })
    }
}

/// Reads a packet field from the linear area, checked against its end.
#[inline(always)]
pub fn load<T: Copy>(ctx: &TcContext, offset: usize) -> Result<T, DatapathError> {
    Header::at(ctx, offset, size_of::<T>())?.field(0)
}

/// `T` at `at`, read with loads of its width (four for 16 bytes) whatever `at`'s alignment.
///
/// # Safety
/// `at..at + size_of::<T>()` must be readable packet memory, and every bit pattern a valid `T`.
#[inline(always)]
unsafe fn read<T: Copy>(at: *const u8) -> T {
    // SAFETY: as the caller vouches; each arm reads exactly `size_of::<T>()` bytes into a
    // value of that size.
    unsafe {
        match size_of::<T>() {
            1 => transmute_copy(&at.read()),
            2 => transmute_copy(&load_u16(at)),
            4 => transmute_copy(&load_u32(at)),
            8 => transmute_copy(&load_u64(at)),
            16 => transmute_copy(&[
                load_u32(at),
                load_u32(at.add(4)),
                load_u32(at.add(8)),
                load_u32(at.add(12)),
            ]),
            _ => at.cast::<T>().read_unaligned(),
        }
    }
}

/// One load of `$width` bits from a packet address of any alignment.
macro_rules! unaligned_load {
    ($name:ident, $type:ty, $c_type:literal) => {
        /// # Safety
        /// The bytes at `at` must be readable packet memory.
        #[inline(always)]
        unsafe fn $name(at: *const u8) -> $type {
            let value: $type;
            // SAFETY: a plain load, as the caller vouches for the memory.
            unsafe {
                asm!(
                    concat!("{value} = *(", $c_type, " *)({at} + 0)"),
                    at = in(reg) at,
                    value = lateout(reg) value,
                    options(readonly, nostack, preserves_flags),
                );
            }
            value
        }
    };
}

unaligned_load!(load_u16, u16, "u16");
unaligned_load!(load_u32, u32, "u32");
unaligned_load!(load_u64, u64, "u64");
