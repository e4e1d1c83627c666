//! The call log: one JSON line per plugin call appended to `logFile`, written through
//! `tracing`'s JSON formatter. Many plugin processes write at once (a node starting pods), so
//! each line is appended under an exclusive `flock` on `<logFile>.lock`, which also guards the
//! rotation: when the next line would take the file past `logMaxSizeMB`, it becomes
//! `<logFile>.1` (and `.1` becomes `.2`, up to `logMaxFiles`, the oldest going) before the line
//! is written to a new file. A process that opened the file before a rotation has closed it
//! again by then (nothing is held open between lines), so no line lands in a file already
//! rotated away, and none is lost or interleaved. Failing to log never fails the call.

use std::{
    fs::{self, File, OpenOptions},
    io::{self, Write},
    os::{fd::AsRawFd as _, unix::fs::OpenOptionsExt as _},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tracing_subscriber::fmt::MakeWriter;

use crate::{config::LogConf, journal::Noted};

/// How long a writer waits for another to finish its line or rotation before it appends
/// without the lock (an append of one line is still whole; only the size check is skipped).
const LOCK_WAIT: Duration = Duration::from_secs(2);

/// What one call did, as its log line says it.
#[derive(Debug)]
pub struct CallRecord<'a> {
    pub verb: &'a str,
    /// 0 on success, else the CNI error code.
    pub code: u32,
    pub message: Option<&'a str>,
    pub duration: Duration,
    pub noted: &'a Noted,
}

/// Appends the line of `record` to the log `conf` names.
pub fn write(conf: &LogConf, record: &CallRecord<'_>) -> io::Result<()> {
    let Some(file) = &conf.file else {
        return Ok(());
    };
    let appender = Appender {
        path: file.clone(),
        max_bytes: conf.max_bytes,
        max_files: conf.max_files,
        failure: Arc::new(Mutex::new(None)),
    };
    let failure = Arc::clone(&appender.failure);
    let subscriber = tracing_subscriber::fmt()
        .json()
        .flatten_event(true)
        .with_current_span(false)
        .with_span_list(false)
        .with_target(false)
        .with_writer(appender)
        .finish();
    let noted = record.noted;
    let list = |items: &[String]| (!items.is_empty()).then(|| items.join(", "));
    let host_ports = list(&noted.host_ports);
    let released = list(&noted.host_ports_released);
    let reclaimed = list(&noted.reclaimed);
    let removed = list(&noted.removed);
    let migrated = list(&noted.migrated);
    let restored = list(&noted.restored);
    let uninstalled = list(&noted.uninstalled);
    let backend = (!noted.backends.is_empty()).then(|| noted.backends.join(", "));
    let result = if record.code == 0 {
        "ok".to_owned()
    } else {
        record.code.to_string()
    };
    tracing::subscriber::with_default(subscriber, || {
        let duration_ms = record.duration.as_secs_f64() * 1e3;
        if record.code == 0 {
            tracing::info!(
                verb = record.verb,
                container_id = noted.container_id.as_deref(),
                pod = noted.pod.as_deref(),
                network = noted.network.as_deref(),
                ifname = noted.ifname.as_deref(),
                backend = backend.as_deref(),
                result = result.as_str(),
                code = record.code,
                duration_ms,
                host_ports = host_ports.as_deref(),
                host_ports_released = released.as_deref(),
                reclaimed = reclaimed.as_deref(),
                removed = removed.as_deref(),
                migrated = migrated.as_deref(),
                restored = restored.as_deref(),
                uninstalled = uninstalled.as_deref(),
            );
        } else {
            tracing::warn!(
                verb = record.verb,
                container_id = noted.container_id.as_deref(),
                pod = noted.pod.as_deref(),
                network = noted.network.as_deref(),
                ifname = noted.ifname.as_deref(),
                backend = backend.as_deref(),
                result = result.as_str(),
                code = record.code,
                error = record.message,
                duration_ms,
                host_ports_released = released.as_deref(),
                reclaimed = reclaimed.as_deref(),
                removed = removed.as_deref(),
                migrated = migrated.as_deref(),
                restored = restored.as_deref(),
            );
        }
    });
    // fail-closed: a lock poisoned by a panic still holds the failure.
    let failed = failure
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    // fail-closed: an Option: no failure kept is none.
    failed.map_or(Ok(()), Err)
}

/// Hands `tracing` a writer per line; keeps the first failure to append.
struct Appender {
    path: PathBuf,
    max_bytes: u64,
    max_files: u32,
    failure: Arc<Mutex<Option<io::Error>>>,
}

impl<'a> MakeWriter<'a> for Appender {
    type Writer = Line<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        Line {
            appender: self,
            bytes: Vec::new(),
        }
    }
}

/// One formatted line, appended when `tracing` is done with it.
struct Line<'a> {
    appender: &'a Appender,
    bytes: Vec<u8>,
}

impl Write for Line<'_> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.bytes.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for Line<'_> {
    fn drop(&mut self) {
        if self.bytes.is_empty() {
            return;
        }
        if let Err(error) = self.appender.append(&self.bytes) {
            // fail-closed: a lock poisoned by a panic still takes the failure.
            self.appender
                .failure
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .get_or_insert(error);
        }
    }
}

impl Appender {
    fn append(&self, line: &[u8]) -> io::Result<()> {
        if let Some(parent) = self.path.parent() {
            fs::create_dir_all(parent)?;
        }
        let lock = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o640)
            .custom_flags(libc::O_CLOEXEC)
            .open(lock_path(&self.path))?;
        let locked = lock_exclusively(&lock, LOCK_WAIT)?;
        if locked {
            let size = match fs::metadata(&self.path) {
                Ok(metadata) => metadata.len(),
                Err(error) if error.kind() == io::ErrorKind::NotFound => 0,
                Err(error) => return Err(error),
            };
            if size > 0 && size + line.len() as u64 > self.max_bytes {
                self.rotate()?;
            }
        }
        let mut file = OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o640)
            .custom_flags(libc::O_CLOEXEC)
            .open(&self.path)?;
        // One write of the whole line: appends of other processes land before or after it.
        file.write_all(line)
    }

    /// `<file>.N-1` → `<file>.N` down to `<file>` → `<file>.1`; the oldest is replaced.
    fn rotate(&self) -> io::Result<()> {
        for generation in (1..self.max_files).rev() {
            match fs::rename(
                rotated(&self.path, generation),
                rotated(&self.path, generation + 1),
            ) {
                Ok(()) => {}
                Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                Err(error) => return Err(error),
            }
        }
        fs::rename(&self.path, rotated(&self.path, 1))
    }
}

fn lock_path(log: &Path) -> PathBuf {
    let mut name = log.as_os_str().to_owned();
    name.push(".lock");
    PathBuf::from(name)
}

/// `<log>.<generation>`.
pub fn rotated(log: &Path, generation: u32) -> PathBuf {
    let mut name = log.as_os_str().to_owned();
    name.push(format!(".{generation}"));
    PathBuf::from(name)
}

/// Takes an exclusive `flock` on `file`, waiting up to `wait`; whether it got it. (The lock
/// goes when the file is closed.)
fn lock_exclusively(file: &File, wait: Duration) -> io::Result<bool> {
    let deadline = Instant::now() + wait;
    loop {
        // SAFETY: flock on a descriptor this function borrows; no memory is passed.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(true);
        }
        let error = io::Error::last_os_error();
        match error.raw_os_error() {
            Some(libc::EWOULDBLOCK | libc::EINTR) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Some(libc::EWOULDBLOCK) => return Ok(false),
            _ => return Err(error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::Noted;

    fn conf(dir: &Path, max_bytes: u64, max_files: u32) -> LogConf {
        LogConf {
            file: Some(dir.join("cnibpf.log")),
            max_bytes,
            max_files,
        }
    }

    #[test]
    fn a_call_is_one_json_line_with_what_it_did() {
        let dir = std::env::temp_dir().join(format!("cnibpf-call-log-{}", std::process::id()));
        let noted = Noted {
            network: Some("net1".to_owned()),
            container_id: Some("c1".to_owned()),
            ifname: Some("eth0".to_owned()),
            pod: Some("shop/web-0".to_owned()),
            backends: vec!["ebpf"],
            host_ports: vec!["tcp 8080 -> 10.22.0.2:80".to_owned()],
            ..Noted::default()
        };
        let conf = conf(&dir, 1 << 20, 2);
        write(
            &conf,
            &CallRecord {
                verb: "ADD",
                code: 0,
                message: None,
                duration: Duration::from_micros(1500),
                noted: &noted,
            },
        )
        .expect("logged");
        write(
            &conf,
            &CallRecord {
                verb: "DEL",
                code: 100,
                message: Some("hostPort in use"),
                duration: Duration::from_millis(2),
                noted: &noted,
            },
        )
        .expect("logged");
        let text = fs::read_to_string(dir.join("cnibpf.log")).expect("log");
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|line| serde_json::from_str(line).expect("a JSON line"))
            .collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert_eq!(lines[0]["verb"], "ADD");
        assert_eq!(lines[0]["result"], "ok");
        assert_eq!(lines[0]["pod"], "shop/web-0");
        assert_eq!(lines[0]["backend"], "ebpf");
        assert_eq!(lines[0]["host_ports"], "tcp 8080 -> 10.22.0.2:80");
        assert_eq!(lines[0]["duration_ms"], 1.5);
        assert!(lines[0]["timestamp"].is_string(), "{}", lines[0]);
        assert!(lines[0].get("error").is_none(), "{}", lines[0]);
        assert_eq!(lines[1]["result"], "100");
        assert_eq!(lines[1]["error"], "hostPort in use");
        fs::remove_dir_all(&dir).expect("cleaned up");
    }

    #[test]
    fn rotation_keeps_every_line_up_to_the_files_kept() {
        let dir = std::env::temp_dir().join(format!("cnibpf-call-log-r-{}", std::process::id()));
        let conf = conf(&dir, 1_000, 3);
        let noted = Noted::default();
        for _ in 0..25 {
            write(
                &conf,
                &CallRecord {
                    verb: "GC",
                    code: 0,
                    message: None,
                    duration: Duration::ZERO,
                    noted: &noted,
                },
            )
            .expect("logged");
        }
        let path = dir.join("cnibpf.log");
        let mut lines = 0;
        for file in [
            path.clone(),
            rotated(&path, 1),
            rotated(&path, 2),
            rotated(&path, 3),
        ] {
            let Ok(text) = fs::read_to_string(&file) else {
                continue;
            };
            assert!(
                text.len() <= 1_000,
                "{} is {} bytes",
                file.display(),
                text.len()
            );
            lines += text.lines().count();
        }
        assert!(rotated(&path, 2).exists(), "rotated more than once");
        assert_eq!(lines, 25, "every line is in one of the files");
        assert!(
            !rotated(&path, 4).exists(),
            "no more than logMaxFiles rotated files"
        );
        fs::remove_dir_all(&dir).expect("cleaned up");
    }
}
