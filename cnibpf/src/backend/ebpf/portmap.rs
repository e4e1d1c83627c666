//! Port mappings: `portmap` entries keyed by what a packet arrives at, each attachment's keys
//! in its `owner_ports` slots, `port_claims` counting address-specific keys (so a wildcard
//! finds an overlap without a scan), and their part of the connections they translated
//! (`connections`).

use std::collections::HashSet;

use aya::maps::{HashMap, MapData, MapError};
use cnibpf_common::{
    addr,
    address::Address,
    connections::{Connection, ConnectionKey, PART_DNAT},
    portmap::{
        self, OwnerPortKey, PortClaim, PortClaimKey, PortConditions, PortConditionsKey, PortMapKey,
        PortMapValue,
    },
};

use super::{
    EbpfBackend, batch, found, map_error, on_demand::OnDemand, open_pinned, remove_entry,
    write_error,
};
use crate::{
    backend::{BackendError, Endpoint, PortMappings, check_mapping_count, refuse_held_host_ports},
    journal,
    model::{Protocol, ResolvedMapping},
    paths::PinLayout,
};

/// The maps of port mapping: the mappings (`portmap`),
/// who holds which (`owner_ports`, `port_claims`) and who may reach them (`port_conditions`).
pub(super) struct PortMapMaps {
    pub(super) portmap: HashMap<MapData, PortMapKey, PortMapValue>,
    pub(super) owner_ports: HashMap<MapData, OwnerPortKey, PortMapKey>,
    pub(super) port_claims: HashMap<MapData, PortClaimKey, PortClaim>,
    /// Written only for attachments with hostPort conditions (the reference portmap's
    /// `conditionsV4`/`conditionsV6`).
    pub(super) port_conditions: OnDemand<HashMap<MapData, PortConditionsKey, PortConditions>>,
}

impl PortMapMaps {
    pub(super) fn open(pins: &PinLayout) -> Result<Self, BackendError> {
        Ok(Self {
            portmap: open_pinned(pins, portmap::MAPPINGS.name)?,
            owner_ports: open_pinned(pins, portmap::OWNER_PORTS.name)?,
            port_claims: open_pinned(pins, portmap::CLAIMS.name)?,
            port_conditions: OnDemand::new(pins, portmap::CONDITIONS.name),
        })
    }
}

impl EbpfBackend {
    /// The `portmap` keys the attachment owns, from its `owner_ports` slots.
    fn owned_portmap_keys(&self, owner: u64) -> Result<Vec<PortMapKey>, BackendError> {
        let Some(info) = self.endpoint.owner(owner)? else {
            return Ok(Vec::new());
        };
        let mut keys = Vec::with_capacity(info.port_count as usize);
        for slot in 0..info.port_count {
            match self
                .port_mapping
                .owner_ports
                .get(&owner_port_key(owner, slot), 0)
            {
                Ok(key) => keys.push(key),
                Err(MapError::KeyNotFound) => {}
                Err(error) => return Err(map_error("could not read map owner_ports")(error)),
            }
        }
        Ok(keys)
    }

    /// Makes `keys` the attachment's `owner_ports` slots and its `port_count`.
    fn record_owned_keys(&mut self, owner: u64, keys: &[PortMapKey]) -> Result<(), BackendError> {
        let Some(mut info) = self.endpoint.owner(owner)? else {
            return Ok(());
        };
        let slots: Vec<(OwnerPortKey, PortMapKey)> = (0..)
            .zip(keys)
            .map(|(slot, key)| (owner_port_key(owner, slot), *key))
            .collect();
        batch::insert_all(&self.port_mapping.owner_ports, &slots)
            .map_err(write_error(portmap::OWNER_PORTS.name))?;
        // fail-closed: no kernel result; an attachment has at most a few hundred mappings.
        let count = u32::try_from(keys.len()).unwrap_or(u32::MAX);
        for slot in count..info.port_count {
            remove_entry(
                &mut self.port_mapping.owner_ports,
                &owner_port_key(owner, slot),
                portmap::OWNER_PORTS.name,
            )?;
        }
        info.port_count = count;
        self.endpoint.record_owner(owner, &info)
    }

    /// Counts a specific-address key in or out of `port_claims`; wildcard keys are not counted.
    /// A key is counted in before its entry is installed and out after it is removed: a
    /// failure in between leaves the count too high (a wildcard of that port then scans
    /// `portmap` and finds no holder), never too low (which would let a wildcard overlap).
    fn claim(&mut self, key: &PortMapKey, taken: bool) -> Result<(), BackendError> {
        if key.host_addr.is_unspecified() {
            return Ok(());
        }
        let claim_key = claim_key(key);
        let current = found(
            self.port_mapping.port_claims.get(&claim_key, 0),
            portmap::CLAIMS.name,
        )?
        .map_or(0, |claim| claim.specific); // fail-closed: `found` kept the errors.
        let next = if taken {
            current.saturating_add(1)
        } else {
            current.saturating_sub(1)
        };
        self.set_claim(&claim_key, next)
    }

    /// Sets the count of specific-address mappings of a port to what `portmap` holds: for a key
    /// whose entry was never installed (an ADD that failed in between), whose count may be one
    /// too high. Rare, so a scan is fine.
    fn recount_claim(&mut self, key: &PortMapKey) -> Result<(), BackendError> {
        if key.host_addr.is_unspecified() {
            return Ok(());
        }
        let mut count = 0u32;
        for entry in self.port_mapping.portmap.iter() {
            let (found, _) = entry.map_err(map_error("could not read map portmap"))?;
            if claim_key(&found) == claim_key(key) && !found.host_addr.is_unspecified() {
                count += 1;
            }
        }
        self.set_claim(&claim_key(key), count)
    }

    fn set_claim(&mut self, claim_key: &PortClaimKey, next: u32) -> Result<(), BackendError> {
        if next == 0 {
            remove_entry(
                &mut self.port_mapping.port_claims,
                claim_key,
                portmap::CLAIMS.name,
            )
        } else {
            self.port_mapping
                .port_claims
                .insert(
                    claim_key,
                    &PortClaim {
                        specific: next,
                        _pad: 0,
                    },
                    0,
                )
                .map_err(map_error("could not write map port_claims"))
        }
    }

    /// Removes one of the attachment's mappings, unless another attachment holds the key now;
    /// one recorded but never installed has its port's count set right.
    fn remove_owned_mapping(&mut self, owner: u64, key: &PortMapKey) -> Result<(), BackendError> {
        match found(
            self.port_mapping.portmap.get(key, 0),
            portmap::MAPPINGS.name,
        )? {
            Some(value) if value.owner == owner => {
                remove_entry(&mut self.port_mapping.portmap, key, portmap::MAPPINGS.name)?;
                if let Some(mapping) = mapping_from_entry(key, &value) {
                    journal::note(journal::Change::HostPortReleased(mapping.to_string()));
                }
                self.claim(key, false)
            }
            Some(_) => Ok(()),
            None => self.recount_claim(key),
        }
    }
}

impl PortMappings for EbpfBackend {
    fn setup_port_mappings(
        &mut self,
        endpoint: &Endpoint,
        mappings: &[ResolvedMapping],
    ) -> Result<(), BackendError> {
        let owner = endpoint.attachment.owner_id();
        refuse_held_host_ports(self, owner, mappings)?;
        let previous = if self.is_new(owner) {
            Vec::new()
        } else {
            self.owned_portmap_keys(owner)?
        };
        let wanted: Vec<(PortMapKey, PortMapValue)> = mappings
            .iter()
            .map(|mapping| entry_for(endpoint, mapping))
            .collect();
        // Recorded before they are installed: whatever fails from here on, the attachment's
        // DEL finds every key it may hold.
        let mut recorded = previous.clone();
        for (key, _) in &wanted {
            if !recorded.contains(key) {
                recorded.push(*key);
            }
        }
        self.record_owned_keys(owner, &recorded)?;
        // Whether a flow translated before could now be reversed wrongly.
        let mut flows_stale = false;
        for (key, value) in &wanted {
            if previous.contains(key) {
                let before = found(
                    self.port_mapping.portmap.get(key, 0),
                    portmap::MAPPINGS.name,
                )?;
                flows_stale |= before != Some(*value);
            } else {
                self.claim(key, true)?;
            }
        }
        batch::insert_all(&self.port_mapping.portmap, &wanted)
            .map_err(write_error(portmap::MAPPINGS.name))?;
        for key in &previous {
            if !wanted.iter().any(|(wanted_key, _)| wanted_key == key) {
                self.remove_owned_mapping(owner, key)?;
                flows_stale = true;
            }
        }
        let keys: Vec<PortMapKey> = wanted.iter().map(|(key, _)| *key).collect();
        if keys != recorded {
            self.record_owned_keys(owner, &keys)?;
        }
        // Written after the mappings that need them: a mapping marked conditioned whose
        // conditions are not there yet is closed, never open.
        if mappings.is_empty() {
            if !self.is_new(owner) {
                self.remove_port_conditions(owner)?;
            }
        } else {
            self.write_port_conditions(endpoint)?;
        }
        if !flows_stale {
            return Ok(());
        }
        // Connections translated by a mapping that is gone or leads elsewhere now must not
        // keep rewriting replies.
        self.release_connections(|connection_key, connection| {
            let stale = connection.has(owner, PART_DNAT)
                && !wanted
                    .iter()
                    .any(|(key, value)| translated_by(connection_key, connection, key, value));
            if stale { PART_DNAT } else { 0 }
        })
    }

    fn teardown_port_mappings(&mut self, owner: u64) -> Result<(), BackendError> {
        let keys = self.owned_portmap_keys(owner)?;
        self.remove_port_conditions(owner)?;
        // Without mappings the attachment translated no connections: skip the scan of
        // `connections`, which walks all its buckets even when empty.
        if keys.is_empty() {
            return Ok(());
        }
        for key in &keys {
            self.remove_owned_mapping(owner, key)?;
        }
        self.record_owned_keys(owner, &[])?;
        self.release_connections(|_, connection| {
            if connection.owner == owner {
                PART_DNAT
            } else {
                0
            }
        })
    }

    fn holder_of(
        &self,
        owner: u64,
        mapping: &ResolvedMapping,
    ) -> Result<Option<u64>, BackendError> {
        let key = key_for(mapping);
        let other = |outcome: Result<PortMapValue, MapError>| {
            Ok::<_, BackendError>(
                found(outcome, portmap::MAPPINGS.name)?
                    .map(|value| value.owner)
                    .filter(|holder| *holder != owner),
            )
        };
        if let Some(holder) = other(self.port_mapping.portmap.get(&key, 0))? {
            return Ok(Some(holder));
        }
        if !key.host_addr.is_unspecified() {
            let wildcard = PortMapKey {
                host_addr: Address::UNSPECIFIED,
                ..key
            };
            return other(self.port_mapping.portmap.get(&wildcard, 0));
        }
        if found(
            self.port_mapping.port_claims.get(&claim_key(&key), 0),
            portmap::CLAIMS.name,
        )?
        .is_none()
        {
            return Ok(None);
        }
        // Some address-specific mapping holds this port: find whose (rare, so a scan is fine).
        for entry in self.port_mapping.portmap.iter() {
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

    /// `host_addrs`: the socket hooks take a wildcard hostPort for no other address, and the
    /// TC programs for no other destination.
    fn refresh_host_addresses(
        &mut self,
        service_interfaces: &[String],
    ) -> Result<(), BackendError> {
        self.sync_host_addresses(service_interfaces)
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
            match found(
                self.port_mapping.portmap.get(&key, 0),
                portmap::MAPPINGS.name,
            )? {
                Some(installed) if installed == value => {}
                Some(_) => {
                    return Err(BackendError::CheckFailed(format!(
                        "port mapping {} leads elsewhere than configured",
                        mapping
                    )));
                }
                None => {
                    return Err(BackendError::CheckFailed(format!(
                        "port mapping {} is missing",
                        mapping
                    )));
                }
            }
        }
        check_mapping_count(installed.len(), mappings.len())?;
        if mappings.is_empty() {
            Ok(())
        } else {
            self.check_port_conditions(endpoint)
        }
    }
}

fn claim_key(key: &PortMapKey) -> PortClaimKey {
    PortClaimKey {
        host_port: key.host_port,
        protocol: key.protocol,
        family: key.family,
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
        // fail-closed: an Option of the configuration; the wildcard is all zeroes.
        host_addr: mapping
            .host_addr
            .map_or(Address::UNSPECIFIED, addr::to_address),
        host_port: mapping.host_port,
        protocol: mapping.protocol.number(),
        family: addr::family_of(mapping.container_addr),
    }
}

fn entry_for(endpoint: &Endpoint, mapping: &ResolvedMapping) -> (PortMapKey, PortMapValue) {
    let key = key_for(mapping);
    let value = PortMapValue {
        container_addr: addr::to_address(mapping.container_addr),
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
        _pad: 0,
        _pad2: 0,
    };
    (key, value)
}

/// Whether a connection was translated by the mapping (key, value): same protocol and family,
/// sent to its hostPort on its host address (any, for the wildcard), towards its container
/// address and port.
fn translated_by(
    connection_key: &ConnectionKey,
    connection: &Connection,
    key: &PortMapKey,
    value: &PortMapValue,
) -> bool {
    connection_key.protocol == key.protocol
        && connection_key.family == key.family
        && connection.orig_port == key.host_port
        && (key.host_addr.is_unspecified() || key.host_addr == connection.orig_addr)
        && connection_key.container_addr == value.container_addr
        && connection_key.container_port == value.container_port
}

pub(super) fn mapping_from_entry(
    key: &PortMapKey,
    value: &PortMapValue,
) -> Option<ResolvedMapping> {
    let host_addr =
        (!key.host_addr.is_unspecified()).then(|| addr::from_address(key.host_addr, key.family));
    Some(ResolvedMapping {
        protocol: Protocol::from_number(key.protocol)?,
        host_addr,
        host_port: key.host_port,
        container_addr: addr::from_address(value.container_addr, key.family),
        container_port: value.container_port,
    })
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;

    fn mapping(host_addr: Option<&str>, container_port: u16) -> ResolvedMapping {
        ResolvedMapping {
            protocol: Protocol::Tcp,
            host_addr: host_addr.map(|addr| addr.parse().expect("literal")),
            host_port: 8080,
            container_addr: "10.22.0.2".parse().expect("literal"),
            container_port,
        }
    }

    fn entry(mapping: &ResolvedMapping) -> (PortMapKey, PortMapValue) {
        let key = key_for(mapping);
        let value = PortMapValue {
            container_addr: addr::to_address(mapping.container_addr),
            container_port: mapping.container_port,
            ..PortMapValue::default()
        };
        (key, value)
    }

    #[test]
    fn installed_entries_read_back_as_their_mappings() {
        for mapping in [mapping(None, 80), mapping(Some("203.0.113.1"), 80)] {
            let (key, value) = entry(&mapping);
            assert_eq!(mapping_from_entry(&key, &value), Some(mapping));
        }
    }

    #[test]
    fn a_connection_belongs_to_the_mapping_that_translated_it() {
        let host: IpAddr = "203.0.113.1".parse().expect("literal");
        let connection_key = ConnectionKey {
            container_addr: addr::to_address("10.22.0.2".parse().expect("literal")),
            remote_addr: addr::to_address("198.51.100.7".parse().expect("literal")),
            container_port: 80,
            remote_port: 40_000,
            protocol: Protocol::Tcp.number(),
            family: addr::family_of(host),
            _pad: 0,
        };
        let connection = Connection {
            orig_addr: addr::to_address(host),
            orig_port: 8080,
            parts: PART_DNAT,
            ..Connection::default()
        };
        let translated_by = |mapping: &ResolvedMapping| {
            let (key, value) = entry(mapping);
            translated_by(&connection_key, &connection, &key, &value)
        };
        assert!(
            translated_by(&mapping(None, 80)),
            "the wildcard takes any address"
        );
        assert!(translated_by(&mapping(Some("203.0.113.1"), 80)));
        assert!(
            !translated_by(&mapping(Some("203.0.113.2"), 80)),
            "another hostIP"
        );
        assert!(!translated_by(&mapping(None, 81)), "another container port");
    }
}
