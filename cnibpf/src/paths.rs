//! Every filesystem location cnibpf uses, in one place.

use std::path::{Path, PathBuf};

/// Default bpffs directory of an instance (`pinPath`).
pub const DEFAULT_PIN_PATH: &str = "/sys/fs/bpf/cnibpf";
/// Where bpffs is mounted when the host has no bpffs at all.
pub const BPFFS_MOUNT_POINT: &str = "/sys/fs/bpf";
/// Mount table consulted for the cgroup v2 root.
pub const MOUNTS: &str = "/proc/self/mounts";
/// Where runtimes look for network configurations and plugin binaries (kubelet, containerd,
/// CRI-O and podman defaults).
pub const CNI_CONF_DIR: &str = "/etc/cni/net.d";
pub const CNI_BIN_DIR: &str = "/opt/cni/bin";
/// The plugin's file name in the bin dir: the `type` of its conflist entry.
pub const PLUGIN_NAME: &str = "cnibpf";
/// The suffix of the conflists `cnibpf install` writes: `<stem>.cnibpf.conflist` sorts right
/// before the file it was made from, `<stem>.conf`, `.conflist` or `.json` ("cn" < "co" < "j"),
/// so the runtime reads it in that file's place, and after Multus's `00-multus.conf` as that
/// file does.
pub const OWN_CONFLIST_SUFFIX: &str = ".cnibpf.conflist";

/// Whether `path` names one of the conflists `cnibpf install` writes.
pub fn is_own_conflist(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|name| name.to_string_lossy().ends_with(OWN_CONFLIST_SUFFIX))
}
/// The connections the kernel tracks, and how many it may (the nftables backend's table).
pub const CONNTRACK_COUNT: &str = "/proc/sys/net/netfilter/nf_conntrack_count";
pub const CONNTRACK_MAX: &str = "/proc/sys/net/netfilter/nf_conntrack_max";
/// The call log (`logFile`'s default).
pub const DEFAULT_LOG_FILE: &str = "/var/log/cnibpf/cnibpf.log";
/// Directory of lock files and call statistics (tmpfs on every systemd host, so stale locks
/// vanish on reboot, as the datapath's counters do).
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

    /// Where a resize pins the new maps until they replace the old ones.
    pub fn resize_dir(&self) -> PathBuf {
        self.root.join("resize")
    }

    pub fn resized_map(&self, name: &str) -> PathBuf {
        self.resize_dir().join(name)
    }

    pub fn links_dir(&self) -> PathBuf {
        self.root.join("links")
    }

    /// Link of a program attached to an uplink, shared by every attachment.
    pub fn uplink_link(&self, ifname: &str, hook: &str) -> PathBuf {
        self.links_dir().join(format!("uplink-{ifname}-{hook}"))
    }

    /// Link of a program attached to an attachment's host-side interface: `from` (the tcx
    /// ingress, what the container sends) or `to` (the tcx egress).
    pub fn endpoint_link(&self, owner: u64, hook: &str) -> PathBuf {
        self.links_dir()
            .join(format!("endpoint-{owner:016x}-{hook}"))
    }

    /// Link of a kernel tracepoint program of the instance (shared): the qdisc watcher's.
    pub fn tracepoint_link(&self, program: &str) -> PathBuf {
        self.links_dir().join(format!("tracepoint-{program}"))
    }

    /// Link of a socket hook attached to the instance's cgroup (shared).
    pub fn cgroup_link(&self, program: &str) -> PathBuf {
        self.links_dir().join(format!("cgroup-{program}"))
    }

    /// The lock file serialising changes to this instance. Named after the pin path so that
    /// instances with different `pinPath`s (tests, several networks) never wait on each other.
    pub fn lock_file(&self) -> PathBuf {
        Path::new(LOCK_DIR).join(format!("{}.lock", self.lock_name()))
    }

    /// The call statistics of this instance (`call_stats`), beside its lock file.
    pub fn call_stats_file(&self) -> PathBuf {
        Path::new(LOCK_DIR).join(format!("{}.calls", self.lock_name()))
    }

    /// The nftables backend's state: every attachment's record, from which its ruleset is
    /// derived (and restored after a firewall reload flushed it).
    pub fn nftables_state_file(&self) -> PathBuf {
        Path::new(LOCK_DIR).join(format!("{}.nftables.json", self.lock_name()))
    }

    /// Written by `cnibpf uninstall` while the instance still serves pods: the conflist and
    /// binary the DEL that releases the last attachment removes. A DEL that comes with the
    /// configuration the runtime cached at ADD (CRI-O, podman: cnibpf's entry as it was, not
    /// in release-only mode) finds the instance being taken off here.
    pub fn release_file(&self) -> PathBuf {
        Path::new(LOCK_DIR).join(format!("{}.release", self.lock_name()))
    }

    /// The lock file `cnibpf monitor` holds while it follows the instance's drop events: a
    /// ring buffer has one read position, so a second reader would take events from the first.
    pub fn monitor_lock_file(&self) -> PathBuf {
        Path::new(LOCK_DIR).join(format!("{}.monitor.lock", self.lock_name()))
    }

    /// Held by the one `cnibpf monitor --matches` that follows the instance's match events.
    pub fn match_monitor_lock_file(&self) -> PathBuf {
        Path::new(LOCK_DIR).join(format!("{}.matches.lock", self.lock_name()))
    }

    fn lock_name(&self) -> String {
        self.root
            .to_string_lossy()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect()
    }
}

/// Where the cgroup v2 hierarchy is mounted (the default `cgroupPath`): `/sys/fs/cgroup` on a
/// unified host, `/sys/fs/cgroup/unified` on a hybrid one.
pub fn cgroup2_root() -> std::io::Result<Option<PathBuf>> {
    let mounts = std::fs::read_to_string(MOUNTS)?;
    Ok(mounts.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (_, mount_point, fs_type) = (fields.next()?, fields.next()?, fields.next()?);
        (fs_type == "cgroup2").then(|| PathBuf::from(mount_point))
    }))
}
