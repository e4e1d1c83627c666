//! What the eBPF backend holds, read back for `cnibpf inspect`, CHECK and GC: every map read
//! whole, nothing written.

use std::net::{Ipv4Addr, Ipv6Addr};

use aya::maps::{Array, HashMap, IterableMap, MapData, PerCpuArray, PerCpuHashMap};
use cnibpf_common::{
    addr,
    connections::{self, FirstFragment, FragmentKey, PART_FILTER, PART_SNAT},
    drops::{self, DropCount, DropEventBudget, DropReason},
    filter::{
        self, AnswerBudget, FilterStats, MAX_RULES, MatchEventBudget, RuleHits, TARGET_DROP,
        hits::DEFAULT_SLOT,
    },
    masquerade,
};

use super::{
    EbpfBackend, batch,
    filter::config_rule,
    found, map_error,
    masquerade::exclude_net,
    namespace::{self, uplink_of_link},
    open_pinned,
    owner::{attachment_of, pod_of, read_name},
    portmap::mapping_from_entry,
    read_error,
};
use crate::{
    backend::{
        AttachmentRecord, BackendError, FilterRecord, FlowTable, Inspect, MATCH_EVENTS_SUPPRESSED,
        MasqueradeRecord, NetworkMembers, REJECT_ANSWERS_SENT, REJECT_ANSWERS_SUPPRESSED,
        SourceCheckRecord, UplinkAddresses,
    },
    model::{ExcludeReason, Filter, ResolvedMapping, Target},
};

impl Inspect for EbpfBackend {
    fn attachments(&self) -> Result<Vec<AttachmentRecord>, BackendError> {
        let mut records = Vec::new();
        for entry in self.endpoint.owners.iter() {
            let (owner, info) = entry.map_err(map_error("could not read map owners"))?;
            records.push(AttachmentRecord {
                owner,
                attachment: attachment_of(&info),
                pod: pod_of(&info),
                host_ifname: read_name(&info.host_ifname),
                host_ifindex: info.host_ifindex,
            });
        }
        Ok(records)
    }

    fn holds(&self, owner: u64) -> Result<bool, BackendError> {
        Ok(self.endpoint.owner(owner)?.is_some())
    }

    fn port_mappings(&self) -> Result<Vec<(u64, ResolvedMapping)>, BackendError> {
        let mut mappings = Vec::new();
        for entry in self.port_mapping.portmap.iter() {
            let (key, value) = entry.map_err(map_error("could not read map portmap"))?;
            if let Some(mapping) = mapping_from_entry(&key, &value) {
                mappings.push((value.owner, mapping));
            }
        }
        Ok(mappings)
    }

    fn masquerades(&self) -> Result<Vec<(u64, MasqueradeRecord)>, BackendError> {
        let mut records: Vec<(u64, MasqueradeRecord)> = Vec::new();
        let record_of = |records: &mut Vec<(u64, MasqueradeRecord)>, owner: u64| {
            if let Some(position) = records.iter().position(|(held, _)| *held == owner) {
                position
            } else {
                records.push((owner, MasqueradeRecord::default()));
                records.len() - 1
            }
        };
        for entry in self.masquerade.masq_sources.iter() {
            let (key, source) = entry.map_err(map_error("could not read map masq_sources"))?;
            let position = record_of(&mut records, source.owner);
            records[position]
                .1
                .masquerade
                .sources
                .push(addr::from_address(key.addr, key.family));
        }
        for entry in self.masquerade.masq_excludes.iter() {
            let (key, reason) = entry.map_err(map_error("could not read map masq_excludes"))?;
            let data = key.data();
            let (Some(net), Some(reason)) = (exclude_net(&key), ExcludeReason::from_u32(reason))
            else {
                continue;
            };
            let position = record_of(&mut records, u64::from_be_bytes(data.owner));
            records[position].1.masquerade.excludes.push((net, reason));
        }
        for (_, connection) in batch::entries(self.connections.connections.open()?)
            .map_err(read_error(connections::CONNECTIONS.name))?
        {
            if connection.parts & PART_SNAT != 0 {
                let position = record_of(&mut records, connection.owner);
                records[position].1.flows += 1;
            }
        }
        Ok(records)
    }

    fn network_members(&self) -> Result<Vec<NetworkMembers>, BackendError> {
        let attachments = self.attachments()?;
        let mut networks: Vec<NetworkMembers> = Vec::new();
        for (_, addr, owner) in self.network_members_by_id()? {
            // fail-closed: a member whose owner has no record (its DEL went half way) is shown
            // under the owner id alone.
            let network = attachments
                .iter()
                .find(|record| record.owner == owner)
                .map_or_else(
                    || format!("(owner {owner:016x})"),
                    |record| record.attachment.network.clone(),
                );
            match networks.iter_mut().find(|held| held.network == network) {
                Some(held) => held.members.push((addr, owner)),
                None => networks.push(NetworkMembers {
                    network,
                    members: vec![(addr, owner)],
                }),
            }
        }
        for network in &mut networks {
            network.members.sort();
        }
        networks.sort_by(|a, b| a.network.cmp(&b.network));
        Ok(networks)
    }

    /// Each uplink named by the links that hook it (the caller's namespace may not be the
    /// datapath's); one they no longer attach is unnamed.
    fn uplink_addresses(&self) -> Result<Vec<UplinkAddresses>, BackendError> {
        let hooked = namespace::hooked_links(&self.pins)?;
        let name_of = |ifindex: u32| {
            hooked.iter().find_map(|(link, index)| {
                (*index == ifindex).then(|| uplink_of_link(link)).flatten()
            })
        };
        let mut uplinks = Vec::new();
        for entry in self.masquerade.uplinks.iter() {
            let (ifindex, info) = entry.map_err(map_error("could not read map uplinks"))?;
            uplinks.push(UplinkAddresses {
                ifindex,
                ifname: name_of(ifindex),
                v4: (info.addr_v4 != [0; 4]).then(|| Ipv4Addr::from(info.addr_v4)),
                v6: (!info.addr_v6.is_unspecified()).then(|| Ipv6Addr::from(info.addr_v6.bytes)),
            });
        }
        uplinks.sort_by_key(|uplink| uplink.ifindex);
        Ok(uplinks)
    }

    fn source_checks(&self) -> Result<Vec<(u64, SourceCheckRecord)>, BackendError> {
        self.source_check_records()
    }

    fn filters(&self) -> Result<Vec<(u64, FilterRecord)>, BackendError> {
        let mut records = Vec::new();
        // Read once a rule names a network (state of builds before networks has no such map).
        let mut names = Vec::new();
        for entry in self.filter.filters.iter() {
            let (ifindex, set) = entry.map_err(map_error("could not read map filters"))?;
            let rule_count = (set.rule_count as usize).min(MAX_RULES);
            let names_networks = set.rules[..rule_count]
                .iter()
                .any(|rule| rule.src_network != 0 || rule.dst_network != 0);
            if names_networks && names.is_empty() {
                names = self.network_names()?;
            }
            let hits = found(
                self.filter.filter_hits.open()?.get(&ifindex, 0),
                filter::HITS.name,
            )?;
            let summed = |slot: usize| {
                hits.iter().flat_map(|per_cpu| per_cpu.iter()).fold(
                    (0, 0),
                    |(packets, bytes), hits| {
                        let RuleHits {
                            packets: more_packets,
                            bytes: more_bytes,
                        } = hits.rules[slot];
                        (packets + more_packets, bytes + more_bytes)
                    },
                )
            };
            records.push((
                set.owner,
                FilterRecord {
                    filter: Filter {
                        rules: set.rules[..rule_count]
                            .iter()
                            .map(|rule| config_rule(rule, &names))
                            .collect::<Result<_, _>>()?,
                        default: if set.default_target == TARGET_DROP {
                            Target::Drop
                        } else {
                            Target::Allow
                        },
                    },
                    hits: (0..rule_count).map(summed).collect(),
                    default_hits: summed(DEFAULT_SLOT),
                    flows: 0,
                },
            ));
        }
        if records.is_empty() {
            return Ok(records);
        }
        let connections = batch::entries(self.connections.connections.open()?)
            .map_err(read_error(connections::CONNECTIONS.name))?;
        for (_, connection) in connections {
            if connection.parts & PART_FILTER == 0 {
                continue;
            }
            if let Some((_, record)) = records
                .iter_mut()
                .find(|(owner, _)| *owner == connection.owner)
            {
                record.flows += 1;
            }
        }
        Ok(records)
    }

    fn counters(&self) -> Result<Vec<(&'static str, u64)>, BackendError> {
        let mut counters = self.masquerade_counters()?;
        counters.extend(self.filter_counters()?);
        Ok(counters)
    }

    fn drops(&self) -> Result<Option<Vec<(DropReason, DropCount)>>, BackendError> {
        let Some(stats) =
            self.optional_map::<PerCpuArray<MapData, DropCount>>(drops::DROP_STATS.name)?
        else {
            return Ok(None);
        };
        let mut drops = Vec::new();
        for reason in DropReason::ALL {
            if reason == DropReason::LocalnetGuard {
                continue;
            }
            let per_cpu = stats
                .get(&reason.key(), 0)
                .map_err(map_error("could not read map drop_stats"))?;
            let summed = per_cpu
                .iter()
                .fold(DropCount::default(), |sum, count| DropCount {
                    packets: sum.packets + count.packets,
                    bytes: sum.bytes + count.bytes,
                });
            drops.push((reason, summed));
        }
        Ok(Some(drops))
    }

    fn flow_tables(&self) -> Result<Vec<FlowTable>, BackendError> {
        // No capability owns the datagrams in flight: only read here.
        let fragments: HashMap<MapData, FragmentKey, FirstFragment> =
            open_pinned(&self.pins, connections::FRAGMENTS.name)?;
        Ok(vec![
            fill(
                connections::CONNECTIONS.name,
                self.connections.connections.open()?,
            )?,
            fill(
                masquerade::REPLIES.name,
                self.masquerade.masq_replies.open()?,
            )?,
            fill(connections::FRAGMENTS.name, &fragments)?,
        ])
    }
}

/// How full the hash map `name` is: its entries, read whole, against the size the kernel
/// made it with.
fn fill<K, V, M>(name: &'static str, map: &M) -> Result<FlowTable, BackendError>
where
    K: aya::Pod + Default,
    V: aya::Pod + Default,
    M: IterableMap<K, V>,
{
    let entries = batch::entries(map).map_err(read_error(name))?.len();
    let capacity = map
        .map()
        .info()
        .map_err(map_error("could not read the size of a flow table"))?
        .max_entries();
    Ok(FlowTable {
        name,
        entries: entries as u64,
        capacity: u64::from(capacity),
    })
}

impl EbpfBackend {
    fn masquerade_counters(&self) -> Result<Vec<(&'static str, u64)>, BackendError> {
        let per_cpu = self
            .masquerade
            .masq_stats
            .open()?
            .get(&0, 0)
            .map_err(map_error("could not read map masq_stats"))?;
        let sum = |field: fn(&masquerade::MasqStats) -> u64| per_cpu.iter().map(field).sum::<u64>();
        let mut counters = vec![
            ("flows created", sum(|stats| stats.flows_created)),
            ("port collisions", sum(|stats| stats.port_collisions)),
            ("ports exhausted", sum(|stats| stats.ports_exhausted)),
            ("state lost (table pressure)", sum(|stats| stats.state_lost)),
            ("expired state met", sum(|stats| stats.expired)),
            ("icmp errors translated", sum(|stats| stats.icmp_errors)),
            ("no uplink address", sum(|stats| stats.no_uplink_address)),
        ];
        if let Some(clashes) = self.optional_map::<Array<MapData, masquerade::HostClashes>>(
            masquerade::HOST_CLASHES.name,
        )? {
            let clashes = clashes
                .get(&0, 0)
                .map_err(map_error("could not read map masq_host_clashes"))?;
            counters.push((crate::backend::HOST_FLOWS_MOVED, clashes.moved));
        }
        Ok(counters)
    }

    fn filter_counters(&self) -> Result<Vec<(&'static str, u64)>, BackendError> {
        let per_cpu = self
            .filter
            .filter_stats
            .open()?
            .get(&0, 0)
            .map_err(map_error("could not read map filter_stats"))?;
        let sum = |field: fn(&FilterStats) -> u64| per_cpu.iter().map(field).sum::<u64>();
        let mut counters = vec![
            (
                "filter connections created",
                sum(|stats| stats.flows_created),
            ),
            (
                "drop events lost (ring full)",
                sum(|stats| stats.events_lost),
            ),
        ];
        if let Some(budget) =
            self.optional_map::<PerCpuArray<MapData, DropEventBudget>>(drops::EVENT_BUDGET.name)?
        {
            let per_cpu = budget
                .get(&0, 0)
                .map_err(map_error("could not read map drop_event_budget"))?;
            counters.push((
                "drop events suppressed (rate limit)",
                per_cpu.iter().map(|budget| budget.suppressed).sum(),
            ));
        }
        if let Some(budget) = self.optional_map::<PerCpuArray<MapData, MatchEventBudget>>(
            filter::MATCH_EVENT_BUDGET.name,
        )? {
            let per_cpu = budget
                .get(&0, 0)
                .map_err(map_error("could not read map match_event_budget"))?;
            counters.push((
                MATCH_EVENTS_SUPPRESSED,
                per_cpu.iter().map(|budget| budget.suppressed).sum(),
            ));
        }
        if let Some(budgets) = self.optional_map::<PerCpuHashMap<MapData, u32, AnswerBudget>>(
            filter::ANSWER_BUDGETS.name,
        )? {
            let (mut sent, mut suppressed) = (0, 0);
            for entry in budgets.iter() {
                let (_, per_cpu) = entry.map_err(map_error("could not read map answer_budgets"))?;
                sent += per_cpu.iter().map(|budget| budget.sent).sum::<u64>();
                suppressed += per_cpu.iter().map(|budget| budget.suppressed).sum::<u64>();
            }
            counters.push((REJECT_ANSWERS_SENT, sent));
            counters.push((REJECT_ANSWERS_SUPPRESSED, suppressed));
        }
        Ok(counters)
    }
}
