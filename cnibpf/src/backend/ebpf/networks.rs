//! Networks as filter rules name them (`srcNetwork`, `dstNetwork`): every attachment's
//! addresses by network (`network_members`, written with its endpoint, `endpoint.rs`), which the
//! datapath looks a rule's network up in, and the names of the networks rules name
//! (`network_names`), by which they read back.

use std::{collections::BTreeMap, net::IpAddr};

use aya::maps::{HashMap, MapData};
use cnibpf_common::{
    addr,
    endpoints::{self, EndpointInfo, OwnerInfo, owners::NAME_LEN},
    filter::{self, NetworkMember, NetworkMemberKey, NetworkName as StoredName},
    masquerade::{self, MasqSource, MasqSourceKey},
    portmap::{self, PortMapKey, PortMapValue},
};

use super::{
    EbpfBackend, batch, found, map_error, open_pinned, owner::read_name, read_error, remove_entry,
    sources, write_error,
};
use crate::{
    backend::{BackendError, Endpoint},
    model::{Filter, NetworkName},
    paths::PinLayout,
};

impl EbpfBackend {
    /// Records the attachment's addresses as members of its network (`network_members`),
    /// and forgets those it no longer has; an address another attachment of the network holds
    /// becomes this one's (the other's interface is gone, or it would not be given again).
    pub(super) fn record_members(&mut self, endpoint: &Endpoint) -> Result<(), BackendError> {
        let owner = endpoint.attachment.owner_id();
        let wanted = member_keys(endpoint)?;
        if !self.is_new(owner) {
            let stale: Vec<NetworkMemberKey> = self
                .members_of(owner)?
                .into_iter()
                .filter(|key| !wanted.contains(key))
                .collect();
            self.remove_members(&stale)?;
        }
        let entries: Vec<(NetworkMemberKey, NetworkMember)> = wanted
            .into_iter()
            .map(|key| (key, NetworkMember { owner }))
            .collect();
        let written = if self.is_new(owner) {
            // SAFETY: the map this build's load checked, of these types.
            unsafe {
                batch::insert_all_pinned(&self.pins.map(filter::NETWORK_MEMBERS.name), &entries)
            }
        } else {
            batch::insert_all(self.filter.network_members.open()?, &entries)
        };
        written.map_err(write_error(filter::NETWORK_MEMBERS.name))
    }

    /// Removes the attachment's addresses from its network's members (those still its own).
    pub(super) fn forget_members(&mut self, owner: u64) -> Result<(), BackendError> {
        let held = self.members_of(owner)?;
        self.remove_members(&held)
    }

    /// Whether the attachment's addresses are members of its network, as its own.
    pub(super) fn check_members(&self, endpoint: &Endpoint) -> Result<(), BackendError> {
        let owner = endpoint.attachment.owner_id();
        for key in member_keys(endpoint)? {
            let member = found(
                self.filter.network_members.open()?.get(&key, 0),
                filter::NETWORK_MEMBERS.name,
            )?;
            if member.is_none_or(|member| member.owner != owner) {
                return Err(BackendError::CheckFailed(format!(
                    "{} of {} is not a member of its network in map network_members",
                    addr::from_address(key.addr, key.family),
                    endpoint.attachment
                )));
            }
        }
        Ok(())
    }

    /// Every network's members, for `cnibpf inspect`: (network id, address, owner).
    pub(super) fn network_members_by_id(&self) -> Result<Vec<(u64, IpAddr, u64)>, BackendError> {
        Ok(batch::entries(self.filter.network_members.open()?)
            .map_err(read_error(filter::NETWORK_MEMBERS.name))?
            .into_iter()
            .map(|(key, member): (NetworkMemberKey, NetworkMember)| {
                (
                    key.network,
                    addr::from_address(key.addr, key.family),
                    member.owner,
                )
            })
            .collect())
    }

    fn members_of(&self, owner: u64) -> Result<Vec<NetworkMemberKey>, BackendError> {
        Ok(batch::entries(self.filter.network_members.open()?)
            .map_err(read_error(filter::NETWORK_MEMBERS.name))?
            .into_iter()
            .filter(|(_, member): &(NetworkMemberKey, NetworkMember)| member.owner == owner)
            .map(|(key, _)| key)
            .collect())
    }

    fn remove_members(&mut self, keys: &[NetworkMemberKey]) -> Result<(), BackendError> {
        for key in keys {
            remove_entry(
                self.filter.network_members.open_mut()?,
                key,
                filter::NETWORK_MEMBERS.name,
            )?;
        }
        Ok(())
    }

    /// Records the name of each network `filter`'s rules name, so that they read back.
    pub(super) fn record_network_names(&mut self, filter: &Filter) -> Result<(), BackendError> {
        let named = filter
            .rules
            .iter()
            .flat_map(|rule| [&rule.src_network, &rule.dst_network])
            .flatten();
        for network in named {
            let names = self.filter.network_names.open_mut()?;
            match found(names.get(&network.id(), 0), filter::NETWORK_NAMES.name)? {
                Some(stored) if name_of(&stored).as_ref() == Some(network) => {}
                Some(stored) => {
                    return Err(BackendError::NetworkIdTaken {
                        network: network.to_string(),
                        holder: String::from_utf8_lossy(&stored.name)
                            .trim_end_matches('\0')
                            .to_owned(),
                    });
                }
                None => names
                    .insert(&network.id(), &stored_name(network), 0)
                    .map_err(map_error("could not write map network_names"))?,
            }
        }
        Ok(())
    }

    /// The names of the networks `network_names` holds, by id.
    pub(super) fn network_names(&self) -> Result<Vec<(u64, NetworkName)>, BackendError> {
        let mut names = Vec::new();
        for (id, stored) in batch::entries(self.filter.network_names.open()?)
            .map_err(read_error(filter::NETWORK_NAMES.name))?
        {
            if let Some(name) = name_of(&stored) {
                names.push((id, name));
            }
        }
        Ok(names)
    }
}

/// The `network_members` keys of an attachment: each of its container's addresses in its
/// network.
fn member_keys(endpoint: &Endpoint) -> Result<Vec<NetworkMemberKey>, BackendError> {
    let network =
        NetworkName::new(&endpoint.attachment.network).map_err(BackendError::CheckFailed)?;
    Ok(endpoint
        .container_networks
        .iter()
        .map(|net| NetworkMemberKey {
            network: network.id(),
            addr: addr::to_address(net.addr()),
            family: addr::family_of(net.addr()),
            ..NetworkMemberKey::default()
        })
        .collect())
}

fn stored_name(network: &NetworkName) -> StoredName {
    let mut stored = StoredName::default();
    let bytes = network.as_str().as_bytes();
    stored.name[..bytes.len().min(NAME_LEN - 1)]
        .copy_from_slice(&bytes[..bytes.len().min(NAME_LEN - 1)]);
    stored
}

/// The name `network_names` holds; `None` for bytes no network name has.
fn name_of(stored: &StoredName) -> Option<NetworkName> {
    let length = stored
        .name
        .iter()
        .position(|byte| *byte == 0)
        // fail-closed: an Option of a search; a name of the value's full length has no NUL.
        .unwrap_or(NAME_LEN);
    // fail-closed: decoding a name; bytes no network name has are none.
    let text = std::str::from_utf8(&stored.name[..length]).ok()?;
    // fail-closed: as above.
    NetworkName::new(text).ok()
}

/// Makes the attachments another build's programs served members of their networks, as far as
/// the datapath knows their addresses — their source check's own, their masqueraded sources,
/// their hostPorts' container addresses — when this build's programs replace those: an earlier
/// release's attachments joined no network. Before the state is stamped, so that a run killed
/// in it leaves the next one to do it again; an address already a member is left as it is.
/// One whose addresses the datapath does not hold (no source check, masquerade or hostPort)
/// joins at its next ADD. Opens the maps it reads alone: during a migration the others may be
/// of an older version.
pub(super) fn backfill(pins: &PinLayout) -> Result<(), BackendError> {
    let owners: HashMap<MapData, u64, OwnerInfo> = open_pinned(pins, endpoints::OWNERS.name)?;
    let mut networks = BTreeMap::new();
    for (owner, info) in batch::entries(&owners).map_err(read_error(endpoints::OWNERS.name))? {
        // fail-closed: a network no rule can name needs no members.
        if let Ok(network) = NetworkName::new(&read_name(&info.network)) {
            networks.insert(owner, network.id());
        }
    }
    if networks.is_empty() {
        return Ok(());
    }
    let mut addresses = Vec::new();
    let records: HashMap<MapData, u32, EndpointInfo> =
        open_pinned(pins, endpoints::ENDPOINTS.name)?;
    for (_, info) in batch::entries(&records).map_err(read_error(endpoints::ENDPOINTS.name))? {
        if info.sources.checks() {
            let own = sources::own(&info.sources).addresses;
            addresses.extend(own.into_iter().map(|addr| (info.sources.owner, addr)));
        }
    }
    let masqueraded: HashMap<MapData, MasqSourceKey, MasqSource> =
        open_pinned(pins, masquerade::SOURCES.name)?;
    for (key, source) in
        batch::entries(&masqueraded).map_err(read_error(masquerade::SOURCES.name))?
    {
        addresses.push((source.owner, addr::from_address(key.addr, key.family)));
    }
    let mappings: HashMap<MapData, PortMapKey, PortMapValue> =
        open_pinned(pins, portmap::MAPPINGS.name)?;
    for (key, value) in batch::entries(&mappings).map_err(read_error(portmap::MAPPINGS.name))? {
        addresses.push((
            value.owner,
            addr::from_address(value.container_addr, key.family),
        ));
    }
    addresses.sort();
    addresses.dedup();
    let members: HashMap<MapData, NetworkMemberKey, NetworkMember> =
        open_pinned(pins, filter::NETWORK_MEMBERS.name)?;
    let mut entries = Vec::new();
    for (owner, addr) in addresses {
        let Some(network) = networks.get(&owner) else {
            continue;
        };
        let key = NetworkMemberKey {
            network: *network,
            addr: addr::to_address(addr),
            family: addr::family_of(addr),
            ..NetworkMemberKey::default()
        };
        if found(members.get(&key, 0), filter::NETWORK_MEMBERS.name)?.is_none() {
            entries.push((key, NetworkMember { owner }));
        }
    }
    batch::insert_all(&members, &entries).map_err(write_error(filter::NETWORK_MEMBERS.name))
}
