//! Faults injected into the cnibpf binary under test where a busy node produces them: the N-th
//! call of a system call failing (strace's fault injection, `--inject=SYSCALL:error=ERRNO:
//! when=N`, counted per process) or a file-descriptor limit (`prlimit --nofile`). A test counts
//! the calls a verb makes, then runs it once per fault of [`plan`] and
//! checks what a runtime and an operator would see: one CNI error or success, and nothing
//! live reclaimed, released or changed. A test counts the calls with a [`CallCounter`].
//!
//! `./dev test` runs a bounded sample of N per system call; `CNIBPF_FAULTS=all` runs every N.

use std::{
    collections::BTreeMap,
    fmt,
    path::{Path, PathBuf},
    process::{Command, Output},
};

/// The system calls faults are injected into, one strace expression each: BPF, the netlink
/// sockets (created, written, read) and files.
pub const SYSCALLS: [&str; 6] = [
    "bpf",
    "socket",
    "sendto,sendmsg",
    "recvfrom,recvmsg",
    "openat",
    "write",
];

/// The errors a node produces: an interrupted call, memory or buffers short, a refusal, a
/// resource busy. N picks one in turn.
pub const ERRNOS: [&str; 5] = ["EINTR", "ENOMEM", "ENOBUFS", "EPERM", "EAGAIN"];

/// One fault.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The `nth` call of `syscalls` (in each process) fails with `errno`.
    Syscall {
        syscalls: &'static str,
        errno: &'static str,
        nth: u32,
    },
    /// At most this many open file descriptors.
    FdLimit(u32),
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Syscall {
                syscalls,
                errno,
                nth,
            } => write!(f, "call {nth} of {syscalls} fails with {errno}"),
            Self::FdLimit(limit) => write!(f, "at most {limit} file descriptors"),
        }
    }
}

impl Fault {
    /// The command line that runs a program with this fault, before the program's path.
    pub fn prefix(&self) -> Vec<String> {
        match self {
            Self::Syscall {
                syscalls,
                errno,
                nth,
            } => vec![
                "strace".to_owned(),
                "-f".to_owned(),
                "-qq".to_owned(),
                "-o".to_owned(),
                "/dev/null".to_owned(),
                format!("--inject={syscalls}:error={errno}:when={nth}"),
                "--".to_owned(),
            ],
            Self::FdLimit(limit) => vec![
                "prlimit".to_owned(),
                format!("--nofile={limit}"),
                "--".to_owned(),
            ],
        }
    }
}

/// `program` run by the command line `prefix` (a fault's, a counter's).
pub fn wrapped(prefix: &[String], program: &Path) -> Command {
    let (first, rest) = prefix.split_first().expect("a non-empty prefix");
    let mut command = Command::new(first);
    command.args(rest).arg(program);
    command
}

/// A log of `strace -f` over the runs made with its [`Self::prefix`], removed on drop.
#[derive(Debug)]
struct StraceLog {
    log: PathBuf,
}

impl StraceLog {
    fn new(name: &str) -> Self {
        Self {
            log: tempfile_path(name),
        }
    }

    /// `strace` following forks, writing the calls `traced` names to the log.
    fn prefix(&self, traced: &str) -> Vec<String> {
        vec![
            "strace".to_owned(),
            "-f".to_owned(),
            "-qq".to_owned(),
            "-o".to_owned(),
            self.log.display().to_string(),
            format!("-etrace={traced}"),
            "--".to_owned(),
        ]
    }

    fn read(&self) -> String {
        std::fs::read_to_string(&self.log)
            .unwrap_or_else(|error| panic!("read {}: {error}", self.log.display()))
    }
}

impl Drop for StraceLog {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Counts the calls of [`SYSCALLS`] of the runs made with its [`Self::prefix`].
#[derive(Debug)]
pub struct CallCounter {
    strace: StraceLog,
}

impl CallCounter {
    pub fn new() -> Self {
        Self {
            strace: StraceLog::new("cnibpf-strace"),
        }
    }

    pub fn prefix(&self) -> Vec<String> {
        self.strace.prefix(&SYSCALLS.join(","))
    }

    /// What the runs made.
    pub fn counts(self) -> Counts {
        parse_counts(&self.strace.read())
    }
}

impl Default for CallCounter {
    fn default() -> Self {
        Self::new()
    }
}

/// How many calls of each of [`SYSCALLS`] a run made, in the process that made most, and the
/// first `openat` past the dynamic loader's (which a fault would keep the program from
/// starting at all: no code of ours runs before it).
#[derive(Clone, Debug, Default)]
pub struct Counts {
    pub calls: BTreeMap<&'static str, u32>,
    pub first_own_openat: u32,
}

/// The counts of an `strace -f` log (`PID syscall(args) = result` lines).
fn parse_counts(log: &str) -> Counts {
    let mut per_process: BTreeMap<(&str, &'static str), u32> = BTreeMap::new();
    let mut first_process = None;
    let mut loader_openats = 0;
    for line in log.lines() {
        let Some((pid, call)) = line.split_once(char::is_whitespace) else {
            continue;
        };
        let call = call.trim_start();
        let Some(name) = call.split('(').next() else {
            continue;
        };
        let Some(group) = SYSCALLS
            .into_iter()
            .find(|group| group.split(',').any(|syscall| syscall == name))
        else {
            continue;
        };
        let first = *first_process.get_or_insert(pid);
        *per_process.entry((pid, group)).or_default() += 1;
        if pid == first && name == "openat" && is_loader_open(call) {
            loader_openats = per_process[&(pid, group)];
        }
    }
    let mut calls: BTreeMap<&'static str, u32> = BTreeMap::new();
    for ((_, group), count) in per_process {
        let most = calls.entry(group).or_default();
        *most = (*most).max(count);
    }
    Counts {
        calls,
        first_own_openat: loader_openats + 1,
    }
}

/// Whether an `openat` is the dynamic loader's (its cache and shared objects).
fn is_loader_open(call: &str) -> bool {
    call.contains("/etc/ld.so.cache") || call.contains(".so.") || call.contains(".so\"")
}

fn tempfile_path(prefix: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    std::env::temp_dir().join(format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Whether every N is to be run (`CNIBPF_FAULTS=all`) rather than a sample.
pub fn exhaustive() -> bool {
    std::env::var("CNIBPF_FAULTS").is_ok_and(|value| value == "all")
}

/// The faults to run against a verb that made `counts`' calls: every N of every system call
/// when [`exhaustive`], else `per_syscall` of them spread over the range (the first and the
/// last included); the error rotates through [`ERRNOS`].
pub fn plan(counts: &Counts, per_syscall: u32) -> Vec<Fault> {
    let mut faults = Vec::new();
    for syscalls in SYSCALLS {
        let calls = counts.calls.get(syscalls).copied().unwrap_or(0);
        let first = if syscalls == "openat" {
            counts.first_own_openat
        } else {
            1
        };
        if calls < first {
            continue;
        }
        for nth in sample(first, calls, per_syscall, exhaustive()) {
            faults.push(Fault::Syscall {
                syscalls,
                errno: ERRNOS[nth as usize % ERRNOS.len()],
                nth,
            });
        }
    }
    faults
}

/// `count` values spread evenly over `first..=last` (the ends included), or all of them.
fn sample(first: u32, last: u32, count: u32, all: bool) -> Vec<u32> {
    let span = last - first;
    if all || span < count {
        return (first..=last).collect();
    }
    let mut picked: Vec<u32> = (0..count)
        .map(|step| first + span * step / (count - 1).max(1))
        .collect();
    picked.dedup();
    picked
}

/// What a run of a CNI verb answered, checked the way a runtime reads it: exit 0, or a
/// non-zero exit with exactly one CNI error object (a code and a message) on stdout — never a
/// crash, a signal or an answer a runtime cannot parse. Returns whether it succeeded.
pub fn assert_cni_answer(output: &crate::PluginOutput, context: &str) -> bool {
    assert!(
        !output.stderr.contains("panicked"),
        "{context}: the plugin panicked: {output:?}"
    );
    if output.exit_code == 0 {
        return true;
    }
    assert!(
        output.exit_code > 0,
        "{context}: the plugin died by a signal: {output:?}"
    );
    let error: serde_json::Value =
        serde_json::from_str(output.stdout.trim()).unwrap_or_else(|error| {
            panic!("{context}: stdout is not one CNI error object ({error}): {output:?}")
        });
    let code = error["code"].as_u64();
    let message = error["msg"].as_str().unwrap_or_default();
    assert!(
        code.is_some_and(|code| code > 0) && !message.is_empty(),
        "{context}: a CNI error names its code and the step that failed: {output:?}"
    );
    false
}

/// The same for an admin command (`gc --stale`, `install`, `uninstall`): exit 0, or exit 1 with
/// its error on stderr, one line naming the command. A binary the dynamic loader could not
/// start (too few file descriptors to open its libraries: no code of ours ran) failed too.
pub fn assert_admin_answer(output: &Output, command: &str, context: &str) -> bool {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !stderr.contains("panicked"),
        "{context}: cnibpf {command} panicked: {output:?}"
    );
    if output.status.code() == Some(127) && stderr.contains("error while loading shared libraries")
    {
        return false;
    }
    match output.status.code() {
        Some(0) => true,
        Some(1) => {
            assert!(
                stderr.contains(&format!("cnibpf {command}: ")),
                "{context}: the failure names the command and the step: {output:?}"
            );
            false
        }
        _ => panic!("{context}: cnibpf {command} died or exited oddly: {output:?}"),
    }
}

/// Runs `command` (a step of pinned state that must converge: a migration, a resize) killed
/// with SIGKILL at ever later points — delays growing by 3 % a run, 1 ms … 1 s by the 234th,
/// so that kills land all through it, most of them early, where the steps are short (an
/// nftables migration is half done for about a millisecond, a window a 6 % growth crossed
/// with only two kills on a loaded machine) — until a run completes. At least 10 runs must have been killed and at least 3 of the kills must
/// have left the work `half_done`, or the test proved nothing.
pub fn killed_until_complete(
    what: &str,
    mut command: impl FnMut() -> Command,
    half_done: impl Fn() -> bool,
) {
    let started = std::time::Instant::now();
    let (mut killed, mut interrupted) = (0, 0);
    let mut killed_pids = Vec::new();
    for step in 0..320 {
        let delay = std::time::Duration::from_secs_f64(1.03_f64.powi(step) / 1000.0);
        let run_started = std::time::Instant::now();
        let mut child = command()
            .spawn()
            .unwrap_or_else(|error| panic!("{what}: spawn: {error}"));
        std::thread::sleep(delay);
        // fail-closed: a run that finished before the kill is what the loop looks for.
        let _ = child.kill();
        let status = child
            .wait()
            .unwrap_or_else(|error| panic!("{what}: wait: {error}"));
        if status.code() == Some(0) {
            assert!(killed >= 10, "{what}: only {killed} runs were killed");
            assert!(
                interrupted >= 3,
                "{what}: only {interrupted} kills left it half done"
            );
            eprintln!(
                "{what}: {killed} runs killed ({interrupted} half done), the next one completed in {} ms; {:.1}s in all",
                run_started.elapsed().as_millis(),
                started.elapsed().as_secs_f64()
            );
            assert_no_probe_of(what, &killed_pids);
            return;
        }
        killed += 1;
        killed_pids.push(child.id());
        interrupted += usize::from(half_done());
    }
    panic!("{what}: no run completed in {killed} tries");
}

/// A run of cnibpf probes bpffs with a directory named after its PID; the run that completes
/// reaps those of the killed ones (which may have died holding theirs).
fn assert_no_probe_of(what: &str, pids: &[u32]) {
    let root = Path::new("/sys/fs/bpf");
    let left: Vec<String> = std::fs::read_dir(root)
        .unwrap_or_else(|error| panic!("{what}: read {}: {error}", root.display()))
        .map(|entry| {
            entry
                .unwrap_or_else(|error| panic!("{what}: read {}: {error}", root.display()))
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|name| {
            name.strip_prefix("cnibpf-probe-")
                .and_then(|rest| rest.rsplit_once('-'))
                .and_then(|(_, pid)| pid.parse::<u32>().ok())
                .is_some_and(|pid| pids.contains(&pid))
        })
        .collect();
    assert!(
        left.is_empty(),
        "{what}: probe directories of killed runs left under {}: {left:?}",
        root.display()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_counted_per_process_past_the_loader() {
        let log = "\
100 openat(AT_FDCWD, \"/etc/ld.so.cache\", O_RDONLY|O_CLOEXEC) = 3
100 openat(AT_FDCWD, \"/lib/x86_64-linux-gnu/libc.so.6\", O_RDONLY|O_CLOEXEC) = 3
100 bpf(BPF_OBJ_GET, {pathname=\"/sys/fs/bpf/x\"}, 16) = 4
100 openat(AT_FDCWD, \"/proc/self/mounts\", O_RDONLY|O_CLOEXEC) = 5
101 openat(AT_FDCWD, \"/etc/ld.so.cache\", O_RDONLY|O_CLOEXEC) = 3
101 sendmsg(3, {...}, 0) = 20
100 sendto(3, \"...\", 20, 0, NULL, 0) = 20
100 sendto(3, \"...\", 20, 0, NULL, 0) = 20
";
        let counts = parse_counts(log);
        assert_eq!(counts.calls["bpf"], 1);
        assert_eq!(counts.calls["openat"], 3);
        assert_eq!(
            counts.calls["sendto,sendmsg"], 2,
            "the process that made most"
        );
        assert_eq!(counts.first_own_openat, 3);
    }

    #[test]
    fn a_sample_keeps_both_ends() {
        assert_eq!(sample(1, 3, 4, false), vec![1, 2, 3]);
        assert_eq!(sample(3, 103, 3, false), vec![3, 53, 103]);
        assert_eq!(sample(1, 5, 2, true), vec![1, 2, 3, 4, 5]);
    }
}

/// What cnibpf's runs made of the kernel's costliest work, from `strace -f` (`-e
/// trace=bpf,execve`): its `bpf()` calls, the programs among them it loaded (the verifier's
/// time), and the processes it started (`nft`, `modprobe`: every successful `execve` past the
/// plugin's own).
#[derive(Debug)]
pub struct KernelWork {
    strace: StraceLog,
}

/// [`KernelWork`]'s counts over every run made with its prefix.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelWorkCounts {
    pub runs: u32,
    pub bpf_calls: u32,
    pub program_loads: u32,
    pub processes_started: u32,
}

impl KernelWork {
    pub fn new() -> Self {
        Self {
            strace: StraceLog::new("cnibpf-kernel-work"),
        }
    }

    pub fn prefix(&self) -> Vec<String> {
        self.strace.prefix("bpf,execve")
    }

    /// What the runs made so far; the log starts again empty.
    pub fn take(&self) -> KernelWorkCounts {
        let text = self.strace.read();
        std::fs::write(&self.strace.log, "")
            .unwrap_or_else(|error| panic!("empty {}: {error}", self.strace.log.display()));
        let mut counts = KernelWorkCounts::default();
        for line in text.lines() {
            let call = line
                .split_once(char::is_whitespace)
                .map_or("", |(_, call)| call.trim_start());
            if call.starts_with("bpf(") {
                counts.bpf_calls += 1;
                counts.program_loads += u32::from(call.starts_with("bpf(BPF_PROG_LOAD"));
            } else if let Some(arguments) = call.strip_prefix("execve(\"")
                && call.ends_with("= 0")
            {
                let program = arguments.split('"').next().unwrap_or_default();
                if Path::new(program).file_name() == Some("cnibpf".as_ref()) {
                    counts.runs += 1;
                } else {
                    counts.processes_started += 1;
                }
            }
        }
        counts
    }
}

impl Default for KernelWork {
    fn default() -> Self {
        Self::new()
    }
}
