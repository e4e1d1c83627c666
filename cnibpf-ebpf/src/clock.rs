//! The datapath's one clock, for flow timestamps, expiry and event times.

use aya_ebpf::helpers::bpf_ktime_get_coarse_ns;

/// CLOCK_MONOTONIC as of the last timer tick (`CLOCK_MONOTONIC_COARSE`). Expiry counts
/// seconds, and the coarse clock reads no clocksource: in a virtual machine a paravirtual
/// clock read costs a packet tens of nanoseconds, several times over. Userspace compares with
/// CLOCK_MONOTONIC, which is never behind it.
#[inline(always)]
pub fn now_ns() -> u64 {
    // SAFETY: bpf_ktime_get_coarse_ns has no preconditions.
    unsafe { bpf_ktime_get_coarse_ns() }
}
