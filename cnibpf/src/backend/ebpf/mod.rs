//! The eBPF backend: TC programs attached with tcx links to the uplinks and to each
//! container's host-side interface, socket hooks on a cgroup, everything pinned under
//! `pinPath`. tcx links coexist with whatever else is on an interface — other programs, an
//! operator's qdiscs and filters, the `bandwidth` plugin's — and every packet cnibpf does not
//! take goes on to them.
//!
//! Layout of `pinPath`: the maps, pinned by name (see `cnibpf-common`); `programs/<name>`, one
//! pinned instance of each program shared by every attachment; `links/uplink-<if>-<hook>`,
//! `links/endpoint-<owner>-<from|to>` and `links/cgroup-<program>`, the links that keep the
//! hooks attached after the plugin exits (removing a link pin detaches it).

use std::{
    collections::HashSet,
    fs, io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::Path,
};

use aya::{
    EbpfLoader,
    maps::{Array, HashMap, LpmTrie, Map, MapData, MapError, PerCpuArray, PerCpuHashMap},
    programs::{
        CgroupAttachMode, CgroupSockAddr, LinkOrder, Program, SchedClassifier, TcAttachType,
        cgroup_sock_addr::{CgroupSockAddrAttachType, CgroupSockAddrLink},
        links::{FdLink, PinnedLink},
        tc::{SchedClassifierLink, TcAttach},
    },
};
use cnibpf_common::{
    FAMILY_IPV4, FAMILY_IPV6,
    endpoint::{self, EndpointInfo},
    filter::{self as filter_set, FilterSet},
    filter_flow::{self, FilterFlow, FilterFlowKey},
    filter_fragment::{self, FilterFragmentKey},
    filter_hits::{self, FilterHits},
    filter_stats::{self, FilterStats},
    host_addr::{self, HostAddrKey},
    layout::{self, LayoutInfo},
    masq_exclude::{self, MasqExcludeKey},
    masq_flow::{self, MasqFlow},
    masq_fragment::{self, FragmentKey},
    masq_reply::{self, MasqReply},
    masq_source::{self, MasqSource, MasqSourceKey},
    masq_stats::{self, MasqStats},
    nat_flow::{self, NatFlowKey, NatFlowValue},
    owner::{self, OwnerInfo},
    owner_port::{self, OwnerPortKey},
    port_claim::{self, PortClaim, PortClaimKey},
    port_condition::{PortConditions, PortConditionsKey},
    portmap::{self, PortMapKey, PortMapValue},
    settings::{self, Settings},
    uplink::{self, UplinkInfo},
};
use nix::{
    mount::{MsFlags, mount},
    sys::statfs::statfs,
};

mod batch;
mod conditions;
mod filter;
mod masquerade;
mod probe;

use super::{
    AttachmentRecord, Backend, BackendError, Endpoint, Filter, FilterRecord, Masquerade,
    MasqueradeRecord, describe_mapping, is_link_local,
};
use crate::{
    attachment::{Attachment, ResolvedMapping, read_name},
    config::Protocol,
    netlink::{self, Link},
    netns,
    paths::{BPFFS_MOUNT_POINT, PinLayout},
};

/// The datapath object built by `cargo xtask build-ebpf`, embedded at compile time.
static OBJECT: &[u8] = aya::include_bytes_aligned!(env!("CNIBPF_EBPF_OBJECT"));
/// Hash of [`OBJECT`] (computed by build.rs), recorded in the `layout` map with the programs.
const OBJECT_ID: &str = env!("CNIBPF_EBPF_OBJECT_ID");

/// `statfs` magic of bpffs.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// The programs, with the hook each attaches to.
pub const UPLINK_INGRESS: &str = "uplink_ingress";
pub const UPLINK_EGRESS: &str = "uplink_egress";
pub const FROM_CONTAINER: &str = "from_container";
pub const TO_CONTAINER: &str = "to_container";
const TC_PROGRAMS: [&str; 4] = [UPLINK_INGRESS, UPLINK_EGRESS, FROM_CONTAINER, TO_CONTAINER];
/// The socket hooks of host processes, attached to the instance's cgroup.
const SOCK_PROGRAMS: [(&str, CgroupSockAddrAttachType); 8] = [
    ("sock_connect4", CgroupSockAddrAttachType::Connect4),
    ("sock_connect6", CgroupSockAddrAttachType::Connect6),
    ("sock_sendmsg4", CgroupSockAddrAttachType::UDPSendMsg4),
    ("sock_sendmsg6", CgroupSockAddrAttachType::UDPSendMsg6),
    ("sock_recvmsg4", CgroupSockAddrAttachType::UDPRecvMsg4),
    ("sock_recvmsg6", CgroupSockAddrAttachType::UDPRecvMsg6),
    ("sock_peername4", CgroupSockAddrAttachType::GetPeerName4),
    ("sock_peername6", CgroupSockAddrAttachType::GetPeerName6),
];

fn all_programs() -> impl Iterator<Item = &'static str> {
    TC_PROGRAMS
        .into_iter()
        .chain(SOCK_PROGRAMS.iter().map(|(name, _)| *name))
}

/// One tcx hook: the program and where its link is pinned.
struct Hook<'a> {
    program: &'static str,
    attach_type: TcAttachType,
    link_pin: &'a Path,
}

pub struct EbpfBackend {
    pins: PinLayout,
    portmap: HashMap<MapData, PortMapKey, PortMapValue>,
    nat_flows: HashMap<MapData, NatFlowKey, NatFlowValue>,
    owners: HashMap<MapData, u64, OwnerInfo>,
    endpoints: HashMap<MapData, u32, EndpointInfo>,
    host_addrs: HashMap<MapData, HostAddrKey, u32>,
    owner_ports: HashMap<MapData, OwnerPortKey, PortMapKey>,
    port_claims: HashMap<MapData, PortClaimKey, PortClaim>,
    port_conditions: HashMap<MapData, PortConditionsKey, PortConditions>,
    masq_sources: HashMap<MapData, MasqSourceKey, MasqSource>,
    masq_excludes: LpmTrie<MapData, MasqExcludeKey, u32>,
    uplinks: HashMap<MapData, u32, UplinkInfo>,
    masq_flows: HashMap<MapData, NatFlowKey, MasqFlow>,
    masq_replies: HashMap<MapData, NatFlowKey, MasqReply>,
    masq_fragments: HashMap<MapData, FragmentKey, MasqReply>,
    masq_stats: PerCpuArray<MapData, MasqStats>,
    filters: HashMap<MapData, u32, FilterSet>,
    filter_hits: PerCpuHashMap<MapData, u32, FilterHits>,
    filter_flows: HashMap<MapData, FilterFlowKey, FilterFlow>,
    filter_fragments: HashMap<MapData, FilterFragmentKey, u64>,
    filter_stats: PerCpuArray<MapData, FilterStats>,
    /// The host's addresses (interface index, address) as dumped by `load_for_changes`.
    host_addresses: Vec<(u32, IpAddr)>,
    /// Whether this invocation already removed the expired entries of `masq_flows` (removing an
    /// attachment's flows does it in the same pass).
    masq_flows_swept: bool,
    /// The same for `filter_flows`.
    filter_flows_swept: bool,
}

impl std::fmt::Debug for EbpfBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EbpfBackend")
            .field("pins", &self.pins)
            .finish_non_exhaustive()
    }
}

impl EbpfBackend {
    /// Whether the eBPF backend can work on this host: the kernel loads and attaches a TC
    /// program (a kernel without BPF or tcx, or a sandbox that denies `bpf()`, fails here).
    pub fn probe() -> Result<(), BackendError> {
        probe::load_and_attach()
            .and_then(|()| probe::bpffs_writable())
            .map_err(|reason| BackendError::Unavailable {
                backend: "ebpf",
                reason,
            })
    }

    /// Opens the pinned state, loading and pinning the object first if it is not (all) there.
    /// Programs pinned by another build of the datapath are replaced, and every pinned link is
    /// switched to the new program atomically, so an upgrade takes effect without a packet
    /// passing unhooked.
    pub fn load(pins: &PinLayout) -> Result<Self, BackendError> {
        prepare_pin_dir(pins)?;
        let state = check_layout(pins)?;
        let programs_present = all_programs().all(|name| pins.program(name).exists());
        if state == PinnedState::Current && programs_present {
            return Self::open_maps(pins);
        }
        if let Err(error) = load_object(pins).and_then(|()| relink(pins)) {
            // Nothing of an attachment lives there yet: leave no half-loaded maps behind.
            if state == PinnedState::Absent {
                let _ = fs::remove_dir_all(pins.root());
            }
            return Err(error);
        }
        Self::open_maps(pins)
    }

    /// [`Self::load`] for changes (ADD), which also brings `host_addrs` up to date: the
    /// datapath cannot ask the kernel which addresses are the host's, so each ADD tells it.
    /// (Not on DEL: an address dump lists every container interface's link-local address.)
    pub fn load_for_changes(pins: &PinLayout) -> Result<Self, BackendError> {
        let mut backend = Self::load(pins)?;
        backend.sync_host_addresses()?;
        Ok(backend)
    }

    /// The pinned state if there is any, without loading anything.
    pub fn open_existing(pins: &PinLayout) -> Result<Option<Self>, BackendError> {
        if check_layout(pins)? == PinnedState::Absent {
            return Ok(None);
        }
        Self::open_maps(pins).map(Some)
    }

    /// The ring buffer of the filter's drop events, for `cnibpf monitor`.
    pub fn drop_events(&self) -> Result<aya::maps::RingBuf<MapData>, BackendError> {
        open_pinned(&self.pins, cnibpf_common::filter_event::MAP_NAME)
    }

    fn open_maps(pins: &PinLayout) -> Result<Self, BackendError> {
        Ok(Self {
            pins: pins.clone(),
            portmap: open_pinned(pins, portmap::MAP_NAME)?,
            nat_flows: open_pinned(pins, nat_flow::MAP_NAME)?,
            owners: open_pinned(pins, owner::MAP_NAME)?,
            endpoints: open_pinned(pins, endpoint::MAP_NAME)?,
            host_addrs: open_pinned(pins, host_addr::MAP_NAME)?,
            owner_ports: open_pinned(pins, owner_port::MAP_NAME)?,
            port_claims: open_pinned(pins, port_claim::MAP_NAME)?,
            port_conditions: open_pinned(pins, cnibpf_common::port_condition::MAP_NAME)?,
            masq_sources: open_pinned(pins, masq_source::MAP_NAME)?,
            masq_excludes: open_pinned(pins, masq_exclude::MAP_NAME)?,
            uplinks: open_pinned(pins, uplink::MAP_NAME)?,
            masq_flows: open_pinned(pins, masq_flow::MAP_NAME)?,
            masq_replies: open_pinned(pins, masq_reply::MAP_NAME)?,
            masq_fragments: open_pinned(pins, masq_fragment::MAP_NAME)?,
            masq_stats: open_pinned(pins, masq_stats::MAP_NAME)?,
            filters: open_pinned(pins, filter_set::MAP_NAME)?,
            filter_hits: open_pinned(pins, filter_hits::MAP_NAME)?,
            filter_flows: open_pinned(pins, filter_flow::MAP_NAME)?,
            filter_fragments: open_pinned(pins, filter_fragment::MAP_NAME)?,
            filter_stats: open_pinned(pins, filter_stats::MAP_NAME)?,
            host_addresses: Vec::new(),
            masq_flows_swept: false,
            filter_flows_swept: false,
        })
    }

    fn attach(&self, ifindex: u32, hook: &Hook<'_>) -> Result<(), BackendError> {
        let mut program = self.pinned_program(hook.program)?;
        if hook.link_pin.exists() {
            if is_attached(&program, ifindex, hook.attach_type)? {
                return Ok(());
            }
            // The link outlived its interface, or points at an older program instance.
            remove_pin(hook.link_pin)?;
        }
        let program_error = |action: String| {
            move |source| BackendError::Program {
                action,
                source: Box::new(source),
            }
        };
        let link_id = program
            .attach(
                ifindex,
                TcAttach::Tcx {
                    attach_type: hook.attach_type,
                    order: LinkOrder::default(),
                },
            )
            .map_err(program_error(format!(
                "could not attach {} to interface {ifindex}",
                hook.program
            )))?;
        let link = program.take_link(link_id).map_err(program_error(format!(
            "could not take the link of {}",
            hook.program
        )))?;
        let link: FdLink = link.try_into().map_err(|source| BackendError::Pin {
            action: format!("link of {} is not a tcx link", hook.program),
            source: Box::new(source),
        })?;
        link.pin(hook.link_pin)
            .map_err(|source| BackendError::Pin {
                action: format!("could not pin link {}", hook.link_pin.display()),
                source: Box::new(source),
            })?;
        Ok(())
    }

    fn check_attached(
        &self,
        ifindex: u32,
        ifname: &str,
        hook: &Hook<'_>,
    ) -> Result<(), BackendError> {
        let program = self.pinned_program(hook.program)?;
        if !hook.link_pin.exists() {
            return Err(BackendError::CheckFailed(format!(
                "link {} of {} on {ifname} is missing",
                hook.link_pin.display(),
                hook.program
            )));
        }
        if !is_attached(&program, ifindex, hook.attach_type)? {
            return Err(BackendError::CheckFailed(format!(
                "{} is not attached to {ifname} (index {ifindex})",
                hook.program
            )));
        }
        Ok(())
    }

    /// Attaches the socket hooks to `cgroup` once per instance; their links are pinned, so
    /// later ADDs find them in place.
    fn attach_socket_hooks(&self, cgroup: &Path) -> Result<(), BackendError> {
        let mut cgroup_dir = None;
        for (name, attach_type) in SOCK_PROGRAMS {
            let link_pin = self.pins.cgroup_link(name);
            if link_pin.exists() {
                continue;
            }
            let cgroup_dir = match &mut cgroup_dir {
                Some(dir) => dir,
                None => cgroup_dir.insert(fs::File::open(cgroup).map_err(|source| {
                    BackendError::Pin {
                        action: format!("could not open cgroup {}", cgroup.display()),
                        source: Box::new(source),
                    }
                })?),
            };
            let program_path = self.pins.program(name);
            let program_error = |action: String| {
                move |source| BackendError::Program {
                    action,
                    source: Box::new(source),
                }
            };
            let mut program =
                CgroupSockAddr::from_pin(&program_path, attach_type).map_err(program_error(
                    format!("could not open pinned program {}", program_path.display()),
                ))?;
            let link_id = program
                // Links coexist with other programs on the cgroup whatever the mode; the kernel
                // takes no mode flags for link creation.
                .attach(&*cgroup_dir, CgroupAttachMode::Single)
                .map_err(program_error(format!(
                    "could not attach {name} to cgroup {}",
                    cgroup.display()
                )))?;
            let link = program
                .take_link(link_id)
                .map_err(program_error(format!("could not take the link of {name}")))?;
            let link: FdLink = link.try_into().map_err(|source| BackendError::Pin {
                action: format!("link of {name} is not a bpf link"),
                source: Box::new(source),
            })?;
            link.pin(&link_pin).map_err(|source| BackendError::Pin {
                action: format!("could not pin link {}", link_pin.display()),
                source: Box::new(source),
            })?;
        }
        Ok(())
    }

    fn pinned_program(&self, name: &str) -> Result<SchedClassifier, BackendError> {
        let path = self.pins.program(name);
        SchedClassifier::from_pin(&path).map_err(|source| BackendError::Program {
            action: format!("could not open pinned program {}", path.display()),
            source: Box::new(source),
        })
    }

    fn uplink_link_pins(&self, ifname: &str) -> [std::path::PathBuf; 2] {
        [
            self.pins.uplink_link(ifname, "ingress"),
            self.pins.uplink_link(ifname, "egress"),
        ]
    }

    fn uplink_hooks<'a>(link_pins: &'a [std::path::PathBuf; 2]) -> [Hook<'a>; 2] {
        [
            Hook {
                program: UPLINK_INGRESS,
                attach_type: TcAttachType::Ingress,
                link_pin: &link_pins[0],
            },
            Hook {
                program: UPLINK_EGRESS,
                attach_type: TcAttachType::Egress,
                link_pin: &link_pins[1],
            },
        ]
    }

    /// The `portmap` keys the attachment owns, from its `owner_ports` slots.
    fn owned_portmap_keys(&self, owner: u64) -> Result<Vec<PortMapKey>, BackendError> {
        let Ok(info) = self.owners.get(&owner, 0) else {
            return Ok(Vec::new());
        };
        let mut keys = Vec::with_capacity(info.port_count as usize);
        for slot in 0..info.port_count {
            match self.owner_ports.get(&owner_port_key(owner, slot), 0) {
                Ok(key) => keys.push(key),
                Err(MapError::KeyNotFound) => {}
                Err(error) => return Err(map_error("could not read map owner_ports")(error)),
            }
        }
        Ok(keys)
    }

    /// Makes `keys` the attachment's `owner_ports` slots and its `port_count`.
    fn record_owned_keys(&mut self, owner: u64, keys: &[PortMapKey]) -> Result<(), BackendError> {
        let Ok(mut info) = self.owners.get(&owner, 0) else {
            return Ok(());
        };
        for (slot, key) in (0..).zip(keys) {
            self.owner_ports
                .insert(&owner_port_key(owner, slot), key, 0)
                .map_err(map_error("could not write map owner_ports"))?;
        }
        let count = u32::try_from(keys.len()).unwrap_or(u32::MAX);
        for slot in count..info.port_count {
            remove_entry(
                &mut self.owner_ports,
                &owner_port_key(owner, slot),
                owner_port::MAP_NAME,
            )?;
        }
        info.port_count = count;
        self.owners
            .insert(&owner, &info, 0)
            .map_err(map_error("could not write map owners"))
    }

    /// Counts a specific-address key in or out of `port_claims`; wildcard keys are not counted.
    fn claim(&mut self, key: &PortMapKey, taken: bool) -> Result<(), BackendError> {
        if key.host_addr == [0; 16] {
            return Ok(());
        }
        let claim_key = PortClaimKey {
            host_port: key.host_port,
            protocol: key.protocol,
            family: key.family,
        };
        let current = self
            .port_claims
            .get(&claim_key, 0)
            .map_or(0, |claim| claim.specific);
        let next = if taken {
            current.saturating_add(1)
        } else {
            current.saturating_sub(1)
        };
        if next == 0 {
            remove_entry(&mut self.port_claims, &claim_key, port_claim::MAP_NAME)
        } else {
            self.port_claims
                .insert(
                    &claim_key,
                    &PortClaim {
                        specific: next,
                        _pad: 0,
                    },
                    0,
                )
                .map_err(map_error("could not write map port_claims"))
        }
    }

    /// Removes one of the attachment's mappings, unless another attachment holds the key now.
    fn remove_owned_mapping(&mut self, owner: u64, key: &PortMapKey) -> Result<(), BackendError> {
        match self.portmap.get(key, 0) {
            Ok(value) if value.owner == owner => {
                remove_entry(&mut self.portmap, key, portmap::MAP_NAME)?;
                self.claim(key, false)
            }
            _ => Ok(()),
        }
    }

    fn sync_host_addresses(&mut self) -> Result<(), BackendError> {
        self.host_addresses =
            netlink::addresses().map_err(|source| BackendError::HostAddresses(Box::new(source)))?;
        let current: Vec<(HostAddrKey, u32)> = self
            .host_addresses
            .iter()
            .copied()
            .filter(|(_, addr)| !is_link_local(*addr))
            .map(|(ifindex, addr)| {
                let key = HostAddrKey {
                    addr: key_addr(addr),
                    family: if addr.is_ipv4() {
                        FAMILY_IPV4
                    } else {
                        FAMILY_IPV6
                    },
                    _pad: [0; 3],
                };
                (key, ifindex)
            })
            .collect();
        let mut stale = Vec::new();
        for key in self.host_addrs.keys() {
            let key = key.map_err(map_error("could not read map host_addrs"))?;
            if !current.iter().any(|(wanted, _)| *wanted == key) {
                stale.push(key);
            }
        }
        for key in stale {
            remove_entry(&mut self.host_addrs, &key, host_addr::MAP_NAME)?;
        }
        for (key, ifindex) in current {
            if self.host_addrs.get(&key, 0).ok() != Some(ifindex) {
                self.host_addrs
                    .insert(&key, &ifindex, 0)
                    .map_err(map_error("could not write map host_addrs"))?;
            }
        }
        Ok(())
    }

    /// Removes the `endpoints` entry of `ifindex` if `owner` still holds it (an interface index
    /// can be reused by another container once the first one's veth is gone).
    fn forget_endpoint(&mut self, owner: u64, ifindex: u32) -> Result<(), BackendError> {
        // Unpinning detaches (a link whose interface is gone is only a pin).
        for link_pin in self.endpoint_link_pins(owner) {
            remove_pin(&link_pin)?;
        }
        match self.endpoints.get(&ifindex, 0) {
            Ok(info) if info.owner == owner => {
                self.remove_filter(owner, ifindex)?;
                remove_entry(&mut self.endpoints, &ifindex, endpoint::MAP_NAME)
            }
            _ => Ok(()),
        }
    }

    fn endpoint_link_pins(&self, owner: u64) -> [std::path::PathBuf; 2] {
        [
            self.pins.endpoint_link(owner, "from"),
            self.pins.endpoint_link(owner, "to"),
        ]
    }

    /// The hooks of a container's host-side interface: what it sends (tcx ingress) and what
    /// it receives (tcx egress). A tcx attachment waits out an RCU grace period under the
    /// RTNL lock (10-25 ms each here); the price of sharing the interface with other programs
    /// and qdiscs, paid once per ADD, and not at all by a repeated ADD that finds them in place.
    fn endpoint_hooks<'a>(link_pins: &'a [std::path::PathBuf; 2]) -> [Hook<'a>; 2] {
        [
            Hook {
                program: FROM_CONTAINER,
                attach_type: TcAttachType::Ingress,
                link_pin: &link_pins[0],
            },
            Hook {
                program: TO_CONTAINER,
                attach_type: TcAttachType::Egress,
                link_pin: &link_pins[1],
            },
        ]
    }

    /// Removes the attachment's flows that `stale` selects.
    fn remove_flows(
        &mut self,
        owner: u64,
        stale: impl Fn(&NatFlowKey, &NatFlowValue) -> bool,
    ) -> Result<(), BackendError> {
        let flows = batch::entries(&self.nat_flows).map_err(read_error(nat_flow::MAP_NAME))?;
        for (key, value) in flows {
            if value.owner == owner && stale(&key, &value) {
                remove_entry(&mut self.nat_flows, &key, nat_flow::MAP_NAME)?;
            }
        }
        Ok(())
    }

    /// Removes everything shared once no attachment is left, so that a host without
    /// containers carries no cnibpf programs on its uplinks.
    fn teardown_shared_if_unused(&mut self) -> Result<(), BackendError> {
        if self.owners.keys().next().is_some() {
            return Ok(());
        }
        match fs::remove_dir_all(self.pins.root()) {
            Ok(()) => Ok(()),
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(BackendError::Pin {
                action: format!("could not remove {}", self.pins.root().display()),
                source: Box::new(source),
            }),
        }
    }
}

impl Backend for EbpfBackend {
    fn name(&self) -> &'static str {
        "ebpf"
    }

    fn setup_endpoint(&mut self, endpoint: &Endpoint) -> Result<(), BackendError> {
        let owner = endpoint.attachment.owner_id();
        let existing = self.owners.get(&owner, 0).ok();
        if let Some(existing) = existing {
            let holder = Attachment::from_owner_info(&existing);
            if holder != endpoint.attachment {
                return Err(BackendError::OwnerCollision {
                    owner,
                    attachment: Box::new(endpoint.attachment.clone()),
                    holder: Box::new(holder),
                });
            }
            if existing.host_ifindex != endpoint.host.index {
                self.forget_endpoint(owner, existing.host_ifindex)?;
            }
        }
        let mut info = endpoint
            .attachment
            .to_owner_info(&endpoint.host, endpoint.pod.as_ref());
        info.port_count = existing.map_or(0, |existing| existing.port_count);
        self.owners
            .insert(&owner, &info, 0)
            .map_err(map_error("could not record the attachment in map owners"))?;
        self.endpoints
            .insert(&endpoint.host.index, &endpoint_info(endpoint), 0)
            .map_err(map_error("could not write map endpoints"))?;
        let link_pins = self.endpoint_link_pins(owner);
        for hook in Self::endpoint_hooks(&link_pins) {
            self.attach(endpoint.host.index, &hook)?;
        }
        for uplink in &endpoint.uplinks {
            let uplink_pins = self.uplink_link_pins(&uplink.name);
            for hook in Self::uplink_hooks(&uplink_pins) {
                self.attach(uplink.index, &hook)?;
            }
        }
        self.attach_socket_hooks(&endpoint.cgroup)
    }

    fn teardown_endpoint(&mut self, owner: u64) -> Result<(), BackendError> {
        if let Ok(info) = self.owners.get(&owner, 0) {
            self.forget_endpoint(owner, info.host_ifindex)?;
        }
        remove_entry(&mut self.owners, &owner, owner::MAP_NAME)?;
        self.teardown_shared_if_unused()
    }

    fn check_endpoint(&self, endpoint: &Endpoint) -> Result<(), BackendError> {
        let owner = endpoint.attachment.owner_id();
        let info = self.owners.get(&owner, 0).map_err(|_| {
            BackendError::CheckFailed(format!(
                "{} is not recorded in map owners",
                endpoint.attachment
            ))
        })?;
        if info.host_ifindex != endpoint.host.index {
            return Err(BackendError::CheckFailed(format!(
                "{} was attached to interface {} (index {}), its host interface is now {} (index {})",
                endpoint.attachment,
                read_name(&info.host_ifname),
                info.host_ifindex,
                endpoint.host.name,
                endpoint.host.index
            )));
        }
        match self.endpoints.get(&endpoint.host.index, 0) {
            Ok(found) if found == endpoint_info(endpoint) => {}
            _ => {
                return Err(BackendError::CheckFailed(format!(
                    "the endpoints entry of {} (index {}) is missing or differs",
                    endpoint.host.name, endpoint.host.index
                )));
            }
        }
        let link_pins = self.endpoint_link_pins(owner);
        for hook in Self::endpoint_hooks(&link_pins) {
            self.check_attached(endpoint.host.index, &endpoint.host.name, &hook)?;
        }
        for uplink in &endpoint.uplinks {
            let uplink_pins = self.uplink_link_pins(&uplink.name);
            for hook in Self::uplink_hooks(&uplink_pins) {
                self.check_attached(uplink.index, &uplink.name, &hook)?;
            }
        }
        for (name, _) in SOCK_PROGRAMS {
            let pin = self.pins.cgroup_link(name);
            if !pin.exists() {
                return Err(BackendError::CheckFailed(format!(
                    "socket hook {name} is not attached to cgroup {} (link {} missing)",
                    endpoint.cgroup.display(),
                    pin.display()
                )));
            }
        }
        Ok(())
    }

    fn setup_port_mappings(
        &mut self,
        endpoint: &Endpoint,
        mappings: &[ResolvedMapping],
    ) -> Result<(), BackendError> {
        let owner = endpoint.attachment.owner_id();
        let previous = self.owned_portmap_keys(owner)?;
        let mut wanted = Vec::with_capacity(mappings.len());
        // Whether a flow translated before could now be reversed wrongly.
        let mut flows_stale = false;
        for mapping in mappings {
            let (key, value) = entry_for(endpoint, mapping);
            let before = self.portmap.get(&key, 0).ok();
            self.portmap
                .insert(&key, &value, 0)
                .map_err(map_error("could not write map portmap"))?;
            if previous.contains(&key) {
                flows_stale |= before != Some(value);
            } else {
                self.claim(&key, true)?;
            }
            wanted.push((key, value));
        }
        for key in &previous {
            if !wanted.iter().any(|(wanted_key, _)| wanted_key == key) {
                self.remove_owned_mapping(owner, key)?;
                flows_stale = true;
            }
        }
        let keys: Vec<PortMapKey> = wanted.iter().map(|(key, _)| *key).collect();
        self.record_owned_keys(owner, &keys)?;
        // Written after the mappings that need them: a mapping marked conditioned whose
        // conditions are not there yet is closed, never open.
        if mappings.is_empty() {
            self.remove_port_conditions(owner)?;
        } else {
            self.write_port_conditions(endpoint)?;
        }
        if !flows_stale {
            return Ok(());
        }
        // Flows translated by a mapping that is gone or leads elsewhere now must not keep
        // rewriting replies.
        self.remove_flows(owner, |flow_key, flow| {
            !wanted
                .iter()
                .any(|(key, value)| flow_of_mapping(flow_key, flow, key, value))
        })
    }

    fn teardown_port_mappings(&mut self, owner: u64) -> Result<(), BackendError> {
        let keys = self.owned_portmap_keys(owner)?;
        self.remove_port_conditions(owner)?;
        // Without mappings the attachment translated no flows: skip the scan of `nat_flows`,
        // which walks all its buckets even when empty.
        if keys.is_empty() {
            return Ok(());
        }
        for key in &keys {
            self.remove_owned_mapping(owner, key)?;
        }
        self.record_owned_keys(owner, &[])?;
        self.remove_flows(owner, |_, _| true)
    }

    fn holder_of(
        &self,
        owner: u64,
        mapping: &ResolvedMapping,
    ) -> Result<Option<u64>, BackendError> {
        let key = key_for(mapping);
        let other = |found: Result<PortMapValue, MapError>| {
            found
                .ok()
                .map(|value| value.owner)
                .filter(|holder| *holder != owner)
        };
        if let Some(holder) = other(self.portmap.get(&key, 0)) {
            return Ok(Some(holder));
        }
        if key.host_addr != [0; 16] {
            let wildcard = PortMapKey {
                host_addr: [0; 16],
                ..key
            };
            return Ok(other(self.portmap.get(&wildcard, 0)));
        }
        let claim_key = PortClaimKey {
            host_port: key.host_port,
            protocol: key.protocol,
            family: key.family,
        };
        if self.port_claims.get(&claim_key, 0).is_err() {
            return Ok(None);
        }
        // Some address-specific mapping holds this port: find whose (rare, so a scan is fine).
        for entry in self.portmap.iter() {
            let (found, value) = entry.map_err(map_error("could not read map portmap"))?;
            let same_port = found.host_port == key.host_port
                && found.protocol == key.protocol
                && found.family == key.family;
            if same_port && value.owner != owner {
                return Ok(Some(value.owner));
            }
        }
        Ok(None)
    }

    fn check_port_mappings(
        &self,
        endpoint: &Endpoint,
        mappings: &[ResolvedMapping],
    ) -> Result<(), BackendError> {
        let owner = endpoint.attachment.owner_id();
        let installed: HashSet<PortMapKey> = self.owned_portmap_keys(owner)?.into_iter().collect();
        for mapping in mappings {
            let (key, value) = entry_for(endpoint, mapping);
            match self.portmap.get(&key, 0) {
                Ok(found) if found == value => {}
                Ok(_) => {
                    return Err(BackendError::CheckFailed(format!(
                        "port mapping {} leads elsewhere than configured",
                        describe_mapping(mapping)
                    )));
                }
                Err(_) => {
                    return Err(BackendError::CheckFailed(format!(
                        "port mapping {} is missing",
                        describe_mapping(mapping)
                    )));
                }
            }
        }
        super::check_mapping_count(installed.len(), mappings.len())?;
        if mappings.is_empty() {
            Ok(())
        } else {
            self.check_port_conditions(endpoint)
        }
    }

    fn attachments(&self) -> Result<Vec<AttachmentRecord>, BackendError> {
        let mut records = Vec::new();
        for entry in self.owners.iter() {
            let (owner, info) = entry.map_err(map_error("could not read map owners"))?;
            records.push(AttachmentRecord {
                owner,
                attachment: Attachment::from_owner_info(&info),
                pod: Attachment::pod_of_owner_info(&info),
                host_ifname: read_name(&info.host_ifname),
                host_ifindex: info.host_ifindex,
            });
        }
        Ok(records)
    }

    fn setup_masquerade(
        &mut self,
        endpoint: &Endpoint,
        masquerade: Option<&Masquerade>,
    ) -> Result<(), BackendError> {
        self.apply_masquerade(endpoint, masquerade)
    }

    fn teardown_masquerade(&mut self, owner: u64) -> Result<(), BackendError> {
        self.remove_masquerade(owner)
    }

    fn check_masquerade(
        &self,
        endpoint: &Endpoint,
        masquerade: Option<&Masquerade>,
    ) -> Result<(), BackendError> {
        self.verify_masquerade(endpoint, masquerade)
    }

    fn setup_filter(
        &mut self,
        endpoint: &Endpoint,
        filter: Option<&Filter>,
    ) -> Result<(), BackendError> {
        self.apply_filter(endpoint, filter)
    }

    fn teardown_filter(&mut self, owner: u64) -> Result<(), BackendError> {
        match self.owners.get(&owner, 0) {
            Ok(info) => self.remove_filter(owner, info.host_ifindex),
            Err(_) => Ok(()),
        }
    }

    fn check_filter(
        &self,
        endpoint: &Endpoint,
        filter: Option<&Filter>,
    ) -> Result<(), BackendError> {
        self.verify_filter(endpoint, filter)
    }

    fn filters(&self) -> Result<Vec<(u64, FilterRecord)>, BackendError> {
        self.read_filters()
    }

    fn sweep_expired(&mut self) -> Result<(), BackendError> {
        self.remove_expired_flows()?;
        self.remove_expired_filter_flows()
    }

    fn refresh_uplinks(&mut self, uplinks: &[Link]) -> Result<(), BackendError> {
        self.write_uplink_addresses(uplinks)
    }

    fn masquerades(&self) -> Result<Vec<(u64, MasqueradeRecord)>, BackendError> {
        self.read_masquerades()
    }

    fn counters(&self) -> Result<Vec<(&'static str, u64)>, BackendError> {
        let mut counters = self.read_counters()?;
        counters.extend(self.read_filter_counters()?);
        Ok(counters)
    }

    fn uplink_addresses(&self) -> Result<Vec<super::UplinkAddresses>, BackendError> {
        self.read_uplink_addresses()
    }

    fn commit(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    fn port_mappings(&self) -> Result<Vec<(u64, ResolvedMapping)>, BackendError> {
        let mut mappings = Vec::new();
        for entry in self.portmap.iter() {
            let (key, value) = entry.map_err(map_error("could not read map portmap"))?;
            if let Some(mapping) = mapping_from_entry(&key, &value) {
                mappings.push((value.owner, mapping));
            }
        }
        Ok(mappings)
    }
}

/// What the datapath keeps about a container's host-side interface.
fn endpoint_info(endpoint: &Endpoint) -> EndpointInfo {
    let mut flags = 0;
    if endpoint.shaped {
        flags |= endpoint::FLAG_VIA_STACK;
    }
    if endpoint.host_ports.no_hairpin_snat {
        flags |= endpoint::FLAG_NO_HAIRPIN_SNAT;
    }
    EndpointInfo {
        gateway_v6: endpoint
            .gateway_v6
            .map_or([0; 16], |gateway| gateway.octets()),
        owner: endpoint.attachment.owner_id(),
        gateway_v4: endpoint
            .gateway_v4
            .map_or([0; 4], |gateway| gateway.octets()),
        container_mac: endpoint.container_mac,
        gateway_mac: endpoint.gateway_mac,
        flags,
        gateway_ifindex: endpoint.gateway_ifindex,
    }
}

fn owner_port_key(owner: u64, slot: u32) -> OwnerPortKey {
    OwnerPortKey {
        owner,
        slot,
        _pad: 0,
    }
}

fn key_for(mapping: &ResolvedMapping) -> PortMapKey {
    PortMapKey {
        host_addr: mapping.host_addr.map_or([0; 16], key_addr),
        host_port: mapping.host_port,
        protocol: mapping.protocol.number(),
        family: if mapping.is_ipv4() {
            FAMILY_IPV4
        } else {
            FAMILY_IPV6
        },
    }
}

fn entry_for(endpoint: &Endpoint, mapping: &ResolvedMapping) -> (PortMapKey, PortMapValue) {
    let key = key_for(mapping);
    let value = PortMapValue {
        container_addr: key_addr(mapping.container_addr),
        owner: endpoint.attachment.owner_id(),
        host_ifindex: endpoint.host.index,
        container_port: mapping.container_port,
        container_mac: endpoint.container_mac,
        gateway_mac: endpoint.gateway_mac,
        flags: if endpoint.host_ports.conditions(mapping.is_ipv4()).is_empty() {
            0
        } else {
            portmap::FLAG_CONDITIONED
        },
        _pad: [0; 5],
    };
    (key, value)
}

/// Whether a flow was translated by the mapping (key, value): same protocol and family, sent to
/// its hostPort on its host address (any, for the wildcard), towards its container address and port.
fn flow_of_mapping(
    flow_key: &NatFlowKey,
    flow: &NatFlowValue,
    key: &PortMapKey,
    value: &PortMapValue,
) -> bool {
    flow_key.protocol == key.protocol
        && flow_key.family == key.family
        && flow.orig_port == key.host_port
        && (key.host_addr == [0; 16] || key.host_addr == flow.orig_addr)
        && flow_key.src_addr == value.container_addr
        && flow_key.src_port == value.container_port
}

fn mapping_from_entry(key: &PortMapKey, value: &PortMapValue) -> Option<ResolvedMapping> {
    let ipv4 = key.family == FAMILY_IPV4;
    let host_addr = (key.host_addr != [0; 16]).then(|| addr_from_key(key.host_addr, ipv4));
    Some(ResolvedMapping {
        protocol: Protocol::from_number(key.protocol)?,
        host_addr,
        host_port: key.host_port,
        container_addr: addr_from_key(value.container_addr, ipv4),
        container_port: value.container_port,
    })
}

/// An address as map keys store it: IPv4 in the first four bytes, the rest zero.
fn key_addr(addr: IpAddr) -> [u8; 16] {
    match addr {
        IpAddr::V4(addr) => {
            let mut out = [0; 16];
            out[..4].copy_from_slice(&addr.octets());
            out
        }
        IpAddr::V6(addr) => addr.octets(),
    }
}

fn addr_from_key(bytes: [u8; 16], ipv4: bool) -> IpAddr {
    if ipv4 {
        IpAddr::V4(Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3]))
    } else {
        IpAddr::V6(Ipv6Addr::from(bytes))
    }
}

/// For a failed whole-map read (see `batch`).
fn read_error(name: &'static str) -> impl Fn(io::Error) -> BackendError {
    move |source| BackendError::MapRead { name, source }
}

fn map_error(action: &str) -> impl Fn(MapError) -> BackendError + '_ {
    move |source| BackendError::Map {
        action: action.to_owned(),
        source: Box::new(source),
    }
}

fn remove_entry<K: aya::Pod, V: aya::Pod>(
    map: &mut HashMap<MapData, K, V>,
    key: &K,
    name: &str,
) -> Result<(), BackendError> {
    match map.remove(key) {
        Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
        // Gone already (another DEL, an LRU eviction): what this removal wanted.
        Err(MapError::SyscallError(error)) if error.io_error.kind() == io::ErrorKind::NotFound => {
            Ok(())
        }
        Err(source) => Err(BackendError::Map {
            action: format!("could not delete from map {name}"),
            source: Box::new(source),
        }),
    }
}

fn remove_pin(path: &Path) -> Result<(), BackendError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(BackendError::Pin {
            action: format!("could not remove pin {}", path.display()),
            source: Box::new(source),
        }),
    }
}

fn is_attached(
    program: &SchedClassifier,
    ifindex: u32,
    attach_type: TcAttachType,
) -> Result<bool, BackendError> {
    let program_error = |action: &str| {
        let action = action.to_owned();
        move |source| BackendError::Program {
            action,
            source: Box::new(source),
        }
    };
    let id = program
        .info()
        .map_err(program_error("could not read program info"))?
        .id();
    match SchedClassifier::query_tcx(ifindex, attach_type) {
        Ok((_, attached)) => Ok(attached.iter().any(|info| info.id() == id)),
        // The interface is gone: nothing is attached to it.
        Err(aya::programs::ProgramError::SyscallError(error))
            if error.io_error.raw_os_error() == Some(libc::ENODEV) =>
        {
            Ok(false)
        }
        Err(source) => Err(program_error(&format!(
            "could not query tcx programs of interface {ifindex}"
        ))(source)),
    }
}

fn open_pinned<T: TryFrom<Map, Error = MapError>>(
    pins: &PinLayout,
    name: &str,
) -> Result<T, BackendError> {
    let path = pins.map(name);
    let error = |source| BackendError::Map {
        action: format!("could not open pinned map {}", path.display()),
        source: Box::new(source),
    };
    let data = MapData::from_pin(&path).map_err(error)?;
    let map = Map::from_map_data(data).map_err(error)?;
    T::try_from(map).map_err(error)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PinnedState {
    /// Nothing usable pinned (or a load that died before stamping the layout).
    Absent,
    /// Maps of this layout with programs of another build of the datapath.
    OtherPrograms,
    Current,
}

fn object_id() -> u64 {
    OBJECT_ID.parse().expect("build.rs emits a u64")
}

/// What is pinned under `pins`; an error when it has another layout.
fn check_layout(pins: &PinLayout) -> Result<PinnedState, BackendError> {
    let path = pins.map(layout::MAP_NAME);
    if !path.exists() {
        return Ok(PinnedState::Absent);
    }
    let incompatible = |found: String| BackendError::IncompatibleState {
        path: pins.root().to_owned(),
        found,
        expected: format!("v{}", layout::VERSION),
    };
    let unreadable = |error: MapError| incompatible(format!("unreadable ({error})"));
    let data = MapData::from_pin(&path).map_err(unreadable)?;
    let map = Map::from_map_data(data).map_err(unreadable)?;
    let array: Array<MapData, LayoutInfo> = Array::try_from(map)
        .map_err(|error| incompatible(format!("of another shape ({error})")))?;
    let info = array.get(&0, 0).map_err(unreadable)?;
    if info == LayoutInfo::default() {
        return Ok(PinnedState::Absent);
    }
    if info.magic != layout::MAGIC {
        return Err(incompatible("not written by cnibpf".to_owned()));
    }
    if info.version != layout::VERSION {
        return Err(incompatible(format!("v{}", info.version)));
    }
    if info.object_id == object_id() {
        Ok(PinnedState::Current)
    } else {
        Ok(PinnedState::OtherPrograms)
    }
}

/// Points a pinned cgroup link at the socket hook now pinned under the same name.
fn relink_cgroup(pins: &PinLayout, path: &Path, program_name: &str) -> Result<(), BackendError> {
    let Some((name, attach_type)) = SOCK_PROGRAMS.iter().find(|(name, _)| *name == program_name)
    else {
        // A hook this build no longer has: unpinning detaches it.
        return remove_pin(path);
    };
    let link_error = |source: Box<dyn std::error::Error + Send + Sync>| BackendError::Pin {
        action: format!("could not move link {} to the new {name}", path.display()),
        source,
    };
    let mut program = CgroupSockAddr::from_pin(pins.program(name), *attach_type)
        .map_err(|error| link_error(Box::new(error)))?;
    let pinned = PinnedLink::from_pin(path).map_err(|error| link_error(Box::new(error)))?;
    let link = CgroupSockAddrLink::try_from(FdLink::from(pinned))
        .map_err(|error| link_error(Box::new(error)))?;
    let moved = program
        .attach_to_link(link)
        .map(|link_id| drop(program.take_link(link_id)));
    settle_relink(moved, path, link_error)
}

/// The TC program a pinned tcx link (by its file name, see `PinLayout`) belongs to.
fn program_of_tc_link(file_name: &str) -> Option<&'static str> {
    if file_name.starts_with("uplink-") {
        Some(if file_name.ends_with("-ingress") {
            UPLINK_INGRESS
        } else {
            UPLINK_EGRESS
        })
    } else if file_name.starts_with("endpoint-") {
        Some(if file_name.ends_with("-from") {
            FROM_CONTAINER
        } else {
            TO_CONTAINER
        })
    } else {
        None
    }
}

/// What is left to do once `attach_to_link` moved (or failed to move) the link pinned at
/// `path`: nothing, unpin a link whose interface or cgroup is gone, or report the failure.
fn settle_relink(
    moved: Result<(), aya::programs::ProgramError>,
    path: &Path,
    link_error: impl Fn(Box<dyn std::error::Error + Send + Sync>) -> BackendError,
) -> Result<(), BackendError> {
    match moved {
        Ok(()) => Ok(()),
        Err(aya::programs::ProgramError::SyscallError(error))
            if error.io_error.raw_os_error() == Some(libc::ENOLINK) =>
        {
            remove_pin(path)
        }
        Err(error) => Err(link_error(Box::new(error))),
    }
}

/// Points every pinned link at the program now pinned for its hook (`bpf_link_update`, atomic
/// per link). Links whose interface is gone are unpinned instead.
fn relink(pins: &PinLayout) -> Result<(), BackendError> {
    let links_dir = pins.links_dir();
    let entries = fs::read_dir(&links_dir).map_err(|source| BackendError::Pin {
        action: format!("could not list {}", links_dir.display()),
        source: Box::new(source),
    })?;
    for entry in entries.filter_map(Result::ok) {
        let path = entry.path();
        let file_name = entry.file_name().to_string_lossy().into_owned();
        if let Some(program_name) = file_name.strip_prefix("cgroup-") {
            relink_cgroup(pins, &path, program_name)?;
            continue;
        }
        let Some(program_name) = program_of_tc_link(&file_name) else {
            continue;
        };
        let program_path = pins.program(program_name);
        let mut program =
            SchedClassifier::from_pin(&program_path).map_err(|source| BackendError::Program {
                action: format!("could not open pinned program {}", program_path.display()),
                source: Box::new(source),
            })?;
        let link_error = |source: Box<dyn std::error::Error + Send + Sync>| BackendError::Pin {
            action: format!(
                "could not move link {} to the new {program_name}",
                path.display()
            ),
            source,
        };
        let pinned = PinnedLink::from_pin(&path).map_err(|error| link_error(Box::new(error)))?;
        let link = SchedClassifierLink::try_from(FdLink::from(pinned))
            .map_err(|error| link_error(Box::new(error)))?;
        // Dropping the program would detach nothing (tcx links live on through their pin), but
        // taking the link out states that this process keeps no hold on it.
        let moved = program
            .attach_to_link(link)
            .map(|link_id| drop(program.take_link(link_id)));
        settle_relink(moved, &path, link_error)?;
    }
    Ok(())
}

/// Loads the embedded object, reusing maps already pinned under `pins` and pinning new ones,
/// then pins each program and finally stamps the layout map.
fn load_object(pins: &PinLayout) -> Result<(), BackendError> {
    let mut ebpf = EbpfLoader::new()
        .default_map_pin_directory(pins.root())
        .load(OBJECT)
        .map_err(|error| BackendError::Load(Box::new(error)))?;
    for (name, program) in ebpf.programs_mut() {
        let loaded = match program {
            Program::SchedClassifier(program) => program.load(),
            Program::CgroupSockAddr(program) => program.load(),
            _ => Err(aya::programs::ProgramError::UnexpectedProgramType),
        };
        loaded.map_err(|source| BackendError::Program {
            action: format!("the kernel rejected program {name}"),
            source: Box::new(source),
        })?;
        let path = pins.program(name);
        remove_pin(&path)?;
        program.pin(&path).map_err(|source| BackendError::Pin {
            action: format!("could not pin program {}", path.display()),
            source: Box::new(source),
        })?;
    }
    let host_netns_cookie = netns::current_cookie().map_err(|source| BackendError::Pin {
        action: "could not read the host's network namespace cookie".to_owned(),
        source: Box::new(source),
    })?;
    set_only_entry(
        &mut ebpf,
        pins,
        settings::MAP_NAME,
        &Settings { host_netns_cookie },
    )?;
    // Last: a layout stamp means everything before it is in place.
    set_only_entry(
        &mut ebpf,
        pins,
        layout::MAP_NAME,
        &LayoutInfo::current(object_id()),
    )?;
    Ok(())
}

/// Writes the single entry of the one-entry array map `name` of the loaded object.
fn set_only_entry<T: aya::Pod>(
    ebpf: &mut aya::Ebpf,
    pins: &PinLayout,
    name: &str,
    value: &T,
) -> Result<(), BackendError> {
    let map = ebpf
        .map_mut(name)
        .ok_or_else(|| BackendError::IncompatibleState {
            path: pins.root().to_owned(),
            found: format!("an object without a {name} map"),
            expected: format!("v{}", layout::VERSION),
        })?;
    let mut array: Array<&mut MapData, T> =
        Array::try_from(map).map_err(|source| BackendError::Map {
            action: format!("could not open map {name}"),
            source: Box::new(source),
        })?;
    array.set(0, value, 0).map_err(|source| BackendError::Map {
        action: format!("could not write map {name}"),
        source: Box::new(source),
    })
}

/// Mounts bpffs if the host has none at the usual place and creates the pin directories.
fn prepare_pin_dir(pins: &PinLayout) -> Result<(), BackendError> {
    let root = pins.root();
    let error = |path: &Path| {
        let path = path.to_owned();
        move |source| BackendError::Bpffs { path, source }
    };
    if root.starts_with(BPFFS_MOUNT_POINT) && !is_bpffs(Path::new(BPFFS_MOUNT_POINT)) {
        fs::create_dir_all(BPFFS_MOUNT_POINT).map_err(error(Path::new(BPFFS_MOUNT_POINT)))?;
        mount(
            Some("bpf"),
            BPFFS_MOUNT_POINT,
            Some("bpf"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            Some("mode=0700"),
        )
        .map_err(|errno| error(Path::new(BPFFS_MOUNT_POINT))(io::Error::from(errno)))?;
    }
    // Checked on the nearest existing ancestor, so that a wrong pinPath creates nothing.
    let existing = root.ancestors().find(|dir| dir.exists()).unwrap_or(root);
    if !is_bpffs(existing) {
        return Err(error(root)(io::Error::other(
            "not on a bpf filesystem (mount -t bpf bpf <dir>)",
        )));
    }
    for dir in [pins.programs_dir(), pins.links_dir()] {
        fs::create_dir_all(&dir).map_err(error(&dir))?;
    }
    Ok(())
}

pub(super) fn is_bpffs(path: &Path) -> bool {
    statfs(path).is_ok_and(|stats| stats.filesystem_type().0 == BPF_FS_MAGIC)
}
