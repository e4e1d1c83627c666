//! Every filesystem location cnibpf uses, in one place.

use std::path::{Path, PathBuf};

/// Default bpffs directory of an instance (`pinPath`).
pub const DEFAULT_PIN_PATH: &str = "/sys/fs/bpf/cnibpf";
/// Where bpffs is mounted when the host has no bpffs at all.
pub const BPFFS_MOUNT_POINT: &str = "/sys/fs/bpf";
/// Directory of lock files (tmpfs on every systemd host, so stale locks vanish on reboot).
pub const LOCK_DIR: &str = "/run/cnibpf";

/// The pinned objects of one instance, all under its `pinPath`.
#[derive(Clone, Debug)]
pub struct PinLayout {
    root: PathBuf,
}

impl PinLayout {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The instance directory; maps are pinned directly in it, by name.
    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn map(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    pub fn programs_dir(&self) -> PathBuf {
        self.root.join("programs")
    }

    pub fn program(&self, name: &str) -> PathBuf {
        self.programs_dir().join(name)
    }

    pub fn links_dir(&self) -> PathBuf {
        self.root.join("links")
    }

    /// Link of a program attached to an uplink, shared by every attachment.
    pub fn uplink_link(&self, ifname: &str, hook: &str) -> PathBuf {
        self.links_dir().join(format!("uplink-{ifname}-{hook}"))
    }

    /// Link of a program attached to an attachment's host-side interface.
    pub fn endpoint_link(&self, owner: u64, hook: &str) -> PathBuf {
        self.links_dir()
            .join(format!("endpoint-{owner:016x}-{hook}"))
    }

    /// The lock file serialising changes to this instance. Named after the pin path so that
    /// instances with different `pinPath`s (tests, several networks) never wait on each other.
    pub fn lock_file(&self) -> PathBuf {
        let name: String = self
            .root
            .to_string_lossy()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        Path::new(LOCK_DIR).join(format!("{name}.lock"))
    }
}
