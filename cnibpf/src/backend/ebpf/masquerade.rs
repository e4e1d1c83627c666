//! The eBPF backend's masquerade: `masq_sources`, `masq_excludes` and `uplinks` per
//! attachment and uplink; its part of the attachment's connections (`connections`) and their
//! `masq_replies`, which DEL and GC remove per attachment.

use std::net::IpAddr;

use aya::maps::{HashMap, LpmTrie, MapData, PerCpuArray, lpm_trie::Key};
use cnibpf_common::{
    addr,
    address::Address,
    connections::{Connection, ConnectionKey, PART_SNAT},
    masquerade::{
        self, MasqExcludeKey, MasqReply, MasqSource, MasqSourceKey, MasqStats, ReplyKey,
        UplinkInfo, excludes::OWNER_FAMILY_BITS,
    },
};
use ipnet::IpNet;

use super::{
    EbpfBackend, batch, found, map_error, on_demand::OnDemand, open_pinned, remove_entry,
    remove_where, removed, write_error,
};
use crate::{
    backend::{BackendError, Endpoint, Masquerading, is_link_local},
    model::Masquerade,
    netlink::{self, Link},
    paths::PinLayout,
};

/// The maps of masquerade: its sources and exclusions, the uplinks' addresses, its
/// connections' reply tuples (`masq_replies`) and statistics.
pub(super) struct MasqueradeMaps {
    pub(super) masq_sources: HashMap<MapData, MasqSourceKey, MasqSource>,
    pub(super) masq_excludes: LpmTrie<MapData, MasqExcludeKey, u32>,
    pub(super) uplinks: HashMap<MapData, u32, UplinkInfo>,
    pub(super) masq_replies: OnDemand<HashMap<MapData, ReplyKey, MasqReply>>,
    pub(super) masq_stats: OnDemand<PerCpuArray<MapData, MasqStats>>,
}

impl MasqueradeMaps {
    pub(super) fn open(pins: &PinLayout) -> Result<Self, BackendError> {
        Ok(Self {
            masq_sources: open_pinned(pins, masquerade::SOURCES.name)?,
            masq_excludes: open_pinned(pins, masquerade::EXCLUDES.name)?,
            uplinks: open_pinned(pins, masquerade::UPLINKS.name)?,
            masq_replies: OnDemand::new(pins, masquerade::REPLIES.name),
            masq_stats: OnDemand::new(pins, masquerade::STATS.name),
        })
    }

    /// Removes the `masq_replies` entry of a connection losing its masquerade, if it still
    /// leads to that connection (its port may have been claimed anew).
    pub(super) fn forget_reply(
        &mut self,
        key: &ConnectionKey,
        connection: &Connection,
    ) -> Result<(), BackendError> {
        let reply_key = ReplyKey {
            src_addr: key.remote_addr,
            dst_addr: connection.nat_addr,
            src_port: key.remote_port,
            dst_port: connection.nat_port,
            protocol: key.protocol,
            family: key.family,
            _pad: 0,
        };
        let leads_here = found(
            self.masq_replies.open()?.get(&reply_key, 0),
            masquerade::REPLIES.name,
        )?
        .is_some_and(|reply| {
            reply.container_addr == key.container_addr && reply.container_port == key.container_port
        });
        if leads_here {
            remove_entry(
                self.masq_replies.open_mut()?,
                &reply_key,
                masquerade::REPLIES.name,
            )?;
        }
        Ok(())
    }
}

impl Masquerading for EbpfBackend {
    fn setup_masquerade(
        &mut self,
        endpoint: &Endpoint,
        masquerade: Option<&Masquerade>,
    ) -> Result<(), BackendError> {
        let owner = endpoint.attachment.owner_id();
        let Some(masquerade) = masquerade else {
            if self.is_new(owner) {
                return Ok(());
            }
            return self.teardown_masquerade(owner);
        };
        let wanted_sources: Vec<MasqSourceKey> = masquerade
            .sources
            .iter()
            .map(|addr| source_key(*addr))
            .collect();
        let value = MasqSource {
            owner,
            host_ifindex: endpoint.host.index,
            container_mac: endpoint.container_mac,
            gateway_mac: endpoint.gateway_mac,
        };
        // A new attachment's entries are all to write; a changed one's only where they differ.
        let new = self.is_new(owner);
        let mut changed_sources = Vec::with_capacity(wanted_sources.len());
        for key in &wanted_sources {
            if new
                || found(
                    self.masquerade.masq_sources.get(key, 0),
                    masquerade::SOURCES.name,
                )? != Some(value)
            {
                changed_sources.push((*key, value));
            }
        }
        batch::insert_all(&self.masquerade.masq_sources, &changed_sources)
            .map_err(write_error(masquerade::SOURCES.name))?;
        let (current_sources, current_excludes) = if new {
            (Vec::new(), Vec::new())
        } else {
            self.owned_masquerade(owner)?
        };
        let mut dropped_sources = false;
        for key in current_sources {
            if !wanted_sources.contains(&key) {
                remove_entry(
                    &mut self.masquerade.masq_sources,
                    &key,
                    masquerade::SOURCES.name,
                )?;
                dropped_sources = true;
            }
        }
        let wanted_excludes: Vec<(Key<MasqExcludeKey>, u32)> = masquerade
            .excludes
            .iter()
            .map(|(net, reason)| (exclude_key(owner, net), *reason as u32))
            .collect();
        let mut changed_excludes = Vec::with_capacity(wanted_excludes.len());
        for (key, reason) in &wanted_excludes {
            if new
                || found(
                    self.masquerade.masq_excludes.get(key, 0),
                    masquerade::EXCLUDES.name,
                )? != Some(*reason)
            {
                changed_excludes.push((*key, *reason));
            }
        }
        batch::insert_all(&self.masquerade.masq_excludes, &changed_excludes)
            .map_err(write_error(masquerade::EXCLUDES.name))?;
        for (key, _) in current_excludes {
            let still_wanted = wanted_excludes.iter().any(|(wanted, _)| {
                wanted.prefix_len() == key.prefix_len() && wanted.data() == key.data()
            });
            if !still_wanted {
                self.remove_exclude(&key)?;
            }
        }
        if !dropped_sources {
            return Ok(());
        }
        // Connections of an address the attachment no longer masquerades must not be
        // translated.
        self.release_connections(|key, connection| {
            let dropped = connection.owner == owner
                && !wanted_sources
                    .iter()
                    .any(|source| source.addr == key.container_addr && source.family == key.family);
            if dropped { PART_SNAT } else { 0 }
        })
    }

    fn teardown_masquerade(&mut self, owner: u64) -> Result<(), BackendError> {
        let (sources, excludes) = self.owned_masquerade(owner)?;
        // Without masquerade entries the attachment has no flows either: skip the scans of the
        // flow tables, which cost a walk over all their buckets even when empty.
        if sources.is_empty() && excludes.is_empty() {
            return Ok(());
        }
        for key in sources {
            remove_entry(
                &mut self.masquerade.masq_sources,
                &key,
                masquerade::SOURCES.name,
            )?;
        }
        for (key, _) in excludes {
            self.remove_exclude(&key)?;
        }
        // One pass over the table serves this attachment and the sweep of expired state.
        self.release_connections(|_, connection| {
            if connection.owner == owner {
                PART_SNAT
            } else {
                0
            }
        })?;
        // Reply entries whose connection was evicted are found by their owner.
        remove_where(
            self.masquerade.masq_replies.open_mut()?,
            masquerade::REPLIES.name,
            |reply| reply.owner == owner,
        )
    }

    fn check_masquerade(
        &self,
        endpoint: &Endpoint,
        masquerade: Option<&Masquerade>,
    ) -> Result<(), BackendError> {
        let owner = endpoint.attachment.owner_id();
        let (sources, excludes) = self.owned_masquerade(owner)?;
        let Some(masquerade) = masquerade else {
            if let Some(source) = sources.first() {
                return Err(BackendError::CheckFailed(format!(
                    "{} masquerades {} although ipMasq is off",
                    endpoint.attachment,
                    addr::from_address(source.addr, source.family)
                )));
            }
            return Ok(());
        };
        for addr in &masquerade.sources {
            let key = source_key(*addr);
            match found(
                self.masquerade.masq_sources.get(&key, 0),
                masquerade::SOURCES.name,
            )? {
                Some(source)
                    if source.owner == owner && source.host_ifindex == endpoint.host.index => {}
                _ => {
                    return Err(BackendError::CheckFailed(format!(
                        "masquerade of {addr} for {} is missing from map masq_sources",
                        endpoint.attachment
                    )));
                }
            }
        }
        for (net, reason) in &masquerade.excludes {
            let key = exclude_key(owner, net);
            let present = excludes.iter().any(|(held, held_reason)| {
                held.prefix_len() == key.prefix_len()
                    && held.data() == key.data()
                    && *held_reason == *reason as u32
            });
            if !present {
                return Err(BackendError::CheckFailed(format!(
                    "masquerade exclusion {net} for {} is missing from map masq_excludes",
                    endpoint.attachment
                )));
            }
        }
        for uplink in &endpoint.uplinks {
            if found(
                self.masquerade.uplinks.get(&uplink.index, 0),
                masquerade::UPLINKS.name,
            )?
            .is_none()
            {
                return Err(BackendError::CheckFailed(format!(
                    "uplink {} (index {}) has no masquerade address in map uplinks",
                    uplink.name, uplink.index
                )));
            }
        }
        Ok(())
    }

    /// Hooks each uplink, and records its first IPv4 and first global IPv6 address (the kernel
    /// lists an interface's primary address first) as the address it masquerades to.
    fn refresh_uplinks(&mut self, uplinks: &[Link]) -> Result<(), BackendError> {
        if self.host_addresses.is_empty() {
            self.host_addresses = netlink::addresses()
                .map_err(|source| BackendError::HostAddresses(Box::new(source)))?;
        }
        for uplink in uplinks {
            let mut info = UplinkInfo::default();
            for (_, addr) in self
                .host_addresses
                .iter()
                .filter(|(index, addr)| *index == uplink.index && !is_link_local(*addr))
            {
                match addr {
                    IpAddr::V4(addr) if info.addr_v4 == [0; 4] => info.addr_v4 = addr.octets(),
                    IpAddr::V6(addr) if info.addr_v6.is_unspecified() => {
                        info.addr_v6 = Address::from_bytes(addr.octets());
                    }
                    _ => {}
                }
            }
            let recorded = found(
                self.masquerade.uplinks.get(&uplink.index, 0),
                masquerade::UPLINKS.name,
            )?;
            self.hook_uplink(uplink)?;
            if recorded != Some(info) {
                self.masquerade
                    .uplinks
                    .insert(&uplink.index, &info, 0)
                    .map_err(map_error("could not write map uplinks"))?;
            }
        }
        Ok(())
    }
}

impl EbpfBackend {
    /// The attachment's `masq_sources` keys and `masq_excludes` entries.
    #[expect(
        clippy::type_complexity,
        reason = "a pair of plain lists, named at the one call site that destructures it"
    )]
    fn owned_masquerade(
        &self,
        owner: u64,
    ) -> Result<(Vec<MasqSourceKey>, Vec<(Key<MasqExcludeKey>, u32)>), BackendError> {
        let mut sources = Vec::new();
        for entry in self.masquerade.masq_sources.iter() {
            let (key, source) = entry.map_err(map_error("could not read map masq_sources"))?;
            if source.owner == owner {
                sources.push(key);
            }
        }
        let mut excludes = Vec::new();
        for entry in self.masquerade.masq_excludes.iter() {
            let (key, reason) = entry.map_err(map_error("could not read map masq_excludes"))?;
            if key.data().owner == owner.to_be_bytes() {
                excludes.push((key, reason));
            }
        }
        Ok((sources, excludes))
    }

    fn remove_exclude(&mut self, key: &Key<MasqExcludeKey>) -> Result<(), BackendError> {
        removed(
            self.masquerade.masq_excludes.remove(key),
            masquerade::EXCLUDES.name,
        )
    }
}

fn source_key(addr: IpAddr) -> MasqSourceKey {
    MasqSourceKey {
        addr: addr::to_address(addr),
        family: addr::family_of(addr),
        _pad: 0,
        _pad2: 0,
    }
}

fn exclude_key(owner: u64, net: &IpNet) -> Key<MasqExcludeKey> {
    let net = net.trunc();
    Key::new(
        OWNER_FAMILY_BITS + u32::from(net.prefix_len()),
        MasqExcludeKey {
            owner: owner.to_be_bytes(),
            family: addr::family_of(net.addr()),
            addr: addr::to_address(net.addr()).bytes,
            _pad: [0; 3],
        },
    )
}

/// The network of an exclusion key; `None` for a key no cnibpf writes (inspect skips it).
pub(super) fn exclude_net(key: &Key<MasqExcludeKey>) -> Option<IpNet> {
    let data = key.data();
    // fail-closed: decoding a key read whole, no kernel result here.
    let prefix = u8::try_from(key.prefix_len().checked_sub(OWNER_FAMILY_BITS)?).ok()?;
    let addr = addr::from_address(Address::from_bytes(data.addr), data.family);
    // fail-closed: as above.
    IpNet::new(addr, prefix).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exclude_keys_round_trip_through_the_trie_form() {
        for text in ["10.22.0.0/16", "224.0.0.0/4", "ff00::/8", "192.168.7.9/32"] {
            let net: IpNet = text.parse().expect("literal");
            let key = exclude_key(0x0123_4567_89ab_cdef, &net);
            assert_eq!(exclude_net(&key), Some(net.trunc()));
            assert_eq!(key.data().owner, 0x0123_4567_89ab_cdef_u64.to_be_bytes());
        }
    }
}
