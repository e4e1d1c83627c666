//! Reading a whole hash map with `BPF_MAP_LOOKUP_BATCH`: thousands of entries per system call
//! instead of two calls per entry (aya 0.16 has no batch operations). DEL and GC read the flow
//! tables whole; with 262,144 entries entry-by-entry reading takes about a second. The core
//! reads bytes of the sizes a map's [`MapSpec`] gives, so that a resize copies any map by its
//! spec alone; typed readers sit on it.

use std::{
    io,
    os::fd::{AsFd as _, BorrowedFd},
};

use aya::{
    Pod,
    maps::{IterableMap, MapData},
};
use cnibpf_common::map_spec::MapSpec;

use super::sys::{
    self, BPF_MAP_LOOKUP_BATCH, BPF_MAP_UPDATE_BATCH, BPF_MAP_UPDATE_ELEM, fd_number,
};

/// `BPF_NOEXIST`: an update that leaves an existing entry alone.
const BPF_NOEXIST: u64 = 1;
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

/// The element members of `union bpf_attr`.
#[repr(C)]
struct ElementAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    /// The value, or the next key for `BPF_MAP_GET_NEXT_KEY`.
    value: u64,
    flags: u64,
}

/// A map's entries as bytes: `count` keys and values laid end to end.
#[derive(Debug, Default)]
pub struct RawEntries {
    keys: Vec<u8>,
    values: Vec<u8>,
    key_size: usize,
    value_size: usize,
}

impl RawEntries {
    pub fn len(&self) -> usize {
        self.keys.len() / self.key_size.max(1)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.keys
            .chunks_exact(self.key_size.max(1))
            .zip(self.values.chunks_exact(self.value_size.max(1)))
    }
}

/// The bytes of one value of the map of `spec` as the kernel reads and writes it: every
/// possible CPU's for a per-CPU map.
pub fn value_bytes(spec: &MapSpec) -> io::Result<usize> {
    if !spec.kind.per_cpu() {
        return Ok(spec.value_size);
    }
    let cpus = aya::util::nr_cpus().map_err(|(_, error)| error)?;
    Ok(spec.value_stride() * cpus.get() as usize)
}

/// Every entry of a hash, LRU hash or per-CPU hash map, as bytes of the sizes `spec` gives.
pub fn raw_entries(map: &MapData, spec: &MapSpec) -> io::Result<RawEntries> {
    let (key_size, value_size) = (spec.key_size, value_bytes(spec)?);
    read_all(map.fd().as_fd(), key_size, value_size)
}

/// Every entry of a hash or LRU hash map.
pub fn entries<K, V, M>(map: &M) -> io::Result<Vec<(K, V)>>
where
    K: Pod,
    V: Pod,
    M: IterableMap<K, V>,
{
    let data: &MapData = map.map();
    let raw = read_all(data.fd().as_fd(), size_of::<K>(), size_of::<V>())?;
    Ok(raw
        .iter()
        // SAFETY: each chunk holds exactly the bytes of one K (one V), and both are `Pod`:
        // every bit pattern is a value.
        .map(|(key, value)| unsafe {
            (
                key.as_ptr().cast::<K>().read_unaligned(),
                value.as_ptr().cast::<V>().read_unaligned(),
            )
        })
        .collect())
}

/// Writes every `(key, value)` of `entries` into a hash map with one `BPF_MAP_UPDATE_BATCH`: an
/// attachment's few entries of one map (its hostPorts, their slots) in one call, each element
/// updated as `BPF_MAP_UPDATE_ELEM` would (a failure leaves the ones before it written).
pub fn insert_all<K, V, M>(map: &M, entries: &[(K, V)]) -> io::Result<()>
where
    K: Pod,
    V: Pod,
    M: IterableMap<K, V>,
{
    let data: &MapData = map.map();
    // SAFETY: aya checked the map's key and value sizes against `K` and `V` when it opened it.
    unsafe { update_batch(data.fd().as_fd(), entries) }
}

/// [`insert_all`] into the map pinned at `path`, opened by its pin alone (one `bpf()` call
/// rather than aya's two): for a map a call writes once and reads nothing of.
///
/// # Safety
///
/// The pinned map's key and value types are `K` and `V`: the map is this build's, of the
/// layout and version the load checked.
pub unsafe fn insert_all_pinned<K: Pod, V: Pod>(
    path: &std::path::Path,
    entries: &[(K, V)],
) -> io::Result<()> {
    if entries.is_empty() {
        return Ok(());
    }
    let fd = sys::obj_get(path)?;
    // SAFETY: the caller's promise.
    unsafe { update_batch(fd.as_fd(), entries) }
}

/// # Safety
///
/// `map`'s key and value sizes are those of `K` and `V`.
unsafe fn update_batch<K: Pod, V: Pod>(map: BorrowedFd<'_>, entries: &[(K, V)]) -> io::Result<()> {
    if entries.is_empty() {
        return Ok(());
    }
    let keys: Vec<K> = entries.iter().map(|(key, _)| *key).collect();
    let values: Vec<V> = entries.iter().map(|(_, value)| *value).collect();
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count: u32::try_from(entries.len())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?,
        map_fd: fd_number(map)?,
        ..BatchAttr::default()
    };
    // SAFETY: a batch attribute whose buffers hold `count` keys and values of the map's types
    // (the caller's promise); the kernel only reads them.
    unsafe { sys::bpf(BPF_MAP_UPDATE_BATCH, &mut attr) }.map(drop)
}

/// Inserts `key` → `value` (bytes of the map's sizes) unless the key is there: whether it
/// was inserted.
pub fn insert_new(map: &MapData, key: &[u8], value: &[u8]) -> io::Result<bool> {
    // SAFETY: the caller's buffers have the map's key and value sizes (from the map's spec);
    // the kernel only reads them for an update.
    let inserted = unsafe {
        element_command(
            map.fd().as_fd(),
            BPF_MAP_UPDATE_ELEM,
            key.as_ptr(),
            value.as_ptr().cast_mut(),
            BPF_NOEXIST,
        )
    };
    match inserted {
        Ok(()) => Ok(true),
        Err(error) if error.raw_os_error() == Some(libc::EEXIST) => Ok(false),
        Err(error) => Err(error),
    }
}

/// `bpf(command)` on one element of the map `map`: lookup, update or the next key.
///
/// # Safety
///
/// `key` points at a buffer of the map's key size (or is null, for the first key), `value` at
/// one of its value size (of its key size for `BPF_MAP_GET_NEXT_KEY`, which writes it there);
/// both outlive the call.
pub(super) unsafe fn element_command(
    map: BorrowedFd<'_>,
    command: libc::c_long,
    key: *const u8,
    value: *mut u8,
    flags: u64,
) -> io::Result<()> {
    let mut attr = ElementAttr {
        map_fd: fd_number(map)?,
        _pad: 0,
        key: key as u64,
        value: value as u64,
        flags,
    };
    // SAFETY: an element attribute whose buffers are as the caller promised.
    unsafe { sys::bpf(command, &mut attr) }.map(drop)
}

fn read_all(fd: BorrowedFd<'_>, key_size: usize, value_size: usize) -> io::Result<RawEntries> {
    let fd = fd_number(fd)?;
    let mut chunk = FIRST_CHUNK;
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    // Hash maps' batch position is a bucket index (u32); the first call passes none.
    let mut position: Option<u32> = None;
    let mut next_position: u32 = 0;
    let mut all = RawEntries {
        key_size,
        value_size,
        ..RawEntries::default()
    };
    loop {
        keys.resize(chunk * key_size, 0u8);
        values.resize(chunk * value_size, 0u8);
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
        // keys and values of the map's sizes (the caller's, from the map's types or spec)
        // and a u32 for each batch position; all outlive the call.
        let outcome = unsafe { sys::bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) };
        let done = match outcome {
            Ok(_) => false,
            // The end of the map, possibly with a last partial chunk.
            Err(error) if error.raw_os_error() == Some(libc::ENOENT) => true,
            // One bucket holds more entries than the buffers: the same position again, with
            // room for it.
            Err(error) if error.raw_os_error() == Some(libc::ENOSPC) && chunk < MAX_CHUNK => {
                chunk *= 2;
                continue;
            }
            Err(error) => return Err(error),
        };
        let filled = attr.count as usize;
        all.keys.extend_from_slice(&keys[..filled * key_size]);
        all.values.extend_from_slice(&values[..filled * value_size]);
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
