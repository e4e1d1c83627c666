//! Programs assembled in place and loaded with plain `bpf(2)` calls, no object file: someone
//! else's tcx programs in the tests ([`crate::foreign`]) and the operations the benches price
//! one by one.

use std::{
    io,
    os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
};

/// `bpf(2)` commands and the program type (uapi).
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;

/// One eBPF instruction: opcode, registers, offset, immediate.
pub const fn instruction(opcode: u8, dst: u8, src: u8, offset: i16, immediate: i32) -> u64 {
    let offset = offset.to_le_bytes();
    let immediate = immediate.to_le_bytes();
    u64::from_le_bytes([
        opcode,
        (src << 4) | dst,
        offset[0],
        offset[1],
        immediate[0],
        immediate[1],
        immediate[2],
        immediate[3],
    ])
}

/// bpf(2) with `attr`, which the kernel may write back into (test runs, object info); its
/// non-negative answer (a new descriptor, or 0).
pub fn bpf(command: libc::c_long, attr: &mut [u8; 128]) -> io::Result<libc::c_long> {
    // SAFETY: bpf(2) reads and writes `size` bytes of `attr`, a zero-initialised union
    // bpf_attr whose pointers (keys, values, instructions, packets) outlive the call, and
    // returns a descriptor, 0 or -1.
    let answer = unsafe { libc::syscall(libc::SYS_bpf, command, attr.as_mut_ptr(), attr.len()) };
    if answer < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(answer)
}

/// A descriptor the kernel just returned, owned from here on.
pub fn owned(fd: libc::c_long) -> io::Result<OwnedFd> {
    let fd = i32::try_from(fd).map_err(|_| io::Error::other("descriptor out of range"))?;
    // SAFETY: a descriptor the kernel just returned, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Loads `instructions` as a TC classifier (GPL); a refusal carries the verifier's log.
pub fn load_classifier(instructions: &[u64]) -> io::Result<OwnedFd> {
    let license = c"GPL";
    let mut log = vec![0u8; 64 * 1024];
    // union bpf_attr, BPF_PROG_LOAD: prog_type, insn_cnt, insns, license, log_level,
    // log_size, log_buf.
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&BPF_PROG_TYPE_SCHED_CLS.to_ne_bytes());
    attr[4..8].copy_from_slice(&(instructions.len() as u32).to_ne_bytes());
    attr[8..16].copy_from_slice(&(instructions.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    attr[24..28].copy_from_slice(&1u32.to_ne_bytes());
    attr[28..32].copy_from_slice(&(log.len() as u32).to_ne_bytes());
    attr[32..40].copy_from_slice(&(log.as_mut_ptr() as u64).to_ne_bytes());
    match bpf(BPF_PROG_LOAD, &mut attr) {
        Ok(fd) => owned(fd),
        Err(error) => {
            let end = log.iter().position(|byte| *byte == 0).unwrap_or(log.len());
            Err(io::Error::new(
                error.kind(),
                format!(
                    "{error}; verifier: {}",
                    String::from_utf8_lossy(&log[..end])
                ),
            ))
        }
    }
}

/// `BPF_MAP_LOOKUP_ELEM` and `BPF_MAP_GET_NEXT_KEY`.
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;

/// Every entry of the hash or LRU hash map behind `map`, as keys of `key_size` and values of
/// `value_size` bytes (a map's spec says them), read one key at a time.
pub fn map_entries(
    map: BorrowedFd<'_>,
    key_size: usize,
    value_size: usize,
) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let fd = u32::try_from(map.as_raw_fd()).map_err(|_| io::Error::other("descriptor"))?;
    let mut entries = Vec::new();
    let mut key: Option<Vec<u8>> = None;
    loop {
        let mut next = vec![0u8; key_size];
        // union bpf_attr, map element commands: map_fd, key, value / next_key, flags.
        let mut attr = [0u8; 128];
        attr[0..4].copy_from_slice(&fd.to_ne_bytes());
        let key_pointer = key.as_ref().map_or(0, |key| key.as_ptr() as u64);
        attr[8..16].copy_from_slice(&key_pointer.to_ne_bytes());
        attr[16..24].copy_from_slice(&(next.as_mut_ptr() as u64).to_ne_bytes());
        match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
            Ok(_) => {}
            Err(error) if error.raw_os_error() == Some(libc::ENOENT) => return Ok(entries),
            Err(error) => return Err(error),
        }
        let mut value = vec![0u8; value_size];
        let mut attr = [0u8; 128];
        attr[0..4].copy_from_slice(&fd.to_ne_bytes());
        attr[8..16].copy_from_slice(&(next.as_ptr() as u64).to_ne_bytes());
        attr[16..24].copy_from_slice(&(value.as_mut_ptr() as u64).to_ne_bytes());
        match bpf(BPF_MAP_LOOKUP_ELEM, &mut attr) {
            Ok(_) => entries.push((next.clone(), value)),
            // Deleted since its key was listed (an LRU map evicts as it likes).
            Err(error) if error.raw_os_error() == Some(libc::ENOENT) => {}
            Err(error) => return Err(error),
        }
        key = Some(next);
    }
}

#[cfg(test)]
mod tests {
    use super::instruction;

    #[test]
    fn an_instruction_packs_as_the_kernel_reads_it() {
        // r0 = -1 (mov64 imm): opcode, dst in the low nibble, immediate in the top half.
        assert_eq!(instruction(0xb7, 0, 0, 0, -1), 0xffff_ffff_0000_00b7);
        // *(u64 *)(r10 - 48) = r0, then *(u32 *)(r10 - 8) = r3: dst in the low nibble, src in
        // the high one, the offset in two's complement.
        assert_eq!(instruction(0x7b, 10, 0, -48, 0), 0x0000_0000_ffd0_0a7b);
        assert_eq!(instruction(0x63, 10, 3, -8, 0), 0x0000_0000_fff8_3a63);
    }
}
