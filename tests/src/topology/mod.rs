//! The simulated host: "host" and "outside" namespaces joined by an uplink veth, containers
//! wired into the host by the reference bridge + host-local plugins with cnibpf chained after.
//!
//! ```text
//!   outside netns                     host netns                       container netns
//!   eth0 203.0.113.2/24  <-veth->  up0 203.0.113.1/24   cni0 10.22.0.1/16 <-veth-> eth0 10.22.x.y
//!        2001:db8:1::2/64              2001:db8:1::1/64        fd00:22::1/64             fd00:22::x
//! ```
//!
//! Every container is dual-stack; the outside namespace has no route to the container subnets.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    sync::Mutex,
};

use serde_json::{Value, json};

mod defaults;
mod network;
mod networks;
mod reference;
mod verbs;

pub use defaults::DefaultPaths;
pub use networks::Network;
pub use reference::ReferencePlugins;

use crate::{
    Chain, ChainError, Netns,
    chain::{self, Attachment},
};

/// Set (to anything) to run the simulated hosts as a Kubernetes node runs: `br_netfilter` on
/// (`bridge-nf-call-iptables=1`, as kube-proxy requires), so that the bridge hands the frames
/// it forwards between containers to the IP hooks. `cargo xtask test` runs the datapath's
/// suites once without and once with it.
pub const BRIDGE_NETFILTER_ENV: &str = "CNIBPF_TEST_BRIDGE_NETFILTER";

/// Whether this run's simulated hosts keep `br_netfilter` on ([`BRIDGE_NETFILTER_ENV`]).
pub fn bridge_netfilter() -> bool {
    std::env::var_os(BRIDGE_NETFILTER_ENV).is_some()
}

/// The file name of a simulated host's call log, in its work dir.
pub const CALL_LOG: &str = "cnibpf.log";
pub const UPLINK: &str = "up0";
pub const HOST_UPLINK_ADDR: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
pub const OUTSIDE_ADDR: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
pub const HOST_UPLINK_ADDR6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 1);
pub const OUTSIDE_ADDR6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 2);
pub const BRIDGE: &str = "cni0";
pub const SUBNET: &str = "10.22.0.0/16";
pub const SUBNET6: &str = "fd00:22::/64";
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 22, 0, 1);
pub const GATEWAY6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x22, 0, 0, 0, 0, 0, 1);
/// The "far" network behind the outside namespace (see [`SimHost::far_network`]).
pub const FAR_SUBNET: &str = "198.18.0.0/24";
pub const FAR_SUBNET6: &str = "2001:db8:3::/64";
pub const FAR_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
pub const FAR_ADDR6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 3, 0, 0, 0, 0, 2);

/// The cnibpf binary under test: `CNIBPF_BIN`, or the workspace's debug build.
pub fn cnibpf_binary() -> PathBuf {
    let path = std::env::var_os("CNIBPF_BIN").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/cnibpf"),
        PathBuf::from,
    );
    assert!(
        path.exists(),
        "cnibpf binary {} not found: build it first (cargo xtask test does)",
        path.display()
    );
    path.canonicalize().expect("canonical cnibpf path")
}

/// Where the cgroup v2 hierarchy is mounted on this machine.
pub fn cgroup2_root() -> PathBuf {
    let mounts = std::fs::read_to_string("/proc/self/mounts").expect("read /proc/self/mounts");
    mounts
        .lines()
        .find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(fields[1]))
        })
        .expect("a cgroup v2 hierarchy is mounted")
}

/// CNI_PATH with the reference plugins and the cnibpf under test.
pub fn cni_path() -> String {
    let cnibpf = cnibpf_binary();
    let dir = cnibpf.parent().expect("binary has a directory");
    format!("/usr/lib/cni:{}", dir.display())
}

/// A plugin chained after the bridge.
#[derive(Clone, Debug)]
pub enum Chained {
    /// cnibpf, with these keys besides `type`, `pinPath`, `cgroupPath` and `capabilities`.
    Cnibpf(Value),
    /// The reference `portmap` found in the search path (Debian's: iptables), with these keys
    /// besides `type`, `snat` and `capabilities`.
    ReferencePortmap(Value),
    /// Any other plugin's entry, as it stands (e.g. the reference `bandwidth`).
    Plugin(Value),
}

/// The reference `bandwidth` plugin's entry, taking its rates from runtimeConfig.
pub fn bandwidth_plugin() -> Chained {
    Chained::Plugin(json!({ "type": "bandwidth", "capabilities": { "bandwidth": true } }))
}

#[derive(Debug)]
pub struct SimHost {
    pub id: String,
    pub host: Netns,
    pub outside: Netns,
    pub pin_path: PathBuf,
    pub work_dir: PathBuf,
    /// The cgroup (v2) the socket hooks attach to; test clients of "host processes" join it.
    pub cgroup: PathBuf,
    pub chain: Chain,
    attached: Mutex<Vec<Attachment>>,
    /// `pin_path` is a [`SharedPinPath`]'s: neither cleared when the host is made nor removed
    /// when it goes.
    shares_pin_path: bool,
    /// Held while the host lives (released after its `Drop` cleaned up): a test of another
    /// suite running at the same time with the same id waits instead of taking its names.
    _claim: std::fs::File,
}

/// The datapath backend a simulated host's cnibpf is forced to, for suites that run for both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Ebpf,
    Nftables,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Self::Ebpf => "ebpf",
            Self::Nftables => "nftables",
        }
    }
}

impl SimHost {
    /// [`Self::new`] with cnibpf forced to `backend`; the names of an nftables host end in
    /// `-n`, so that both variants of a test can run at once.
    pub fn on(backend: Backend, id: &str, mut cnibpf_keys: Value) -> Self {
        cnibpf_keys["backend"] = Value::from(backend.name());
        match backend {
            Backend::Ebpf => Self::new(id, cnibpf_keys),
            Backend::Nftables => Self::new(&format!("{id}-n"), cnibpf_keys),
        }
    }

    /// [`Self::on`] with its instance at `pin_path`, which it shares with other hosts, one
    /// after the other or at once: the host takes whatever is there and leaves it when it goes.
    pub fn sharing(
        backend: Backend,
        id: &str,
        pin_path: &SharedPinPath,
        mut cnibpf_keys: Value,
    ) -> Self {
        cnibpf_keys["pinPath"] = json!(pin_path.path);
        let mut sim = Self::on(backend, id, cnibpf_keys);
        sim.pin_path.clone_from(&pin_path.path);
        sim.shares_pin_path = true;
        sim
    }

    /// The host goes as a machine switched off does: its namespaces, interfaces and cgroup go,
    /// and no DEL runs; what its instance keeps beyond them (a shared pinPath) stays.
    pub fn switch_off(self) {
        self.attached
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .clear();
    }

    /// Whether neither backend holds state of any attachment of this host's instance: no
    /// nftables table or state file, and no eBPF datapath — or one (which stays for the next
    /// pod until `cnibpf uninstall`) with no entry of an attachment in its maps and no link on
    /// a container's interface.
    pub fn holds_no_state(&self) -> bool {
        let ruleset = self.nft_ruleset();
        !nftables_state_file(&self.pin_path).exists()
            && !ruleset.contains("table inet cnibpf")
            && !ruleset.contains("table netdev cnibpf")
            && (!self.pin_path.exists() || self.datapath_holds_no_attachment())
    }

    /// Whether the pinned eBPF datapath holds nothing of any attachment.
    fn datapath_holds_no_attachment(&self) -> bool {
        let endpoint_links = std::fs::read_dir(self.pin_path.join("links"))
            .map(|entries| {
                entries
                    .flatten()
                    .filter(|entry| entry.file_name().to_string_lossy().starts_with("endpoint-"))
                    .count()
            })
            .unwrap_or_else(|error| panic!("list {}/links: {error}", self.pin_path.display()));
        endpoint_links == 0
            && ATTACHMENT_MAPS.iter().all(|name| {
                self.bpftool_dump(name)
                    .as_array()
                    .is_some_and(|entries| entries.is_empty())
            })
    }

    /// The rules of cnibpf's nftables table in the host namespace, as `nft` prints them.
    pub fn nft_ruleset(&self) -> String {
        self.host.exec(&["nft", "list", "ruleset"])
    }

    /// A simulated host whose conflist's cnibpf entry carries `cnibpf_keys` besides `type` and
    /// `pinPath`. `id` must be unique among concurrently running tests; keep it short.
    pub fn new(id: &str, cnibpf_keys: Value) -> Self {
        Self::with_version(id, "1.0.0", cnibpf_keys)
    }

    pub fn with_version(id: &str, cni_version: &str, cnibpf_keys: Value) -> Self {
        Self::build(id, cni_version, vec![Chained::Cnibpf(cnibpf_keys)], None)
    }

    /// The reference chain cnibpf replaces: the bridge masquerading with iptables (`ipMasq`)
    /// and the reference `portmap` chained after it, for comparisons.
    pub fn with_reference_chain(id: &str) -> Self {
        Self::build(
            id,
            "1.0.0",
            vec![Chained::ReferencePortmap(json!({}))],
            Some(ReferencePlugins::Iptables),
        )
    }

    /// A simulated host whose conflist chains `chained` after the bridge, in that order.
    pub fn with_chain(id: &str, chained: Vec<Chained>) -> Self {
        Self::build(id, "1.0.0", chained, None)
    }

    /// [`Self::on`] on a host shaped as a Kubernetes node: `br_netfilter` on whatever the run
    /// says (its tests put kube-proxy's rules in, `crate::kube_proxy`).
    pub fn kubernetes_node(backend: Backend, id: &str, cnibpf_keys: Value) -> Self {
        let sim = Self::on(backend, id, cnibpf_keys);
        sim.set_bridge_netfilter(true);
        sim
    }

    /// A host whose bridge masquerades with `bridge_masquerades`' netfilter, if any, with
    /// Debian's reference plugins.
    pub(super) fn build(
        id: &str,
        cni_version: &str,
        chained: Vec<Chained>,
        bridge_masquerades: Option<ReferencePlugins>,
    ) -> Self {
        Self::build_with(
            id,
            cni_version,
            chained,
            bridge_masquerades,
            ReferencePlugins::Iptables,
        )
    }

    pub(super) fn build_with(
        id: &str,
        cni_version: &str,
        chained: Vec<Chained>,
        bridge_masquerades: Option<ReferencePlugins>,
        plugins: ReferencePlugins,
    ) -> Self {
        // A run with br_netfilter on may run beside one without: its hosts have names of their
        // own.
        let id = &if bridge_netfilter() {
            format!("{id}-k")
        } else {
            id.to_owned()
        };
        let claim = claim(id);
        let host = Netns::create(&format!("cbt-{id}-host"));
        let outside = Netns::create(&format!("cbt-{id}-out"));
        let pin_path = PathBuf::from(format!("/sys/fs/bpf/cnibpf-test-{id}"));
        let work_dir = std::env::temp_dir().join(format!("cnibpf-test-{id}"));
        let _ = std::fs::remove_dir_all(&pin_path);
        let _ = std::fs::remove_dir_all(&work_dir);
        let _ = std::fs::remove_file(call_stats_file(&pin_path));
        let _ = std::fs::remove_file(nftables_state_file(&pin_path));
        std::fs::create_dir_all(&work_dir).expect("work dir");
        let cgroup = cgroup2_root().join(format!("cnibpf-test-{id}"));
        let _ = std::fs::remove_dir(&cgroup);
        std::fs::create_dir(&cgroup)
            .unwrap_or_else(|error| panic!("create cgroup {}: {error}", cgroup.display()));

        network::wire_uplink(&host, &outside, None);
        host.sysctl("net.ipv4.ip_forward", "1");
        host.sysctl("net.ipv6.conf.all.forwarding", "1");

        let chained: Vec<Value> = chained
            .into_iter()
            .map(|plugin| match plugin {
                Chained::Cnibpf(cnibpf_keys) => {
                    let mut cnibpf = json!({
                        "type": "cnibpf", "pinPath": pin_path, "cgroupPath": cgroup, "capabilities": { "portMappings": true },
                        "logFile": work_dir.join(CALL_LOG)
                    });
                    merge(&mut cnibpf, &cnibpf_keys);
                    cnibpf
                }
                Chained::ReferencePortmap(keys) => {
                    let mut portmap = json!({ "type": "portmap", "capabilities": { "portMappings": true }, "snat": true });
                    merge(&mut portmap, &keys);
                    portmap
                }
                Chained::Plugin(entry) => entry,
            })
            .collect();
        let mut bridge = json!({
            "type": "bridge", "bridge": BRIDGE, "isGateway": true,
            "ipMasq": bridge_masquerades.is_some(),
            "ipam": {
                "type": "host-local", "dataDir": work_dir.join("ipam"),
                "ranges": [[{ "subnet": SUBNET }], [{ "subnet": SUBNET6 }]],
                "routes": [{ "dst": "0.0.0.0/0" }, { "dst": "::/0" }]
            }
        });
        if bridge_masquerades == Some(ReferencePlugins::Nftables) {
            bridge["ipMasqBackend"] = json!("nftables");
        }
        let entries: Vec<Value> = std::iter::once(bridge).chain(chained).collect();
        let conflist = json!({
            "cniVersion": cni_version,
            "name": format!("net-{id}"),
            "plugins": entries,
        });
        let chain = Chain::new(conflist, &plugins.cni_path(), &host.path());
        // Counted once the host exists (its Drop uncounts it): a build that panics halfway
        // must not keep the last host's cleanup from running.
        defaults::host_made();
        let sim = Self {
            id: id.to_owned(),
            host,
            outside,
            pin_path,
            work_dir,
            cgroup,
            chain,
            attached: Mutex::new(Vec::new()),
            shares_pin_path: false,
            _claim: claim,
        };
        // br_netfilter is built into this kernel and on in every new namespace: cnibpf must not
        // depend on it, so the simulated host runs without it unless the run asks for it.
        sim.set_bridge_netfilter(bridge_netfilter());
        sim
    }

    /// Turns `br_netfilter` on or off for the host's bridges (both families).
    pub fn set_bridge_netfilter(&self, on: bool) {
        if Path::new("/proc/sys/net/bridge").exists() {
            let value = if on { "1" } else { "0" };
            self.host
                .sysctl("net.bridge.bridge-nf-call-iptables", value);
            self.host
                .sysctl("net.bridge.bridge-nf-call-ip6tables", value);
        }
    }
}

/// An exclusive lock on `id`'s names, across processes (the suites run side by side).
fn claim(id: &str) -> std::fs::File {
    let path = std::env::temp_dir().join(format!("cnibpf-test-{id}.lock"));
    let file = std::fs::File::create(&path)
        .unwrap_or_else(|error| panic!("create {}: {error}", path.display()));
    file.lock()
        .unwrap_or_else(|error| panic!("lock {}: {error}", path.display()));
    file
}

/// DELs what `attached` holds through `chain`, the last added first (a clean-up: what fails
/// to go is the host's teardown's to remove).
fn del_attached(chain: &Chain, attached: &Mutex<Vec<Attachment>>) {
    let attached =
        std::mem::take(&mut *attached.lock().unwrap_or_else(|poison| poison.into_inner()));
    for attachment in attached.iter().rev() {
        let _ = chain.del(attachment);
    }
}

impl Drop for SimHost {
    fn drop(&mut self) {
        del_attached(&self.chain, &self.attached);
        if !self.shares_pin_path {
            remove_instance_files(&self.pin_path);
            let _ = std::fs::remove_dir_all(&self.pin_path);
        }
        let _ = std::fs::remove_dir_all(&self.work_dir);
        let _ = std::fs::remove_dir(&self.cgroup);
        defaults::host_gone();
    }
}

/// A pinPath simulated hosts share ([`SimHost::sharing`]): empty when made, removed with all
/// of the instance's files when dropped (after the hosts, which it outlives).
#[derive(Debug)]
pub struct SharedPinPath {
    pub path: PathBuf,
}

impl SharedPinPath {
    pub fn new(id: &str) -> Self {
        let path = PathBuf::from(format!("/sys/fs/bpf/cnibpf-test-shared-{id}"));
        remove_instance_files(&path);
        let _ = std::fs::remove_dir_all(&path);
        Self { path }
    }
}

impl Drop for SharedPinPath {
    fn drop(&mut self) {
        remove_instance_files(&self.path);
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// The eBPF datapath's maps that hold entries of attachments (the others hold the node's: its
/// addresses, uplinks, counters, connections of which the attachments' DELs cleared their
/// parts).
const ATTACHMENT_MAPS: [&str; 13] = [
    "owners",
    "endpoints",
    "portmap",
    "owner_ports",
    "port_claims",
    "port_conditions",
    "masq_sources",
    "masq_excludes",
    "filters",
    "filter_hits",
    "answer_budgets",
    "network_members",
    "source_drops",
];

/// The call statistics file of the instance at `pin_path`, as `cnibpf inspect --json` names
/// it (`callStatsFile`): read there by tests that count calls, removed with the host.
pub fn call_stats_file(pin_path: &Path) -> PathBuf {
    instance_file(pin_path, "calls")
}

/// The nftables backend's state file of the instance at `pin_path`.
pub fn nftables_state_file(pin_path: &Path) -> PathBuf {
    instance_file(pin_path, "nftables.json")
}

/// Removes the files cnibpf keeps in /run/cnibpf for the instance at `pin_path` (its state
/// file, call statistics, locks), for a test's `Drop`: a test that ends without `cnibpf
/// uninstall` leaves none behind.
pub fn remove_instance_files(pin_path: &Path) {
    for suffix in [
        "calls",
        "nftables.json",
        "lock",
        "monitor.lock",
        "matches.lock",
        "release",
    ] {
        let _ = std::fs::remove_file(instance_file(pin_path, suffix));
    }
}

/// A file of the instance at `pin_path` in /run/cnibpf, named after it.
fn instance_file(pin_path: &Path, suffix: &str) -> PathBuf {
    let name: String = pin_path
        .to_string_lossy()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    PathBuf::from(format!("/run/cnibpf/{name}.{suffix}"))
}

/// An address family, for tests that run for both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub const BOTH: [Self; 2] = [Self::V4, Self::V6];

    /// The outside client's address.
    pub fn outside(self) -> IpAddr {
        match self {
            Self::V4 => IpAddr::V4(OUTSIDE_ADDR),
            Self::V6 => IpAddr::V6(OUTSIDE_ADDR6),
        }
    }

    /// The wildcard address to bind servers to.
    pub fn any(self, port: u16) -> SocketAddr {
        match self {
            Self::V4 => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port),
            Self::V6 => SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port),
        }
    }
}

#[derive(Debug)]
pub struct Container {
    pub netns: Netns,
    pub attachment: Attachment,
    pub result: Value,
    pub address: Ipv4Addr,
    pub address6: Ipv6Addr,
}

impl Container {
    pub fn socket(&self, port: u16) -> SocketAddr {
        SocketAddr::new(IpAddr::V4(self.address), port)
    }

    /// The container's address of `family` with `port`.
    pub fn at(&self, family: Family, port: u16) -> SocketAddr {
        match family {
            Family::V4 => SocketAddr::new(IpAddr::V4(self.address), port),
            Family::V6 => SocketAddr::new(IpAddr::V6(self.address6), port),
        }
    }
}

fn container_address(result: &Value, ipv4: bool) -> Option<IpAddr> {
    result["ips"].as_array()?.iter().find_map(|ip| {
        let address = ip["address"].as_str()?;
        let addr: IpAddr = address.split('/').next()?.parse().ok()?;
        (addr.is_ipv4() == ipv4).then_some(addr)
    })
}

/// `extra`'s keys set on the object `entry`.
fn merge(entry: &mut Value, extra: &Value) {
    if let (Some(entry), Some(extra)) = (entry.as_object_mut(), extra.as_object()) {
        for (key, value) in extra {
            entry.insert(key.clone(), value.clone());
        }
    }
}

/// A port mapping capability argument.
pub fn port_mappings(entries: &[(u16, u16, &str)]) -> Value {
    let list: Vec<Value> = entries
        .iter()
        .map(|(host_port, container_port, protocol)| {
            json!({ "hostPort": host_port, "containerPort": container_port, "protocol": protocol })
        })
        .collect();
    json!({ "portMappings": list })
}
