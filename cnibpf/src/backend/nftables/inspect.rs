//! The table read back for `cnibpf inspect`, CHECK and GC: elements by owner comment, rules
//! with their counters.

use std::{collections::BTreeMap, net::IpAddr};

use ipnet::IpNet;

use super::{
    NftablesBackend,
    filter::{filter_chains, rule_from_comment},
    listing::{counter, has_verdict},
    masquerade::exclude_reason,
    parse_owner,
    portmap::mapping_of,
};
use crate::{
    backend::{
        AttachmentRecord, BackendError, FilterRecord, Inspect, MasqueradeRecord, UplinkAddresses,
        is_link_local,
    },
    model::{Direction, Filter, FilterRule, ResolvedMapping, Target},
    netlink,
};

impl Inspect for NftablesBackend {
    fn attachments(&self) -> Result<Vec<AttachmentRecord>, BackendError> {
        Ok(self
            .elements
            .iter()
            .filter(|element| element.set == "attachments")
            .filter_map(|element| {
                let attachment = parse_owner(&element.comment)?;
                let host_ifname = element.key_parts.first()?.clone();
                Some(AttachmentRecord {
                    owner: attachment.owner_id(),
                    host_ifindex: netlink::link_by_name(&host_ifname).map_or(0, |link| link.index),
                    attachment,
                    pod: self.pod_of(&host_ifname),
                    host_ifname,
                })
            })
            .collect())
    }

    fn port_mappings(&self) -> Result<Vec<(u64, ResolvedMapping)>, BackendError> {
        Ok(self
            .elements
            .iter()
            .filter_map(|element| {
                Some((
                    parse_owner(&element.comment)?.owner_id(),
                    mapping_of(element)?,
                ))
            })
            .collect())
    }

    fn masquerades(&self) -> Result<Vec<(u64, MasqueradeRecord)>, BackendError> {
        let mut records: Vec<(u64, MasqueradeRecord)> = Vec::new();
        for element in &self.elements {
            let Some(owner) = parse_owner(&element.comment).map(|a| a.owner_id()) else {
                continue;
            };
            let position = match records.iter().position(|(known, _)| *known == owner) {
                Some(position) => position,
                None => {
                    records.push((owner, MasqueradeRecord::default()));
                    records.len() - 1
                }
            };
            let record = &mut records[position].1.masquerade;
            match element.set.as_str() {
                "masq_sources4" | "masq_sources6" => {
                    if let Some(addr) = element.key_parts.first().and_then(|addr| addr.parse().ok())
                    {
                        record.sources.push(addr);
                    }
                }
                "masq_excludes4" | "masq_excludes6" => {
                    let net = element.key_parts.get(1).and_then(|net| {
                        net.parse::<IpNet>()
                            .ok()
                            .or_else(|| net.parse::<IpAddr>().ok().map(IpNet::from))
                    });
                    if let Some(net) = net
                        && !record.excludes.iter().any(|(known, _)| *known == net)
                    {
                        record
                            .excludes
                            .push((net, exclude_reason(&net, &record.sources)));
                    }
                }
                _ => {}
            }
        }
        records.retain(|(_, record)| !record.masquerade.sources.is_empty());
        Ok(records)
    }

    fn uplink_addresses(&self) -> Result<Vec<UplinkAddresses>, BackendError> {
        let addresses = netlink::addresses().unwrap_or_default();
        Ok(self
            .elements
            .iter()
            .filter(|element| element.set == "uplinks")
            .filter_map(|element| netlink::link_by_name(element.key_parts.first()?).ok())
            .map(|link| UplinkAddresses {
                ifindex: link.index,
                v4: addresses.iter().find_map(|(index, addr)| match addr {
                    IpAddr::V4(addr) if *index == link.index => Some(*addr),
                    _ => None,
                }),
                v6: addresses.iter().find_map(|(index, addr)| match addr {
                    IpAddr::V6(addr)
                        if *index == link.index && !is_link_local(IpAddr::V6(*addr)) =>
                    {
                        Some(*addr)
                    }
                    _ => None,
                }),
            })
            .collect())
    }

    fn filters(&self) -> Result<Vec<(u64, FilterRecord)>, BackendError> {
        let mut records = Vec::new();
        for element in self
            .elements
            .iter()
            .filter(|element| element.set == "attachments")
        {
            let Some(attachment) = parse_owner(&element.comment) else {
                continue;
            };
            let [out_chain, in_chain] = filter_chains(&element.comment);
            // Rules by index, with both chains' counters summed.
            let mut by_index: BTreeMap<u32, (FilterRule, (u64, u64))> = BTreeMap::new();
            let mut default = None;
            let mut default_hits = (0, 0);
            for rule in self
                .rules
                .iter()
                .filter(|rule| rule.chain == out_chain || rule.chain == in_chain)
            {
                let hits = counter(&rule.expr);
                if rule.comment == "default" {
                    default = Some(if has_verdict(&rule.expr, "drop") {
                        Target::Drop
                    } else {
                        Target::Allow
                    });
                    default_hits = (default_hits.0 + hits.0, default_hits.1 + hits.1);
                    continue;
                }
                let Some(index) = rule
                    .comment
                    .split(' ')
                    .next()
                    .and_then(|index| index.parse().ok())
                else {
                    continue;
                };
                let direction = if rule.chain == out_chain {
                    Direction::Egress
                } else {
                    Direction::Ingress
                };
                let Some(parsed) = rule_from_comment(index, &rule.comment, direction) else {
                    continue;
                };
                let entry = by_index.entry(index).or_insert((parsed, (0, 0)));
                if entry.0.direction != direction {
                    entry.0.direction = Direction::Both;
                }
                entry.1 = (entry.1.0 + hits.0, entry.1.1 + hits.1);
            }
            let Some(default) = default else {
                continue;
            };
            let (rules, hits): (Vec<FilterRule>, Vec<(u64, u64)>) = by_index.into_values().unzip();
            records.push((
                attachment.owner_id(),
                FilterRecord {
                    filter: Filter { rules, default },
                    hits,
                    default_hits,
                    flows: 0,
                },
            ));
        }
        Ok(records)
    }

    fn counters(&self) -> Result<Vec<(&'static str, u64)>, BackendError> {
        Ok(Vec::new())
    }
}
