//! Compatibility with the state other releases wrote: the supported window, and the contract
//! every backend's own `compat` module keeps (`ebpf::compat`, `nftables::compat`, where all
//! of the code that knows other layouts lives). This build migrates what the window's
//! releases wrote — the last two releases `releases.toml` lists: eBPF state layout 10, this
//! build's own, and nftables layout 3, migrated to 4. State of any other layout — older than
//! the window, or newer (a rollback) — is only drained ([`Draining`]): DEL and GC release its
//! attachments, ADD is refused and names the release to pass through ([`PASS_THROUGH`]);
//! `cnibpf install` refuses to put this build on such a node at all, so that the cnibpf in
//! place keeps starting its pods.

mod draining;

pub use draining::{Drained, Draining};

/// The newest release of the supported window, which migrates every earlier layout (eBPF 6 to
/// 9, nftables 2): a node on a release before the window upgrades to it first.
pub const PASS_THROUGH: &str = "0.5.1 (7d1bccd)";
