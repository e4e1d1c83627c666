//! What the datapath holds, read as the tests assert it: tcx programs on an interface, pinned
//! programs and maps (through aya and bpftool), the nftables ruleset, `cnibpf inspect`.

use std::{os::fd::AsFd as _, path::PathBuf};

use cnibpf_common::{
    address::Address,
    connections::{
        Connection, ConnectionKey, PART_DNAT, PART_FILTER, PART_SNAT, conntrack::STATE_ESTABLISHED,
    },
    filter::FilterHits,
    map_spec::MapSpec,
    masquerade::MasqStats,
};
use serde_json::Value;

use crate::{
    Container, SimHost,
    topology::{BRIDGE, Backend},
};

impl SimHost {
    /// Names of the programs attached with tcx to `ifname` in the host namespace (ingress and
    /// egress), asked of the kernel directly.
    pub fn tcx_programs(&self, ifname: &str) -> Vec<String> {
        let mut names: Vec<String> = self
            .tcx_program_ids(ifname)
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        names.sort();
        names
    }

    /// (name, id) of the programs attached with tcx to `ifname` in the host namespace.
    pub fn tcx_program_ids(&self, ifname: &str) -> Vec<(String, u32)> {
        let ifname = std::ffi::CString::new(ifname).expect("interface name");
        self.host.run(move || {
            use aya::programs::{SchedClassifier, TcAttachType};
            let mut programs = Vec::new();
            for attach_type in [TcAttachType::Ingress, TcAttachType::Egress] {
                let (_, attached) = SchedClassifier::query_tcx(ifname.as_c_str(), attach_type)
                    .unwrap_or_else(|error| panic!("query tcx of {ifname:?}: {error}"));
                programs.extend(
                    attached
                        .iter()
                        .map(|info| (info.name_as_str().unwrap_or("?").to_owned(), info.id())),
                );
            }
            programs.sort();
            programs
        })
    }

    /// The id of the program pinned as `programs/<name>`.
    pub fn pinned_program_id(&self, name: &str) -> u32 {
        let output = crate::netns::run_checked(
            std::process::Command::new("bpftool")
                .args(["-j", "prog", "show", "pinned"])
                .arg(self.pin_path.join("programs").join(name)),
        );
        let info: Value = serde_json::from_slice(&output.stdout)
            .unwrap_or_else(|error| panic!("bpftool prog show {name}: {error}"));
        info["id"]
            .as_u64()
            .and_then(|id| u32::try_from(id).ok())
            .unwrap_or_else(|| panic!("no id for {name}: {info}"))
    }

    /// `bpftool -j map dump pinned` of this instance's map `name`: what a user sees, BTF
    /// field names included.
    pub fn bpftool_dump(&self, name: &str) -> Value {
        let output = crate::netns::run_checked(
            std::process::Command::new("bpftool")
                .args(["-j", "map", "dump", "pinned"])
                .arg(self.pin_path.join(name)),
        );
        serde_json::from_slice(&output.stdout)
            .unwrap_or_else(|error| panic!("bpftool map dump {name}: {error}"))
    }

    /// (owner, original destination port) of every connection translated through a hostPort
    /// (its DNAT part in `connections`), via bpftool's BTF dump.
    pub fn translations(&self) -> Vec<(u64, u64)> {
        let entries = self.bpftool_dump("connections");
        let mut flows: Vec<(u64, u64)> = entries
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|entry| {
                let value = entry.get("formatted").unwrap_or(entry).get("value")?;
                let parts = value["parts"].as_u64()?;
                (parts & u64::from(PART_DNAT) != 0)
                    .then(|| Some((value["owner"].as_u64()?, value["orig_port"].as_u64()?)))?
            })
            .collect();
        flows.sort_unstable();
        flows
    }

    /// The pinned map `name` of this host's instance, opened with aya.
    pub fn pinned_map(&self, name: &str) -> aya::maps::Map {
        let path = self.pin_path.join(name);
        let data = aya::maps::MapData::from_pin(&path)
            .unwrap_or_else(|error| panic!("open pinned map {}: {error}", path.display()));
        aya::maps::Map::from_map_data(data)
            .unwrap_or_else(|error| panic!("map {}: {error}", path.display()))
    }

    /// The `max_entries` the kernel made the pinned map `name` with.
    pub fn map_size(&self, name: &str) -> u32 {
        let path = self.pin_path.join(name);
        aya::maps::MapData::from_pin(&path)
            .and_then(|data| data.info())
            .unwrap_or_else(|error| panic!("size of pinned map {}: {error}", path.display()))
            .max_entries()
    }

    /// Runs the pinned program `program` once on `frame` as if it arrived on interface
    /// `ifindex` of the host namespace (`BPF_PROG_TEST_RUN`): its verdict and the frame as it
    /// left the program. `None` when the kernel refuses the run (a frame shorter than an
    /// Ethernet header).
    pub fn test_run(&self, program: &str, ifindex: u32, frame: &[u8]) -> Option<(i32, Vec<u8>)> {
        use aya::programs::{SchedClassifier, TestRun as _, TestRunOptions};
        let path = self.pin_path.join("programs").join(program);
        let frame = frame.to_vec();
        self.host.run(move || {
            let program = SchedClassifier::from_pin(&path)
                .unwrap_or_else(|error| panic!("pinned program {}: {error}", path.display()));
            // struct __sk_buff: ingress_ifindex at 36, ifindex at 40; the kernel takes
            // nothing else we would set.
            let mut context = [0u8; 192];
            context[36..40].copy_from_slice(&ifindex.to_ne_bytes());
            context[40..44].copy_from_slice(&ifindex.to_ne_bytes());
            let mut out = vec![0u8; frame.len() + 256];
            let result = program
                .test_run(TestRunOptions {
                    data_in: Some(&frame),
                    data_out: Some(&mut out),
                    ctx_in: Some(&context),
                    ..TestRunOptions::default()
                })
                .ok()?;
            out.truncate(result.data_size_out as usize);
            Some((result.return_value as i32, out))
        })
    }

    /// How many connections have each part: translated through a hostPort, masqueraded,
    /// tracked by the filter.
    pub fn flow_counts(&self) -> [usize; 3] {
        let connections = self.connections();
        [PART_DNAT, PART_SNAT, PART_FILTER].map(|part| {
            connections
                .iter()
                .filter(|(_, connection)| connection.parts & part != 0)
                .count()
        })
    }

    /// Every entry of `connections`: a connection's tuple from its container's side, and what
    /// each feature keeps of it.
    pub fn connections(&self) -> Vec<(ConnectionKey, Connection)> {
        let map = self.pinned_hash_map::<ConnectionKey, Connection>("connections");
        map.iter()
            .map(|entry| entry.expect("read connections"))
            .collect()
    }

    /// The masqueraded connections (those with a SNAT part).
    pub fn masqueraded(&self) -> Vec<(ConnectionKey, Connection)> {
        self.connections()
            .into_iter()
            .filter(|(_, connection)| connection.parts & PART_SNAT != 0)
            .collect()
    }

    /// The pinned hash (or LRU hash) map `name` with its key and value types.
    pub fn pinned_hash_map<K: aya::Pod, V: aya::Pod>(
        &self,
        name: &str,
    ) -> aya::maps::HashMap<aya::maps::MapData, K, V> {
        aya::maps::HashMap::try_from(self.pinned_map(name))
            .unwrap_or_else(|error| panic!("map {name} as a hash map: {error}"))
    }

    /// Writes `count` established masqueraded connections of made-up containers into
    /// `connections`, as a busy host's would fill it (they never expire: last seen far ahead).
    pub fn fill_connections(&self, count: u32) {
        let mut map = self.pinned_hash_map::<ConnectionKey, Connection>("connections");
        for index in 0..count {
            let key = ConnectionKey {
                container_addr: Address::ipv4([10, 99, (index >> 8) as u8, index as u8]),
                remote_addr: Address::ipv4([192, 0, 2, 1]),
                container_port: (index >> 16) as u16 + 1,
                remote_port: 80,
                protocol: 6,
                family: 2,
                _pad: 0,
            };
            let connection = Connection {
                last_seen_ns: u64::MAX / 2,
                state: STATE_ESTABLISHED,
                parts: PART_SNAT,
                ..Connection::default()
            };
            map.insert(&key, &connection, 0)
                .unwrap_or_else(|error| panic!("fill connections, entry {index}: {error}"));
        }
    }

    /// Packets the filter rule at `position` decided, summed over attachments and CPUs
    /// (`filter_hits` read with this build's types).
    pub fn filter_rule_packets(&self, position: usize) -> u64 {
        let map: aya::maps::PerCpuHashMap<_, u32, FilterHits> =
            aya::maps::PerCpuHashMap::try_from(self.pinned_map("filter_hits"))
                .expect("filter_hits as a per-CPU hash map");
        map.iter()
            .map(|entry| entry.expect("read filter_hits"))
            .flat_map(|(_, per_cpu)| per_cpu.iter().copied().collect::<Vec<_>>())
            .map(|hits| hits.rules[position].packets)
            .sum()
    }

    /// `masq_stats` summed over the CPUs.
    /// [`Self::masq_stats`] on the eBPF backend; all zero on nftables (the kernel's conntrack
    /// keeps no such counters).
    pub fn masq_stats_if(&self, backend: Backend) -> MasqStats {
        match backend {
            Backend::Ebpf => self.masq_stats(),
            Backend::Nftables => MasqStats::default(),
        }
    }

    pub fn masq_stats(&self) -> MasqStats {
        let map: aya::maps::PerCpuArray<_, MasqStats> =
            aya::maps::PerCpuArray::try_from(self.pinned_map("masq_stats")).expect("masq_stats");
        let per_cpu = map.get(&0, 0).expect("read masq_stats");
        per_cpu
            .iter()
            .fold(MasqStats::default(), |sum, cpu| MasqStats {
                flows_created: sum.flows_created + cpu.flows_created,
                port_collisions: sum.port_collisions + cpu.port_collisions,
                ports_exhausted: sum.ports_exhausted + cpu.ports_exhausted,
                state_lost: sum.state_lost + cpu.state_lost,
                expired: sum.expired + cpu.expired,
                icmp_errors: sum.icmp_errors + cpu.icmp_errors,
                no_uplink_address: sum.no_uplink_address + cpu.no_uplink_address,
            })
    }

    /// The layout version the pinned state was written with.
    pub fn layout_version(&self) -> u32 {
        let entries = self.bpftool_dump("layout");
        let entry = &entries[0];
        entry.get("formatted").unwrap_or(entry)["value"]["version"]
            .as_u64()
            .and_then(|version| u32::try_from(version).ok())
            .unwrap_or_else(|| panic!("no version in {entries}"))
    }

    /// The `layout` map's single value as bytes: magic, version, padding, object id.
    pub fn layout_bytes(&self) -> Vec<u8> {
        let path = self.pin_path.join("layout").display().to_string();
        let raw = self.host.exec(&[
            "bpftool", "-j", "map", "lookup", "pinned", &path, "key", "0", "0", "0", "0",
        ]);
        let value: Value = serde_json::from_str(&raw).expect("bpftool JSON");
        value["value"]
            .as_array()
            .expect("the raw value")
            .iter()
            .map(|byte| {
                u8::from_str_radix(byte.as_str().expect("hex").trim_start_matches("0x"), 16)
                    .expect("a hex byte")
            })
            .collect()
    }

    /// Writes the `layout` map's single value, as another build of cnibpf could have left it.
    pub fn write_layout(&self, value: &[u8]) {
        let layout = self.pin_path.join("layout");
        let bytes: Vec<String> = value.iter().map(u8::to_string).collect();
        let mut command = std::process::Command::new("bpftool");
        command
            .args(["map", "update", "pinned"])
            .arg(&layout)
            .args(["key", "0", "0", "0", "0", "value"])
            .args(&bytes);
        crate::netns::run_checked(&mut command);
    }

    /// The host-side interface of a container, from its ADD result.
    pub fn host_interface(&self, container: &Container) -> String {
        container.result["interfaces"]
            .as_array()
            .and_then(|interfaces| {
                interfaces.iter().find_map(|interface| {
                    let name = interface["name"].as_str()?;
                    (interface.get("sandbox").is_none() && name != BRIDGE).then(|| name.to_owned())
                })
            })
            .unwrap_or_else(|| panic!("no host interface in {}", container.result))
    }

    /// The lock file cnibpf uses for this host's pinPath, as `cnibpf inspect` reports it.
    pub fn lock_file(&self) -> PathBuf {
        self.try_lock_file().unwrap_or_else(|| {
            panic!(
                "cnibpf inspect reports no lockFile for {}",
                self.pin_path.display()
            )
        })
    }

    /// [`Self::lock_file`], or `None` when inspect names none.
    pub(crate) fn try_lock_file(&self) -> Option<PathBuf> {
        let pin_path = self.pin_path.display().to_string();
        let output = self.cnibpf(&["inspect", "--json", "--pin-path", &pin_path]);
        let inspect: Value = serde_json::from_slice(&output.stdout).ok()?;
        inspect["lockFile"].as_str().map(PathBuf::from)
    }

    /// Whether a process holds the lock `cnibpf monitor` takes for this host's pinPath (read
    /// from /proc/locks: trying the lock would take it from a monitor starting that moment).
    pub fn monitor_following(&self) -> bool {
        use std::os::unix::fs::MetadataExt as _;
        let Some(lock) = self.try_lock_file() else {
            return false;
        };
        let Ok(inode) = std::fs::metadata(lock.with_extension("monitor.lock")).map(|m| m.ino())
        else {
            return false;
        };
        std::fs::read_to_string("/proc/locks").is_ok_and(|locks| {
            locks.lines().any(|line| {
                line.contains("FLOCK")
                    && line
                        .split_whitespace()
                        .any(|field| field.rsplit(':').next() == Some(&inode.to_string()))
            })
        })
    }

    /// `cnibpf inspect --json` of this host's pinPath.
    pub fn inspect(&self) -> Value {
        let pin_path = self.pin_path.display().to_string();
        let output = self.cnibpf(&["inspect", "--json", "--pin-path", &pin_path]);
        assert!(output.status.success(), "inspect failed: {output:?}");
        serde_json::from_slice(&output.stdout)
            .unwrap_or_else(|error| panic!("inspect printed no JSON ({error}): {output:?}"))
    }

    /// (containerID, hostPort, IP version of the container address) of every installed mapping.
    pub fn installed_host_ports(&self) -> Vec<(String, u64, u8)> {
        let inspect = self.inspect();
        let mut ports = Vec::new();
        for attachment in inspect["attachments"].as_array().into_iter().flatten() {
            let id = attachment["containerID"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            for mapping in attachment["portMappings"].as_array().into_iter().flatten() {
                let version = if mapping["containerIP"]
                    .as_str()
                    .unwrap_or_default()
                    .contains(':')
                {
                    6
                } else {
                    4
                };
                ports.push((
                    id.clone(),
                    mapping["hostPort"].as_u64().unwrap_or_default(),
                    version,
                ));
            }
        }
        ports.sort();
        ports
    }
}

/// What [`SimHost::installed_host_ports`] lists for a wildcard mapping of a dual-stack container.
pub fn dual_stack(container_id: &str, host_port: u64) -> Vec<(String, u64, u8)> {
    vec![
        (container_id.to_owned(), host_port, 4),
        (container_id.to_owned(), host_port, 6),
    ]
}

impl SimHost {
    /// The eBPF maps that still hold an entry of the attachment `owner`: every map whose spec
    /// says where its entries name their owner, and `endpoints.sources` for a source set
    /// another attachment's record still holds; empty when nothing of it is left (or no eBPF
    /// state is).
    pub fn ebpf_maps_holding(&self, owner: u64) -> Vec<&'static str> {
        use cnibpf_common::{
            endpoints::{ENDPOINTS, EndpointInfo},
            map_spec::OwnerField,
            sources::FLAG_RECORDED,
        };
        if !self.pin_path.join("owners").exists() {
            return Vec::new();
        }
        let word = |bytes: &[u8], at: usize| -> [u8; 8] {
            bytes[at..at + 8]
                .try_into()
                .expect("an owner id's eight bytes")
        };
        let mut holding: Vec<&'static str> = cnibpf_common::maps()
            .filter(|spec| {
                let owner_of = |key: &[u8], value: &[u8]| match spec.owner {
                    OwnerField::None => None,
                    OwnerField::Key => Some(u64::from_ne_bytes(word(key, 0))),
                    OwnerField::Value(at) => Some(u64::from_ne_bytes(word(value, at))),
                    OwnerField::KeyBigEndian(at) => Some(u64::from_be_bytes(word(key, at))),
                };
                spec.owner != OwnerField::None
                    && self
                        .raw_entries(spec)
                        .iter()
                        .any(|(key, value)| owner_of(key, value) == Some(owner))
            })
            .map(|spec| spec.name)
            .collect();
        let sources_held = self
            .pinned_hash_map::<u32, EndpointInfo>(ENDPOINTS.name)
            .iter()
            .map(|entry| entry.unwrap_or_else(|error| panic!("read endpoints: {error}")))
            .any(|(_, record)| {
                record.sources.flags & FLAG_RECORDED != 0 && record.sources.owner == owner
            });
        if sources_held {
            holding.push("endpoints.sources");
        }
        holding
    }

    /// Every entry of the pinned map of `spec`, as bytes.
    pub fn raw_entries(&self, spec: &MapSpec) -> Vec<(Vec<u8>, Vec<u8>)> {
        let map = aya::maps::MapData::from_pin(self.pin_path.join(spec.name))
            .unwrap_or_else(|error| panic!("open map {}: {error}", spec.name));
        crate::raw_bpf::map_entries(map.fd().as_fd(), spec.key_size, spec.value_size)
            .unwrap_or_else(|error| panic!("read map {}: {error}", spec.name))
    }
}

impl SimHost {
    /// The counts of address-specific hostPorts in `port_claims`: (hostPort, protocol, family,
    /// count), empty without eBPF state.
    pub fn port_claims(&self) -> Vec<(u16, u8, u8, u32)> {
        use cnibpf_common::portmap::{PortClaim, PortClaimKey};
        if !self.pin_path.join("port_claims").exists() {
            return Vec::new();
        }
        let mut claims: Vec<(u16, u8, u8, u32)> = self
            .pinned_hash_map::<PortClaimKey, PortClaim>("port_claims")
            .iter()
            .map(|entry| entry.expect("read port_claims"))
            .map(|(key, claim)| (key.host_port, key.protocol, key.family, claim.specific))
            .collect();
        claims.sort_unstable();
        claims
    }

    /// The owner id `inspect` shows for `container`'s attachment.
    pub fn owner_of(&self, container: &Container) -> u64 {
        let id = &container.attachment.container_id;
        self.inspect()["attachments"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|attachment| attachment["containerID"] == id.as_str())
            .and_then(|attachment| attachment["owner"].as_str())
            .and_then(|owner| u64::from_str_radix(owner, 16).ok())
            .unwrap_or_else(|| panic!("{id} is not attached"))
    }

    /// The container ids `inspect` lists, sorted.
    pub fn attached_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.inspect()["attachments"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|attachment| attachment["containerID"].as_str().map(str::to_owned))
            .collect();
        ids.sort();
        ids
    }
}
