//! Endpoints: an attachment's record (`owners`, `endpoints`), which hooks its host-side
//! interface, the uplinks and the instance's cgroup get (attached by `hooks`), and the host's
//! addresses the datapath tells apart from foreign ones.

use std::{
    cell::Cell,
    net::{Ipv4Addr, Ipv6Addr},
};

use aya::maps::{HashMap, MapData};
use cnibpf_common::{
    addr,
    address::Address,
    endpoints::{self, EndpointInfo, OwnerInfo},
    portmap::{self, HostAddrKey},
    sources::{FLAG_RECORDED, SourceSet},
};

use super::{
    EbpfBackend, batch, found,
    hooks::link_pinned,
    map_error, open_pinned,
    owner::{attachment_of, owner_info, read_name},
    pins::{QDISC_TRACEPOINT, QDISC_WATCHER, SOCK_PROGRAMS, attach_tracepoint},
    read_error, remove_entry,
    unpin::detach_link,
};
use crate::{
    backend::{BackendError, Endpoint, Endpoints, node_addresses},
    paths::PinLayout,
};

/// The maps of attachments and their interfaces: `owners`, `endpoints`, `host_addrs`.
pub(super) struct EndpointMaps {
    pub(super) owners: HashMap<MapData, u64, OwnerInfo>,
    pub(super) endpoints: HashMap<MapData, u32, EndpointInfo>,
    pub(super) host_addrs: HashMap<MapData, HostAddrKey, u32>,
    /// The `owners` record this process last read or wrote, with its owner: a call's steps
    /// ask for the record of their one attachment several times, and no other process changes
    /// `owners` while this one holds the instance lock (programs never write it).
    last_owner: Cell<Option<(u64, Option<OwnerInfo>)>>,
    /// The source set of an attachment new to the node, for its interface: `setup_endpoint`
    /// writes that interface's record whole with it, before hooking the interface, so it is
    /// not written (and read back) first on its own.
    deferred_sources: Option<(u32, SourceSet)>,
}

impl EndpointMaps {
    pub(super) fn open(pins: &PinLayout) -> Result<Self, BackendError> {
        Ok(Self {
            owners: open_pinned(pins, endpoints::OWNERS.name)?,
            endpoints: open_pinned(pins, endpoints::ENDPOINTS.name)?,
            host_addrs: open_pinned(pins, portmap::HOST_ADDRS.name)?,
            last_owner: Cell::new(None),
            deferred_sources: None,
        })
    }

    /// The `owners` record of attachment `owner`; `None` when the kernel has none.
    pub(super) fn owner(&self, owner: u64) -> Result<Option<OwnerInfo>, BackendError> {
        if let Some((last, info)) = self.last_owner.get()
            && last == owner
        {
            return Ok(info);
        }
        let info = found(self.owners.get(&owner, 0), endpoints::OWNERS.name)?;
        self.last_owner.set(Some((owner, info)));
        Ok(info)
    }

    /// Writes the `owners` record of attachment `owner`.
    pub(super) fn record_owner(
        &mut self,
        owner: u64,
        info: &OwnerInfo,
    ) -> Result<(), BackendError> {
        // A failed write may have changed the entry or not: the next read asks the kernel.
        self.last_owner.set(None);
        self.owners
            .insert(&owner, info, 0)
            .map_err(map_error("could not write map owners"))?;
        self.last_owner.set(Some((owner, Some(*info))));
        Ok(())
    }

    /// Removes the `owners` record of attachment `owner`.
    pub(super) fn forget_owner(&mut self, owner: u64) -> Result<(), BackendError> {
        self.last_owner.set(None);
        remove_entry(&mut self.owners, &owner, endpoints::OWNERS.name)?;
        self.last_owner.set(Some((owner, None)));
        Ok(())
    }

    /// Every attachment's `owners` record.
    pub(super) fn owner_records(&self) -> Result<Vec<(u64, OwnerInfo)>, BackendError> {
        batch::entries(&self.owners).map_err(read_error(endpoints::OWNERS.name))
    }

    /// The source set recorded for interface `ifindex`; `None` when its record holds none.
    pub(super) fn source_set(&self, ifindex: u32) -> Result<Option<SourceSet>, BackendError> {
        if let Some((deferred, set)) = self.deferred_sources
            && deferred == ifindex
        {
            return Ok(Some(set));
        }
        Ok(
            found(self.endpoints.get(&ifindex, 0), endpoints::ENDPOINTS.name)?
                .map(|info| info.sources)
                .filter(|set| set.flags & FLAG_RECORDED != 0),
        )
    }

    /// Every interface's recorded source set.
    pub(super) fn source_sets(&self) -> Result<Vec<(u32, SourceSet)>, BackendError> {
        Ok(batch::entries(&self.endpoints)
            .map_err(read_error(endpoints::ENDPOINTS.name))?
            .into_iter()
            .filter(|(_, info)| info.sources.flags & FLAG_RECORDED != 0)
            .map(|(ifindex, info)| (ifindex, info.sources))
            .collect())
    }

    /// Writes `set` into the record of interface `ifindex`, whole. The source check is set up
    /// before the endpoint (no packet may pass unchecked once the interface is hooked): an
    /// interface without a record gets one of the set's attachment with no hints, which
    /// `setup_endpoint` completes.
    pub(super) fn record_source_set(
        &mut self,
        ifindex: u32,
        set: &SourceSet,
    ) -> Result<(), BackendError> {
        let sources = recorded(set);
        let info = match found(self.endpoints.get(&ifindex, 0), endpoints::ENDPOINTS.name)? {
            Some(info) if info.sources == sources => return Ok(()),
            Some(info) => EndpointInfo { sources, ..info },
            None => EndpointInfo {
                owner: set.owner,
                sources,
                ..EndpointInfo::default()
            },
        };
        self.endpoints
            .insert(&ifindex, &info, 0)
            .map_err(map_error("could not write map endpoints"))
    }

    /// Keeps `set` for interface `ifindex` of attachment `set.owner`, which `owners` does not
    /// hold yet: nothing of it is hooked, and `setup_endpoint` writes the interface's record
    /// whole, with this set, before it hooks the interface. An ADD undone before then leaves
    /// nothing to remove.
    pub(super) fn defer_source_set(&mut self, ifindex: u32, set: &SourceSet) {
        self.deferred_sources = Some((ifindex, recorded(set)));
    }

    /// Clears the source set of interface `ifindex`. A record of the set's own attachment that
    /// `owners` does not hold is one `record_source_set` began for an ADD that never completed
    /// it: it goes whole.
    pub(super) fn clear_source_set(&mut self, ifindex: u32) -> Result<(), BackendError> {
        let Some(info) = found(self.endpoints.get(&ifindex, 0), endpoints::ENDPOINTS.name)? else {
            return Ok(());
        };
        if info.sources.flags & FLAG_RECORDED == 0 {
            return Ok(());
        }
        if info.owner == info.sources.owner && self.owner(info.owner)?.is_none() {
            return remove_entry(&mut self.endpoints, &ifindex, endpoints::ENDPOINTS.name);
        }
        let cleared = EndpointInfo {
            sources: SourceSet::default(),
            ..info
        };
        self.endpoints
            .insert(&ifindex, &cleared, 0)
            .map_err(map_error("could not write map endpoints"))
    }
}

/// `set` as a record holds it: a set without the mark reads as no set at all.
fn recorded(set: &SourceSet) -> SourceSet {
    SourceSet {
        flags: set.flags | FLAG_RECORDED,
        ..*set
    }
}

impl EbpfBackend {
    /// Makes `host_addrs` the node's addresses as they are now ([`node_addresses`]): the
    /// datapath cannot ask the kernel which local addresses are the node's, so each ADD and
    /// CHECK tells it, and so does `install --watch` as they change.
    pub(super) fn sync_host_addresses(
        &mut self,
        service_interfaces: &[String],
    ) -> Result<(), BackendError> {
        self.host_addresses = node_addresses(service_interfaces)?;
        let current: Vec<(HostAddrKey, u32)> = self
            .host_addresses
            .iter()
            .map(|(ifindex, addr)| {
                let key = HostAddrKey {
                    addr: addr::to_address(*addr),
                    family: addr::family_of(*addr),
                    _pad: 0,
                    _pad2: 0,
                };
                (key, *ifindex)
            })
            .collect();
        // One whole-map read: the entries are few, and the kernel's batch answers them at once.
        let recorded = batch::entries(&self.endpoint.host_addrs)
            .map_err(read_error(portmap::HOST_ADDRS.name))?;
        for (key, _) in &recorded {
            if !current.iter().any(|(wanted, _)| wanted == key) {
                remove_entry(&mut self.endpoint.host_addrs, key, portmap::HOST_ADDRS.name)?;
            }
        }
        for (key, ifindex) in current {
            if !recorded.contains(&(key, ifindex)) {
                self.endpoint
                    .host_addrs
                    .insert(&key, &ifindex, 0)
                    .map_err(map_error("could not write map host_addrs"))?;
            }
        }
        Ok(())
    }

    /// Removes the `endpoints` entry of `ifindex` if `owner` still holds it (an interface index
    /// can be reused by another container once the first one's veth is gone).
    fn forget_endpoint(&mut self, owner: u64, ifindex: u32) -> Result<(), BackendError> {
        for link_pin in self.endpoint_link_pins(owner) {
            detach_link(&link_pin)?;
        }
        match found(
            self.endpoint.endpoints.get(&ifindex, 0),
            endpoints::ENDPOINTS.name,
        )? {
            Some(info) if info.owner == owner => {
                self.remove_filter(owner, ifindex)?;
                remove_entry(
                    &mut self.endpoint.endpoints,
                    &ifindex,
                    endpoints::ENDPOINTS.name,
                )
            }
            _ => Ok(()),
        }
    }

    /// Clears `FLAG_UNFILTERED` from the record of interface `ifindex`, whoever holds it, so
    /// that the datapath looks for the rules about to be added from the first packet on
    /// (clearing a hint is always safe; `setup_endpoint` writes the whole record again).
    pub(super) fn expect_filter(&mut self, ifindex: u32) -> Result<(), BackendError> {
        match found(
            self.endpoint.endpoints.get(&ifindex, 0),
            endpoints::ENDPOINTS.name,
        )? {
            Some(mut info) if info.flags & endpoints::FLAG_UNFILTERED != 0 => {
                info.flags &= !endpoints::FLAG_UNFILTERED;
                self.endpoint
                    .endpoints
                    .insert(&ifindex, &info, 0)
                    .map_err(map_error("could not write map endpoints"))
            }
            _ => Ok(()),
        }
    }
}

impl Endpoints for EbpfBackend {
    fn setup_endpoint(&mut self, endpoint: &Endpoint) -> Result<(), BackendError> {
        let owner = endpoint.attachment.owner_id();
        let existing = self.endpoint.owner(owner)?;
        self.new_owner = existing.is_none().then_some(owner);
        if let Some(existing) = existing {
            let holder = attachment_of(&existing);
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
        let mut info = owner_info(&endpoint.attachment, &endpoint.host, endpoint.pod.as_ref());
        if let Some(existing) = existing {
            info.port_count = existing.port_count;
        }
        self.endpoint.record_owner(owner, &info)?;
        // The source set set up for this attachment before it stays: recorded
        // (`record_source_set`), or kept for this record (`defer_source_set`).
        let sources = self
            .endpoint
            .source_set(endpoint.host.index)?
            .filter(|set| set.owner == owner)
            // fail-closed: `source_set` kept the errors; none recorded is none to keep.
            .unwrap_or_default();
        self.endpoint
            .endpoints
            .insert(
                &endpoint.host.index,
                &EndpointInfo {
                    sources,
                    ..endpoint_info(endpoint)
                },
                0,
            )
            .map_err(map_error("could not write map endpoints"))?;
        self.endpoint.deferred_sources = None;
        self.record_members(endpoint)?;
        self.hook_endpoint(owner, endpoint.host.index, receives_through_hook(endpoint))?;
        self.attach_socket_hooks(&endpoint.cgroup)?;
        attach_tracepoint(&self.pins, QDISC_WATCHER, QDISC_TRACEPOINT)
    }

    fn teardown_endpoint(&mut self, owner: u64) -> Result<(), BackendError> {
        if let Some(info) = self.endpoint.owner(owner)? {
            self.forget_endpoint(owner, info.host_ifindex)?;
        }
        self.forget_members(owner)?;
        // The datapath stays for the next pod (no verifier time at its ADD) until `cnibpf
        // uninstall` or `cnibpf unload`.
        self.endpoint.forget_owner(owner)
    }

    fn check_endpoint(&self, endpoint: &Endpoint) -> Result<(), BackendError> {
        let owner = endpoint.attachment.owner_id();
        let info = self.endpoint.owner(owner)?.ok_or_else(|| {
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
        // Rules a live change set make the interface filtered whatever its configuration says.
        let changed_live = self.filter_changed_live(endpoint.host.index)?;
        let mut wanted = endpoint_info(endpoint);
        if changed_live {
            wanted.flags &= !endpoints::FLAG_UNFILTERED;
        }
        match found(
            self.endpoint.endpoints.get(&endpoint.host.index, 0),
            endpoints::ENDPOINTS.name,
        )? {
            // The source set is the source check's to judge.
            Some(record)
                if is_current(
                    &record,
                    &EndpointInfo {
                        sources: record.sources,
                        ..wanted
                    },
                ) => {}
            _ => {
                return Err(BackendError::CheckFailed(format!(
                    "the endpoints entry of {} (index {}) is missing or differs",
                    endpoint.host.name, endpoint.host.index
                )));
            }
        }
        self.check_members(endpoint)?;
        let link_pins = self.endpoint_link_pins(owner);
        let [from, to] = Self::endpoint_hooks(&link_pins);
        self.check_attached(endpoint.host.index, &endpoint.host.name, &from)?;
        if receives_through_hook(endpoint) || changed_live {
            self.check_attached(endpoint.host.index, &endpoint.host.name, &to)?;
        }
        for uplink in &endpoint.uplinks {
            let uplink_pins = self.uplink_link_pins(&uplink.name);
            for hook in Self::uplink_hooks(&uplink_pins) {
                self.check_attached(uplink.index, &uplink.name, &hook)?;
            }
        }
        let watcher = self.pins.tracepoint_link(QDISC_WATCHER);
        if !link_pinned(&watcher)? {
            return Err(BackendError::CheckFailed(format!(
                "the qdisc watcher is not attached (link {} missing)",
                watcher.display()
            )));
        }
        for (name, _) in SOCK_PROGRAMS {
            let pin = self.pins.cgroup_link(name);
            if !link_pinned(&pin)? {
                return Err(BackendError::CheckFailed(format!(
                    "socket hook {name} is not attached to cgroup {} (link {} missing)",
                    endpoint.cgroup.display(),
                    pin.display()
                )));
            }
        }
        Ok(())
    }
}

/// Whether a container's packets from the bridge or the host stack must pass `to_container`:
/// a filter judges them, or flows to its hostPorts are tracked (a direct connection reusing
/// one's tuple must find that translation forgotten, or its replies would be rewritten).
/// Without either the hook would look at every packet for nothing. Everything cnibpf hands
/// to a container itself is judged where it is handed over.
fn receives_through_hook(endpoint: &Endpoint) -> bool {
    endpoint.filtered || endpoint.host_ports_mapped
}

/// Whether the `endpoints` record `found` is `wanted`, or is it as a cnibpf made it that
/// knew none of the hint flags (the datapath then looks up what they would have told it).
fn is_current(found: &EndpointInfo, wanted: &EndpointInfo) -> bool {
    let unhinted = |info: &EndpointInfo| EndpointInfo {
        flags: info.flags & !endpoints::HINT_FLAGS,
        ..*info
    };
    found == wanted || (found.flags & endpoints::HINT_FLAGS == 0 && *found == unhinted(wanted))
}

/// What the datapath keeps about a container's host-side interface.
fn endpoint_info(endpoint: &Endpoint) -> EndpointInfo {
    let mut flags = 0;
    if endpoint.shaped {
        flags |= endpoints::FLAG_VIA_STACK;
    }
    if endpoint.host_ports.no_hairpin_snat {
        flags |= endpoints::FLAG_NO_HAIRPIN_SNAT;
    }
    if endpoint.host_firewall {
        flags |= endpoints::FLAG_HOST_FIREWALL;
    }
    if !endpoint.filtered {
        flags |= endpoints::FLAG_UNFILTERED;
    }
    flags |= if endpoint.masqueraded {
        endpoints::FLAG_MASQUERADED
    } else {
        endpoints::FLAG_UNMASQUERADED
    };
    EndpointInfo {
        gateway_v6: Address::from_bytes(
            endpoint
                .gateway_v6
                // fail-closed: Options of the plan; no gateway is stored as the unspecified
                // address.
                .unwrap_or(Ipv6Addr::UNSPECIFIED)
                .octets(),
        ),
        owner: endpoint.attachment.owner_id(),
        // fail-closed: as above.
        gateway_v4: endpoint
            .gateway_v4
            .unwrap_or(Ipv4Addr::UNSPECIFIED)
            .octets(),
        container_mac: endpoint.container_mac,
        gateway_mac: endpoint.gateway_mac,
        flags,
        gateway_ifindex: endpoint.gateway_ifindex,
        sources: SourceSet::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wanted() -> EndpointInfo {
        EndpointInfo {
            owner: 7,
            gateway_v4: [10, 22, 0, 1],
            flags: endpoints::FLAG_VIA_STACK
                | endpoints::FLAG_UNFILTERED
                | endpoints::FLAG_MASQUERADED,
            gateway_ifindex: 3,
            ..EndpointInfo::default()
        }
    }

    #[test]
    fn a_record_without_hints_is_current_and_a_wrong_hint_is_not() {
        let wanted = wanted();
        assert!(is_current(&wanted, &wanted));
        let older_build = EndpointInfo {
            flags: endpoints::FLAG_VIA_STACK,
            ..wanted
        };
        assert!(
            is_current(&older_build, &wanted),
            "made by a build without hints"
        );
        let filter_missed = EndpointInfo {
            flags: endpoints::FLAG_VIA_STACK | endpoints::FLAG_MASQUERADED,
            ..wanted
        };
        assert!(!is_current(&filter_missed, &wanted), "a hint that differs");
        let other_flags = EndpointInfo { flags: 0, ..wanted };
        assert!(
            !is_current(&other_flags, &wanted),
            "a flag that is not a hint"
        );
        let other_gateway = EndpointInfo {
            flags: endpoints::FLAG_VIA_STACK,
            gateway_ifindex: 4,
            ..wanted
        };
        assert!(!is_current(&other_gateway, &wanted));
    }
}
