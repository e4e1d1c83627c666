//! What every CNI call did, counted where `cnibpf metrics` reads it after the one-shot plugin
//! has exited: a small file per instance in `/run/cnibpf` (tmpfs), mapped shared by each
//! plugin process, whose counters are added to atomically — no lock, no `bpf()`, the same on
//! both backends and on hosts without BPF. A call pays an open, a map and a few atomic adds
//! (microseconds); the file goes with a reboot, as the datapath's counters do.
//!
//! Layout, in native-endian `u64` words: [`MAGIC`], [`VERSION`], then per verb (in [`VERBS`]
//! order) the calls by result code (0 = success, 1..=126 the CNI error code, 127 any other),
//! the calls per duration bucket (not cumulative), the call count and the summed duration in
//! nanoseconds; last, the attachments reclaimed (a hostPort holder or `gc --stale`).

use std::{
    fs::{File, OpenOptions},
    io,
    num::NonZeroUsize,
    os::unix::fs::OpenOptionsExt as _,
    path::Path,
    ptr::NonNull,
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap};

/// `"cnibpfcs"` read as a little-endian integer.
const MAGIC: u64 = u64::from_le_bytes(*b"cnibpfcs");
const VERSION: u64 = 1;
/// The verbs as the CNI spec spells them.
pub const VERBS: [&str; 6] = ["ADD", "DEL", "CHECK", "GC", "STATUS", "VERSION"];
/// Result slots per verb: success, each CNI code below 127, and any other.
pub const RESULT_SLOTS: usize = 128;
/// Upper bounds of the duration buckets, in seconds (the last bucket, +Inf, is implied).
pub const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];
const VERB_WORDS: usize = RESULT_SLOTS + BUCKETS.len() + 1 + 2;
const HEADER_WORDS: usize = 2;
const WORDS: usize = HEADER_WORDS + VERBS.len() * VERB_WORDS + 1;
const BYTES: usize = WORDS * 8;

/// One verb's counts as read back.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VerbStats {
    /// Calls by result slot (0 = success).
    pub results: Vec<u64>,
    /// Calls per bucket of [`BUCKETS`], then above the last; not cumulative.
    pub buckets: Vec<u64>,
    pub count: u64,
    pub sum_ns: u64,
}

/// Everything the file counts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CallStats {
    /// By verb, in [`VERBS`] order.
    pub verbs: Vec<VerbStats>,
    pub reclaimed_attachments: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum CallStatsError {
    #[error("could not open {path}")]
    Open {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("could not map {path}")]
    Map {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("{path} is not a call statistics file of this format: remove it (it is rebuilt)")]
    Foreign { path: String },
}

/// The slot of a result: 0 for success, the CNI code, or the last slot for any other.
pub fn result_slot(code: u32) -> usize {
    // fail-closed: a code beyond the slots is counted as "other", the last slot.
    usize::try_from(code)
        .ok()
        .filter(|code| *code < RESULT_SLOTS)
        .unwrap_or(RESULT_SLOTS - 1)
}

fn verb_base(verb: usize) -> usize {
    HEADER_WORDS + verb * VERB_WORDS
}

fn bucket_of(duration: Duration) -> usize {
    let seconds = duration.as_secs_f64();
    BUCKETS
        .iter()
        // fail-closed: an Option: above every bound is the last (+Inf) bucket.
        .position(|bound| seconds <= *bound)
        .unwrap_or(BUCKETS.len())
}

/// The file mapped shared, as an array of atomic words.
struct Mapped {
    words: NonNull<AtomicU64>,
}

impl Mapped {
    fn open(path: &Path, writable: bool) -> Result<Self, CallStatsError> {
        let text = || path.display().to_string();
        let file = if writable {
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(|source| CallStatsError::Open {
                    path: text(),
                    source,
                })?;
            }
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o644)
                .custom_flags(libc::O_CLOEXEC)
                .open(path)
        } else {
            File::open(path)
        }
        .map_err(|source| CallStatsError::Open {
            path: text(),
            source,
        })?;
        let size = file
            .metadata()
            .map_err(|source| CallStatsError::Open {
                path: text(),
                source,
            })?
            .len();
        if size < BYTES as u64 {
            if !writable {
                return Err(CallStatsError::Foreign { path: text() });
            }
            // Growing only: two processes doing it at once both write zeros past the end.
            file.set_len(BYTES as u64)
                .map_err(|source| CallStatsError::Open {
                    path: text(),
                    source,
                })?;
        }
        let protection = if writable {
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE
        } else {
            ProtFlags::PROT_READ
        };
        // SAFETY: a shared mapping of a regular file at least BYTES long, which this process
        // accesses only as atomic words; other processes do the same.
        let mapped = unsafe {
            mmap(
                None,
                NonZeroUsize::new(BYTES).expect("non-zero size"),
                protection,
                MapFlags::MAP_SHARED,
                &file,
                0,
            )
        }
        .map_err(|errno| CallStatsError::Map {
            path: text(),
            source: errno.into(),
        })?;
        let mapped = Self {
            words: mapped.cast(),
        };
        let header = mapped.word(0);
        let claimed = if writable {
            // The first writer stamps the format; everyone else finds it.
            header
                // fail-closed: the value found (another writer's stamp) is what is checked below.
                .compare_exchange(0, MAGIC, Ordering::AcqRel, Ordering::Acquire)
                .unwrap_or_else(|found| found)
        } else {
            header.load(Ordering::Acquire)
        };
        if claimed != 0 && claimed != MAGIC {
            return Err(CallStatsError::Foreign { path: text() });
        }
        if writable {
            let version = mapped.word(1);
            let found = version
                // fail-closed: as above.
                .compare_exchange(0, VERSION, Ordering::AcqRel, Ordering::Acquire)
                .unwrap_or_else(|found| found);
            if found != 0 && found != VERSION {
                return Err(CallStatsError::Foreign { path: text() });
            }
        }
        Ok(mapped)
    }

    fn word(&self, index: usize) -> &AtomicU64 {
        assert!(index < WORDS, "word {index} of {WORDS}");
        // SAFETY: within the mapping (checked above), which lives as long as `self`, is
        // page-aligned and accessed only atomically.
        unsafe { &*self.words.as_ptr().add(index) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `open`, of BYTES bytes; no reference outlives `self`.
        // fail-closed: an unmap that fails leaves the mapping until the process exits, soon.
        let _ = unsafe { munmap(self.words.cast(), BYTES) };
    }
}

/// Counts one call of `verb` (one of [`VERBS`]) that ended with `code` (0: success) after
/// `duration`, and `reclaimed` attachments it reclaimed.
pub fn record(
    path: &Path,
    verb: &str,
    code: u32,
    duration: Duration,
    reclaimed: u64,
) -> Result<(), CallStatsError> {
    let mapped = Mapped::open(path, true)?;
    if let Some(verb) = VERBS.iter().position(|known| *known == verb) {
        let base = verb_base(verb);
        mapped
            .word(base + result_slot(code))
            .fetch_add(1, Ordering::Relaxed);
        mapped
            .word(base + RESULT_SLOTS + bucket_of(duration))
            .fetch_add(1, Ordering::Relaxed);
        let after_buckets = base + RESULT_SLOTS + BUCKETS.len() + 1;
        mapped.word(after_buckets).fetch_add(1, Ordering::Relaxed);
        mapped.word(after_buckets + 1).fetch_add(
            // fail-closed: a call of more than 584 years counts as the longest.
            u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }
    if reclaimed > 0 {
        mapped
            .word(WORDS - 1)
            .fetch_add(reclaimed, Ordering::Relaxed);
    }
    Ok(())
}

/// Counts attachments reclaimed outside a CNI call (`cnibpf gc --stale`).
pub fn record_reclaimed(path: &Path, reclaimed: u64) -> Result<(), CallStatsError> {
    if reclaimed == 0 {
        return Ok(());
    }
    Mapped::open(path, true)?
        .word(WORDS - 1)
        .fetch_add(reclaimed, Ordering::Relaxed);
    Ok(())
}

/// What the file at `path` counts; `None` when there is none (no call recorded yet).
pub fn read(path: &Path) -> Result<Option<CallStats>, CallStatsError> {
    let mapped = match Mapped::open(path, false) {
        Ok(mapped) => mapped,
        Err(CallStatsError::Open { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            return Ok(None);
        }
        Err(error) => return Err(error),
    };
    let load = |index| mapped.word(index).load(Ordering::Relaxed);
    let verbs = (0..VERBS.len())
        .map(|verb| {
            let base = verb_base(verb);
            let after_buckets = base + RESULT_SLOTS + BUCKETS.len() + 1;
            VerbStats {
                results: (0..RESULT_SLOTS).map(|slot| load(base + slot)).collect(),
                buckets: (0..=BUCKETS.len())
                    .map(|bucket| load(base + RESULT_SLOTS + bucket))
                    .collect(),
                count: load(after_buckets),
                sum_ns: load(after_buckets + 1),
            }
        })
        .collect();
    Ok(Some(CallStats {
        verbs,
        reclaimed_attachments: load(WORDS - 1),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_counted_by_verb_result_and_duration() {
        let dir = std::env::temp_dir().join(format!("cnibpf-call-stats-{}", std::process::id()));
        let path = dir.join("instance.calls");
        assert_eq!(read(&path).expect("no file yet"), None);
        record(&path, "ADD", 0, Duration::from_micros(700), 0).expect("recorded");
        record(&path, "ADD", 100, Duration::from_millis(60), 2).expect("recorded");
        record(&path, "DEL", 0, Duration::from_secs(9), 0).expect("recorded");
        record_reclaimed(&path, 3).expect("recorded");
        let stats = read(&path).expect("readable").expect("present");
        let add = &stats.verbs[0];
        assert_eq!((add.results[0], add.results[100], add.count), (1, 1, 2));
        assert_eq!(add.buckets[0], 1, "0.7 ms is within the first bucket");
        assert_eq!(add.buckets[6], 1, "60 ms is within 0.1 s");
        assert_eq!(add.sum_ns, 60_700_000);
        let del = &stats.verbs[1];
        assert_eq!(del.buckets[BUCKETS.len()], 1, "9 s is above the last bound");
        assert_eq!(stats.reclaimed_attachments, 5);
        assert_eq!(result_slot(999), RESULT_SLOTS - 1);
        std::fs::remove_dir_all(&dir).expect("cleaned up");
    }

    #[test]
    fn a_file_of_another_format_is_refused_not_overwritten() {
        let dir = std::env::temp_dir().join(format!("cnibpf-call-stats-x-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("instance.calls");
        std::fs::write(&path, vec![0xab; BYTES]).expect("written");
        assert!(matches!(
            record(&path, "ADD", 0, Duration::ZERO, 0),
            Err(CallStatsError::Foreign { .. })
        ));
        assert!(
            std::fs::read(&path)
                .expect("read")
                .iter()
                .all(|byte| *byte == 0xab)
        );
        std::fs::remove_dir_all(&dir).expect("cleaned up");
    }
}
