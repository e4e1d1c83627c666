//! The simulated host shared by every integration test and by `cargo xtask demo`.
//!
//! A "host" network namespace with an uplink veth to an "outside" namespace; containers are
//! namespaces wired by Debian's reference `bridge` + `host-local` plugins with cnibpf chained
//! after them, run by a chain executor with libcni's semantics. Nothing touches the machine's own
//! network, every name is unique to its test, and everything is removed in `Drop`, also when a
//! test panics.

pub mod assertions;
pub mod chain;
pub mod cri;
pub mod daemon;
pub mod faults;
pub mod foreign;
pub mod history;
pub mod image;
pub mod kube_proxy;
pub mod live;
pub mod monitor;
pub mod netns;
pub mod observe;
pub mod packet;
pub mod podman;
pub mod raw_bpf;
pub mod state;
pub mod topology;
pub mod traffic;

pub use chain::{Chain, ChainError, PluginOutput};
pub use netns::Netns;
pub use topology::{Container, SimHost};

/// Where [`skip`] records skipped tests: set by `cargo xtask test`, which counts them apart
/// from the passed ones in its summary.
pub const SKIP_LOG_ENV: &str = "CNIBPF_SKIP_LOG";

/// Records that the running test cannot run on this machine (say why), for the summary of
/// `cargo xtask test` (`N passed, M failed, K skipped`); the caller returns right after. A
/// test skipped this way must be one that a capable machine runs: never a default.
pub fn skip(reason: &str) {
    use std::io::Write as _;
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("?");
    let line = format!("{test}: {reason}");
    eprintln!("skipped {line}");
    if let Some(log) = std::env::var_os(SKIP_LOG_ENV) {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap_or_else(|error| panic!("open the skip log {}: {error}", log.display()));
        writeln!(file, "{line}").expect("record the skip");
    }
}

/// Where `scripts/bootstrap.sh` puts the tools the machine's packages do not give
/// (`CNIBPF_TOOLS_DIR`, else `~/.local/share/cnibpf-tools`).
pub fn tools_dir() -> std::path::PathBuf {
    std::env::var_os("CNIBPF_TOOLS_DIR").map_or_else(
        || {
            std::path::Path::new(&std::env::var_os("HOME").expect("HOME"))
                .join(".local/share/cnibpf-tools")
        },
        std::path::PathBuf::from,
    )
}

/// Polls `condition` until it holds or `timeout` passes; whether it held. For state the kernel
/// changes asynchronously (an unpinned link is released from a work queue).
pub fn eventually(timeout: std::time::Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if condition() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Registers each listed test body — a `fn(Backend)` — as two tests, `<name>::ebpf` and
/// `<name>::nftables`: the suites run for both backends.
#[macro_export]
macro_rules! for_both_backends {
    ($($name:ident),+ $(,)?) => {
        $(
            mod $name {
                #[test]
                fn ebpf() {
                    super::$name($crate::topology::Backend::Ebpf);
                }

                #[test]
                fn nftables() {
                    super::$name($crate::topology::Backend::Nftables);
                }
            }
        )+
    };
}
