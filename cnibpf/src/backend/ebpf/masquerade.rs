//! The eBPF backend's masquerade: `masq_sources`, `masq_excludes` and `uplinks` per
//! attachment and uplink, and the connection tracking state in `masq_flows` / `masq_replies`,
//! which DEL and GC remove per attachment; GC also sweeps expired state, of the port-mapping
//! translations in `nat_flows` too.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use aya::maps::lpm_trie::Key;
use cnibpf_common::{
    FAMILY_IPV4, FAMILY_IPV6,
    masq_exclude::{self, MasqExcludeKey, OWNER_FAMILY_BITS},
    masq_flow::{self, MasqFlow},
    masq_fragment, masq_reply,
    masq_source::{self, MasqSource, MasqSourceKey},
    nat_flow::{self, NatFlowKey},
    uplink::UplinkInfo,
};
use ipnet::IpNet;
use nix::time::{ClockId, clock_gettime};

use super::{EbpfBackend, addr_from_key, batch, key_addr, map_error, read_error, remove_entry};
use crate::{
    backend::{
        BackendError, Endpoint, ExcludeReason, Masquerade, MasqueradeRecord, UplinkAddresses,
        is_link_local,
    },
    netlink::{self, Link},
};

impl EbpfBackend {
    pub(super) fn apply_masquerade(
        &mut self,
        endpoint: &Endpoint,
        masquerade: Option<&Masquerade>,
    ) -> Result<(), BackendError> {
        let owner = endpoint.attachment.owner_id();
        let Some(masquerade) = masquerade else {
            return self.remove_masquerade(owner);
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
        for key in &wanted_sources {
            if self.masq_sources.get(key, 0).ok() != Some(value) {
                self.masq_sources
                    .insert(key, &value, 0)
                    .map_err(map_error("could not write map masq_sources"))?;
            }
        }
        let (current_sources, current_excludes) = self.owned_masquerade(owner)?;
        let mut dropped_sources = false;
        for key in current_sources {
            if !wanted_sources.contains(&key) {
                remove_entry(&mut self.masq_sources, &key, masq_source::MAP_NAME)?;
                dropped_sources = true;
            }
        }
        let wanted_excludes: Vec<(Key<MasqExcludeKey>, u32)> = masquerade
            .excludes
            .iter()
            .map(|(net, reason)| (exclude_key(owner, net), *reason as u32))
            .collect();
        for (key, reason) in &wanted_excludes {
            if self.masq_excludes.get(key, 0).ok() != Some(*reason) {
                self.masq_excludes
                    .insert(key, reason, 0)
                    .map_err(map_error("could not write map masq_excludes"))?;
            }
        }
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
        // Flows of an address the attachment no longer masquerades must not be translated.
        self.remove_masquerade_flows(|flow_key, flow| {
            flow.owner == owner
                && !wanted_sources.iter().any(|source| {
                    source.addr == flow_key.src_addr && source.family == flow_key.family
                })
        })
    }

    pub(super) fn remove_masquerade(&mut self, owner: u64) -> Result<(), BackendError> {
        let (sources, excludes) = self.owned_masquerade(owner)?;
        // Without masquerade entries the attachment has no flows either: skip the scans of the
        // flow tables, which cost a walk over all their buckets even when empty.
        if sources.is_empty() && excludes.is_empty() {
            return Ok(());
        }
        for key in sources {
            remove_entry(&mut self.masq_sources, &key, masq_source::MAP_NAME)?;
        }
        for (key, _) in excludes {
            self.remove_exclude(&key)?;
        }
        // One pass over the table serves this attachment and the sweep of expired state.
        let now = monotonic_now_ns();
        self.remove_masquerade_flows(|key, flow| {
            flow.owner == owner || flow.is_expired(key.protocol, now)
        })?;
        self.masq_flows_swept = true;
        // Reverse entries whose forward entry was evicted are found by their owner.
        let orphans =
            batch::entries(&self.masq_replies).map_err(read_error(masq_reply::MAP_NAME))?;
        for (key, reply) in orphans {
            if reply.owner == owner {
                remove_entry(&mut self.masq_replies, &key, masq_reply::MAP_NAME)?;
            }
        }
        let fragments =
            batch::entries(&self.masq_fragments).map_err(read_error(masq_fragment::MAP_NAME))?;
        for (key, reply) in fragments {
            if reply.owner == owner {
                remove_entry(&mut self.masq_fragments, &key, masq_fragment::MAP_NAME)?;
            }
        }
        Ok(())
    }

    pub(super) fn remove_expired_flows(&mut self) -> Result<(), BackendError> {
        let now = monotonic_now_ns();
        if !self.masq_flows_swept {
            self.remove_masquerade_flows(|key, flow| flow.is_expired(key.protocol, now))?;
            self.masq_flows_swept = true;
        }
        // The port-mapping translations age the same way.
        let translations =
            batch::entries(&self.nat_flows).map_err(read_error(nat_flow::MAP_NAME))?;
        for (key, value) in translations {
            if value.is_expired(key.protocol, now) {
                remove_entry(&mut self.nat_flows, &key, nat_flow::MAP_NAME)?;
            }
        }
        Ok(())
    }

    pub(super) fn verify_masquerade(
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
                    addr_from_key(source.addr, source.family == FAMILY_IPV4)
                )));
            }
            return Ok(());
        };
        for addr in &masquerade.sources {
            let key = source_key(*addr);
            match self.masq_sources.get(&key, 0) {
                Ok(source)
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
            if self.uplinks.get(&uplink.index, 0).is_err() {
                return Err(BackendError::CheckFailed(format!(
                    "uplink {} (index {}) has no masquerade address in map uplinks",
                    uplink.name, uplink.index
                )));
            }
        }
        Ok(())
    }

    /// Records each uplink's first IPv4 and first global IPv6 address (the kernel lists an
    /// interface's primary address first) as the address it masquerades to.
    pub(super) fn write_uplink_addresses(&mut self, uplinks: &[Link]) -> Result<(), BackendError> {
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
                    IpAddr::V6(addr) if info.addr_v6 == [0; 16] => info.addr_v6 = addr.octets(),
                    _ => {}
                }
            }
            if self.uplinks.get(&uplink.index, 0).ok() != Some(info) {
                self.uplinks
                    .insert(&uplink.index, &info, 0)
                    .map_err(map_error("could not write map uplinks"))?;
            }
        }
        Ok(())
    }

    pub(super) fn read_masquerades(&self) -> Result<Vec<(u64, MasqueradeRecord)>, BackendError> {
        let mut records: Vec<(u64, MasqueradeRecord)> = Vec::new();
        let record_of = |records: &mut Vec<(u64, MasqueradeRecord)>, owner: u64| {
            if let Some(position) = records.iter().position(|(held, _)| *held == owner) {
                position
            } else {
                records.push((owner, MasqueradeRecord::default()));
                records.len() - 1
            }
        };
        for entry in self.masq_sources.iter() {
            let (key, source) = entry.map_err(map_error("could not read map masq_sources"))?;
            let position = record_of(&mut records, source.owner);
            records[position]
                .1
                .masquerade
                .sources
                .push(addr_from_key(key.addr, key.family == FAMILY_IPV4));
        }
        for entry in self.masq_excludes.iter() {
            let (key, reason) = entry.map_err(map_error("could not read map masq_excludes"))?;
            let data = key.data();
            let (Some(net), Some(reason)) = (exclude_net(&key), ExcludeReason::from_u32(reason))
            else {
                continue;
            };
            let position = record_of(&mut records, u64::from_be_bytes(data.owner));
            records[position].1.masquerade.excludes.push((net, reason));
        }
        for (_, flow) in
            batch::entries(&self.masq_flows).map_err(read_error(masq_flow::MAP_NAME))?
        {
            let position = record_of(&mut records, flow.owner);
            records[position].1.flows += 1;
        }
        Ok(records)
    }

    pub(super) fn read_uplink_addresses(&self) -> Result<Vec<UplinkAddresses>, BackendError> {
        let mut uplinks = Vec::new();
        for entry in self.uplinks.iter() {
            let (ifindex, info) = entry.map_err(map_error("could not read map uplinks"))?;
            uplinks.push(UplinkAddresses {
                ifindex,
                v4: (info.addr_v4 != [0; 4]).then(|| Ipv4Addr::from(info.addr_v4)),
                v6: (info.addr_v6 != [0; 16]).then(|| Ipv6Addr::from(info.addr_v6)),
            });
        }
        uplinks.sort_by_key(|uplink| uplink.ifindex);
        Ok(uplinks)
    }

    pub(super) fn read_counters(&self) -> Result<Vec<(&'static str, u64)>, BackendError> {
        let per_cpu = self
            .masq_stats
            .get(&0, 0)
            .map_err(map_error("could not read map masq_stats"))?;
        let sum = |field: fn(&cnibpf_common::masq_stats::MasqStats) -> u64| {
            per_cpu.iter().map(field).sum::<u64>()
        };
        let flows = batch::entries(&self.masq_flows)
            .map_err(read_error(masq_flow::MAP_NAME))?
            .len() as u64;
        Ok(vec![
            ("masq_flows entries", flows),
            ("masq_flows capacity", u64::from(masq_flow::MAX_ENTRIES)),
            ("flows created", sum(|stats| stats.flows_created)),
            ("port collisions", sum(|stats| stats.port_collisions)),
            ("ports exhausted", sum(|stats| stats.ports_exhausted)),
            ("state lost (table pressure)", sum(|stats| stats.state_lost)),
            ("expired state met", sum(|stats| stats.expired)),
            ("icmp errors translated", sum(|stats| stats.icmp_errors)),
            ("no uplink address", sum(|stats| stats.no_uplink_address)),
        ])
    }

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
        for entry in self.masq_sources.iter() {
            let (key, source) = entry.map_err(map_error("could not read map masq_sources"))?;
            if source.owner == owner {
                sources.push(key);
            }
        }
        let mut excludes = Vec::new();
        for entry in self.masq_excludes.iter() {
            let (key, reason) = entry.map_err(map_error("could not read map masq_excludes"))?;
            if key.data().owner == owner.to_be_bytes() {
                excludes.push((key, reason));
            }
        }
        Ok((sources, excludes))
    }

    fn remove_exclude(&mut self, key: &Key<MasqExcludeKey>) -> Result<(), BackendError> {
        match self.masq_excludes.remove(key) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(aya::maps::MapError::SyscallError(error))
                if error.io_error.kind() == std::io::ErrorKind::NotFound =>
            {
                Ok(())
            }
            Err(source) => Err(BackendError::Map {
                action: format!("could not delete from map {}", masq_exclude::MAP_NAME),
                source: Box::new(source),
            }),
        }
    }

    /// Removes the flows `stale` selects, both ways.
    fn remove_masquerade_flows(
        &mut self,
        stale: impl Fn(&NatFlowKey, &MasqFlow) -> bool,
    ) -> Result<(), BackendError> {
        let flows = batch::entries(&self.masq_flows).map_err(read_error(masq_flow::MAP_NAME))?;
        for (key, flow) in flows.into_iter().filter(|(key, flow)| stale(key, flow)) {
            let reverse = NatFlowKey {
                src_addr: key.dst_addr,
                dst_addr: flow.nat_addr,
                src_port: key.dst_port,
                dst_port: flow.nat_port,
                protocol: key.protocol,
                family: key.family,
                _pad: [0; 2],
            };
            // Only if it still reverses this flow: the port may have been claimed anew.
            let owned = self.masq_replies.get(&reverse, 0).is_ok_and(|reply| {
                reply.container_addr == key.src_addr && reply.container_port == key.src_port
            });
            if owned {
                remove_entry(&mut self.masq_replies, &reverse, masq_reply::MAP_NAME)?;
            }
            remove_entry(&mut self.masq_flows, &key, masq_flow::MAP_NAME)?;
        }
        Ok(())
    }
}

fn source_key(addr: IpAddr) -> MasqSourceKey {
    MasqSourceKey {
        addr: key_addr(addr),
        family: family_of(addr),
        _pad: [0; 3],
    }
}

fn family_of(addr: IpAddr) -> u8 {
    if addr.is_ipv4() {
        FAMILY_IPV4
    } else {
        FAMILY_IPV6
    }
}

fn exclude_key(owner: u64, net: &IpNet) -> Key<MasqExcludeKey> {
    let net = net.trunc();
    Key::new(
        OWNER_FAMILY_BITS + u32::from(net.prefix_len()),
        MasqExcludeKey {
            owner: owner.to_be_bytes(),
            family: family_of(net.addr()),
            addr: key_addr(net.addr()),
            _pad: [0; 3],
        },
    )
}

fn exclude_net(key: &Key<MasqExcludeKey>) -> Option<IpNet> {
    let data = key.data();
    let prefix = u8::try_from(key.prefix_len().checked_sub(OWNER_FAMILY_BITS)?).ok()?;
    IpNet::new(addr_from_key(data.addr, data.family == FAMILY_IPV4), prefix).ok()
}

/// CLOCK_MONOTONIC, the clock of `bpf_ktime_get_ns`.
pub(super) fn monotonic_now_ns() -> u64 {
    clock_gettime(ClockId::CLOCK_MONOTONIC).map_or(0, |now| {
        u64::try_from(now.tv_sec()).unwrap_or(0) * 1_000_000_000
            + u64::try_from(now.tv_nsec()).unwrap_or(0)
    })
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
