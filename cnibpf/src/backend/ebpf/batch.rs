//! Reading a whole hash map with `BPF_MAP_LOOKUP_BATCH`: thousands of entries per system call
//! instead of two calls per entry (aya 0.16 has no batch operations). DEL and GC read the flow
//! tables whole; with 262,144 entries entry-by-entry reading takes about a second.

use std::{
    io,
    os::fd::{AsFd as _, AsRawFd as _},
};

use aya::{
    Pod,
    maps::{IterableMap, MapData},
};

/// `BPF_MAP_LOOKUP_BATCH` from the kernel's `enum bpf_cmd`.
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
/// Entries asked for by the first call, and at most per call. A call's buffers are allocated
/// (and touched) in this process and again in the kernel, whatever the map's fill: a DEL
/// beside nearly empty flow tables starts small, a read of a full table doubles its way up.
const FIRST_CHUNK: usize = 64;
const MAX_CHUNK: usize = 4_096;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Every entry of a hash or LRU hash map.
pub fn entries<K, V, M>(map: &M) -> io::Result<Vec<(K, V)>>
where
    K: Pod + Default,
    V: Pod + Default,
    M: IterableMap<K, V>,
{
    let data: &MapData = map.map();
    let fd = u32::try_from(data.fd().as_fd().as_raw_fd())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut chunk = FIRST_CHUNK;
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    // Hash maps' batch position is a bucket index (u32); the first call passes none.
    let mut position: Option<u32> = None;
    let mut next_position: u32 = 0;
    let mut all = Vec::new();
    loop {
        keys.resize(chunk, K::default());
        values.resize(chunk, V::default());
        let mut attr = BatchAttr {
            in_batch: position
                .as_ref()
                // fail-closed: an Option (the first call has no position), no error to lose.
                .map_or(0, |position| core::ptr::from_ref(position) as u64),
            out_batch: (&raw mut next_position) as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: chunk as u32,
            map_fd: fd,
            ..BatchAttr::default()
        };
        // SAFETY: bpf(2) with a correctly laid out batch attribute whose buffers hold `count`
        // keys and values of the map's sizes (the map types were checked when aya opened it)
        // and a u32 for each batch position; all outlive the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_LOOKUP_BATCH,
                &raw mut attr,
                size_of::<BatchAttr>(),
            )
        };
        let done = if rc == 0 {
            false
        } else {
            let error = io::Error::last_os_error();
            match error.raw_os_error() {
                // The end of the map, possibly with a last partial chunk.
                Some(libc::ENOENT) => true,
                // One bucket holds more entries than the buffers: the same position again,
                // with room for it.
                Some(libc::ENOSPC) if chunk < MAX_CHUNK => {
                    chunk *= 2;
                    continue;
                }
                _ => return Err(error),
            }
        };
        let filled = attr.count as usize;
        all.extend(
            keys[..filled]
                .iter()
                .copied()
                .zip(values[..filled].iter().copied()),
        );
        if done {
            return Ok(all);
        }
        position = Some(next_position);
        // A full chunk: the map holds more; the next call asks for more at once.
        if filled == chunk && chunk < MAX_CHUNK {
            chunk *= 2;
        }
    }
}
