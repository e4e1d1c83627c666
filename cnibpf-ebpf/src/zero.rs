//! Zeroing as stores as wide as the value's alignment allows, volatile so that they stay the
//! stores written: LLVM merges plain zero stores into a `memset`, and how that is expanded
//! depends on the linker's settings (with bpf-linker's default in-order expansion, which this
//! object is built without, it is a call of compiler-builtins' byte loop, per packet).

use core::mem::MaybeUninit;

/// Types whose all-zero bytes are a valid value.
///
/// # Safety
/// Only for types made of integers and arrays of them.
pub unsafe trait Zeroable {}

/// `slot` zeroed in place.
#[inline(always)]
pub fn zeroed<T: Zeroable>(slot: &mut MaybeUninit<T>) -> &mut T {
    // SAFETY: all of `slot` is zeroed, a valid value of a `Zeroable` type; `T`'s alignment
    // is the widest store `zero` makes.
    unsafe {
        zero(slot.as_mut_ptr().cast(), size_of::<T>(), align_of::<T>());
        slot.assume_init_mut()
    }
}

/// Zeroes `len` bytes at `at` with volatile stores as wide as `align` allows (up to eight
/// bytes).
///
/// # Safety
/// `at..at + len` must be writable, and `at` aligned to `align`.
#[inline(always)]
pub unsafe fn zero(at: *mut u8, len: usize, align: usize) {
    let width = align.min(8);
    let mut done = 0;
    // SAFETY: within the range the caller vouches for, each store aligned to its width.
    unsafe {
        while done + width <= len {
            match width {
                8 => at.add(done).cast::<u64>().write_volatile(0),
                4 => at.add(done).cast::<u32>().write_volatile(0),
                2 => at.add(done).cast::<u16>().write_volatile(0),
                _ => at.add(done).write_volatile(0),
            }
            done += width;
        }
        while done < len {
            at.add(done).write_volatile(0);
            done += 1;
        }
    }
}
