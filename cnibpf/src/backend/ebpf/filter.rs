//! The eBPF backend's filter: one `filters` element per filtered attachment (keyed by its
//! host-side interface), replaced whole so that packets see the old rules or the new ones; its
//! per-rule counters in `filter_hits` and its REJECT answers' budget in `answer_budgets`; the
//! names of the networks its rules name (`networks.rs`); and its part of the attachment's
//! connections (`connections`), which DEL and GC remove. Every attachment's addresses by
//! network (`network_members`, what `srcNetwork` and `dstNetwork` match) are written with its
//! endpoint (`endpoint.rs`).

use std::net::IpAddr;

use aya::maps::{HashMap, MapData, PerCpuArray, PerCpuHashMap, PerCpuValues};
use cnibpf_common::{
    FAMILY_IPV4, FAMILY_IPV6, addr,
    address::Address,
    connections::PART_FILTER,
    filter::{
        self, AnswerBudget, CHANGED_LIVE, CONNSTATE_ESTABLISHED, CONNSTATE_NEW, DIRECTION_EGRESS,
        DIRECTION_INGRESS, FilterHits, FilterRule as StoredRule, FilterSet, FilterStats, MAX_RULES,
        NO_PREFIX, NetworkMember, NetworkMemberKey, NetworkName as StoredName, RULE_LOG,
        TARGET_ALLOW, TARGET_DROP, TARGET_REJECT, hits::DEFAULT_SLOT,
    },
};
use ipnet::IpNet;

use super::{
    EbpfBackend, found, map_error, monotonic_now_ns, on_demand::OnDemand, open_pinned,
    remove_entry, removed,
};
use crate::{
    backend::{BackendError, Endpoint, Filtering},
    model::{
        ConnState, Direction, Filter, FilterRule, NetworkName, PortRange, RuleProtocol, Target,
    },
    paths::PinLayout,
};

/// The maps of the filter: the rule sets, their counters and answer budgets, the networks'
/// names and members, its statistics.
pub(super) struct FilterMaps {
    pub(super) filters: HashMap<MapData, u32, FilterSet>,
    pub(super) filter_hits: OnDemand<PerCpuHashMap<MapData, u32, FilterHits>>,
    pub(super) answer_budgets: OnDemand<PerCpuHashMap<MapData, u32, AnswerBudget>>,
    pub(super) network_names: OnDemand<HashMap<MapData, u64, StoredName>>,
    pub(super) network_members: OnDemand<HashMap<MapData, NetworkMemberKey, NetworkMember>>,
    pub(super) filter_stats: OnDemand<PerCpuArray<MapData, FilterStats>>,
}

impl FilterMaps {
    pub(super) fn open(pins: &PinLayout) -> Result<Self, BackendError> {
        Ok(Self {
            filters: open_pinned(pins, filter::FILTERS.name)?,
            filter_hits: OnDemand::new(pins, filter::HITS.name),
            answer_budgets: OnDemand::new(pins, filter::ANSWER_BUDGETS.name),
            network_names: OnDemand::new(pins, filter::NETWORK_NAMES.name),
            network_members: OnDemand::new(pins, filter::NETWORK_MEMBERS.name),
            filter_stats: OnDemand::new(pins, filter::STATS.name),
        })
    }
}

impl Filtering for EbpfBackend {
    fn setup_filter(
        &mut self,
        endpoint: &Endpoint,
        filter: Option<&Filter>,
    ) -> Result<(), BackendError> {
        let owner = endpoint.attachment.owner_id();
        let ifindex = endpoint.host.index;
        let Some(filter) = filter else {
            return self.remove_filter(owner, ifindex);
        };
        let wanted = stored_set(owner, filter);
        let current = found(self.filter.filters.get(&ifindex, 0), filter::FILTERS.name)?;
        if current
            .is_some_and(|current| current.changed != CHANGED_LIVE && same_rules(&current, &wanted))
            && found(
                self.filter.filter_hits.open()?.get(&ifindex, 0),
                filter::HITS.name,
            )?
            .is_some()
        {
            return Ok(());
        }
        self.expect_filter(ifindex)?;
        self.record_network_names(filter)?;
        // Counters first: a packet judged by the new rules never counts on the old ones'
        // positions (one judged by the old rules meanwhile may count on the new ones').
        self.zero_filter_hits(ifindex)?;
        self.filter
            .filters
            .insert(&ifindex, &wanted, 0)
            .map_err(map_error("could not write map filters"))
    }

    fn teardown_filter(&mut self, owner: u64) -> Result<(), BackendError> {
        match self.endpoint.owner(owner)? {
            Some(info) => self.remove_filter(owner, info.host_ifindex),
            None => Ok(()),
        }
    }

    fn change_filter(&mut self, owner: u64, filter: &Filter) -> Result<(), BackendError> {
        let info = self
            .endpoint
            .owner(owner)?
            .ok_or(BackendError::NotRecorded)?;
        let ifindex = info.host_ifindex;
        let wanted = FilterSet {
            changed: CHANGED_LIVE,
            ..stored_set(owner, filter)
        };
        let current = found(self.filter.filters.get(&ifindex, 0), filter::FILTERS.name)?
            .filter(|current| current.owner == owner);
        self.record_network_names(filter)?;
        let Some(current) = current else {
            // Its first rules: set up as an ADD's filter is (its connections so far are judged
            // as new at their next packet).
            self.expect_filter(ifindex)?;
            self.zero_filter_hits(ifindex)?;
            self.filter
                .filters
                .insert(&ifindex, &wanted, 0)
                .map_err(map_error("could not write map filters"))?;
            // What reaches it through the bridge or the host stack is judged from now on.
            return self.hook_endpoint(owner, ifindex, true);
        };
        let held = found(
            self.filter.filter_hits.open()?.get(&ifindex, 0),
            filter::HITS.name,
        )?;
        // As setup_filter: counters first. What a packet counts between their read and this
        // write is lost (the instant of the change).
        if let Some(held) = held {
            let carried = held
                .iter()
                .map(|hits| carried_hits(&current, &wanted, hits))
                .collect();
            self.write_filter_hits(ifindex, carried)?;
        }
        self.filter
            .filters
            .insert(&ifindex, &wanted, 0)
            .map_err(map_error("could not write map filters"))
    }

    fn check_filter(
        &self,
        endpoint: &Endpoint,
        filter: Option<&Filter>,
    ) -> Result<(), BackendError> {
        let owner = endpoint.attachment.owner_id();
        let current = found(
            self.filter.filters.get(&endpoint.host.index, 0),
            filter::FILTERS.name,
        )?;
        match (filter, current) {
            (None, None) => Ok(()),
            (None, Some(current)) if current.changed != CHANGED_LIVE || current.owner != owner => {
                Err(BackendError::CheckFailed(format!(
                    "{} is filtered, and its configuration has no filter",
                    endpoint.attachment
                )))
            }
            (None, Some(_)) => self.check_filter_hits(endpoint),
            (Some(_), None) => Err(BackendError::CheckFailed(format!(
                "the filter of {} is missing from map filters",
                endpoint.attachment
            ))),
            (Some(filter), Some(current)) => {
                // Rules a live change set are the attachment's: they stand for themselves.
                let configured = current.changed != CHANGED_LIVE;
                if current.owner != owner
                    || (configured && !same_rules(&current, &stored_set(owner, filter)))
                {
                    return Err(BackendError::CheckFailed(format!(
                        "the filter of {} differs from its configuration",
                        endpoint.attachment
                    )));
                }
                self.check_filter_hits(endpoint)
            }
        }
    }
}

impl EbpfBackend {
    fn check_filter_hits(&self, endpoint: &Endpoint) -> Result<(), BackendError> {
        let hits = self.filter.filter_hits.open()?.get(&endpoint.host.index, 0);
        if found(hits, filter::HITS.name)?.is_none() {
            return Err(BackendError::CheckFailed(format!(
                "the rule counters of {} are missing from map filter_hits",
                endpoint.attachment
            )));
        }
        Ok(())
    }

    /// Zeroed counters, and a full answer budget, for the filter of interface `ifindex`.
    fn zero_filter_hits(&mut self, ifindex: u32) -> Result<(), BackendError> {
        let cpus = aya::util::nr_cpus().map_err(|(_, source)| BackendError::MapRead {
            name: filter::HITS.name,
            source,
        })?;
        let budgets = PerCpuValues::try_from(vec![AnswerBudget::default(); cpus.get() as usize])
            .map_err(|source| BackendError::MapRead {
                name: filter::ANSWER_BUDGETS.name,
                source,
            })?;
        self.filter
            .answer_budgets
            .open_mut()?
            .insert(&ifindex, budgets, 0)
            .map_err(map_error("could not write map answer_budgets"))?;
        self.write_filter_hits(ifindex, vec![FilterHits::default(); cpus.get() as usize])
    }

    /// Writes the counters of the filter of interface `ifindex`, one value per CPU.
    fn write_filter_hits(
        &mut self,
        ifindex: u32,
        per_cpu: Vec<FilterHits>,
    ) -> Result<(), BackendError> {
        let values = PerCpuValues::try_from(per_cpu).map_err(|source| BackendError::MapRead {
            name: filter::HITS.name,
            source,
        })?;
        self.filter
            .filter_hits
            .open_mut()?
            .insert(&ifindex, values, 0)
            .map_err(map_error("could not write map filter_hits"))
    }

    /// Whether interface `ifindex` has rules a live change set (which its endpoint record
    /// counts as filtered, whatever its configuration says).
    pub(super) fn filter_changed_live(&self, ifindex: u32) -> Result<bool, BackendError> {
        Ok(
            found(self.filter.filters.get(&ifindex, 0), filter::FILTERS.name)?
                .is_some_and(|set| set.changed == CHANGED_LIVE),
        )
    }

    /// Removes the attachment's filter (if the element on `ifindex` is still its own) and its
    /// connections' state; expired state of others goes in the same pass.
    pub(super) fn remove_filter(&mut self, owner: u64, ifindex: u32) -> Result<(), BackendError> {
        let Some(current) = found(self.filter.filters.get(&ifindex, 0), filter::FILTERS.name)?
        else {
            // Never filtered (or already cleaned up): it tracked no connections either, so
            // the scans of the flow tables are skipped.
            return Ok(());
        };
        if current.owner != owner {
            return Ok(());
        }
        remove_entry(&mut self.filter.filters, &ifindex, filter::FILTERS.name)?;
        removed(
            self.filter.filter_hits.open_mut()?.remove(&ifindex),
            filter::HITS.name,
        )?;
        removed(
            self.filter.answer_budgets.open_mut()?.remove(&ifindex),
            filter::ANSWER_BUDGETS.name,
        )?;
        self.release_connections(|_, connection| {
            if connection.owner == owner {
                PART_FILTER
            } else {
                0
            }
        })
    }
}

/// One CPU's counters of `current`'s rules as `wanted` places them: a rule's by its index, the
/// default's as they were; a new rule starts from zero.
fn carried_hits(current: &FilterSet, wanted: &FilterSet, hits: &FilterHits) -> FilterHits {
    let mut carried = FilterHits::default();
    let held = &current.rules[..(current.rule_count as usize).min(MAX_RULES)];
    let kept = &wanted.rules[..(wanted.rule_count as usize).min(MAX_RULES)];
    for (position, rule) in kept.iter().enumerate() {
        if let Some(before) = held.iter().position(|old| old.index == rule.index) {
            carried.rules[position] = hits.rules[before];
        }
    }
    carried.rules[DEFAULT_SLOT] = hits.rules[DEFAULT_SLOT];
    carried
}

/// Whether two sets hold the same rules and default (their generations aside).
fn same_rules(a: &FilterSet, b: &FilterSet) -> bool {
    let count = (a.rule_count as usize).min(MAX_RULES);
    a.rule_count == b.rule_count
        && a.default_target == b.default_target
        && a.rules[..count] == b.rules[..count]
}

/// The `filters` element of `filter`, with a new generation.
fn stored_set(owner: u64, filter: &Filter) -> FilterSet {
    let mut set = FilterSet {
        owner,
        generation: monotonic_now_ns(),
        rule_count: filter.rules.len().min(MAX_RULES) as u32,
        default_target: target_value(filter.default),
        ..FilterSet::default()
    };
    for (stored, rule) in set.rules.iter_mut().zip(&filter.rules) {
        *stored = stored_rule(rule);
    }
    set
}

fn target_value(target: Target) -> u8 {
    match target {
        Target::Allow => TARGET_ALLOW,
        Target::Drop => TARGET_DROP,
        Target::Reject => TARGET_REJECT,
    }
}

fn target_of(value: u8) -> Target {
    match value {
        TARGET_DROP => Target::Drop,
        TARGET_REJECT => Target::Reject,
        _ => Target::Allow,
    }
}

fn stored_rule(rule: &FilterRule) -> StoredRule {
    let (src_addr, src_mask, src_prefix) = stored_net(rule.src);
    let (dst_addr, dst_mask, dst_prefix) = stored_net(rule.dst);
    let family = match (rule.src.or(rule.dst), rule.protocol) {
        (Some(IpNet::V4(_)), _) | (None, RuleProtocol::Icmp) => FAMILY_IPV4,
        (Some(IpNet::V6(_)), _) | (None, RuleProtocol::Icmpv6) => FAMILY_IPV6,
        (None, _) => 0,
    };
    // fail-closed: an Option of the configuration; no range is every port.
    let ports = |range: Option<PortRange>| range.map_or((0, u16::MAX), |r| (r.low, r.high));
    let (sport_low, sport_high) = ports(rule.sport);
    let (dport_low, dport_high) = ports(rule.dport);
    // fail-closed: an Option of the configuration; no network is id 0, which none has.
    let network = |name: &Option<NetworkName>| name.as_ref().map_or(0, NetworkName::id);
    StoredRule {
        src_addr,
        src_mask,
        dst_addr,
        dst_mask,
        src_network: network(&rule.src_network),
        dst_network: network(&rule.dst_network),
        index: rule.index,
        sport_low,
        sport_high,
        dport_low,
        dport_high,
        family,
        // fail-closed: an Option of the configuration; 0 is any protocol.
        protocol: rule.protocol.number().unwrap_or(0),
        connstate: match rule.connstate {
            ConnState::New => CONNSTATE_NEW,
            ConnState::Established => CONNSTATE_ESTABLISHED,
            ConnState::Any => CONNSTATE_NEW | CONNSTATE_ESTABLISHED,
        },
        direction: match rule.direction {
            Direction::Ingress => DIRECTION_INGRESS,
            Direction::Egress => DIRECTION_EGRESS,
            Direction::Both => DIRECTION_INGRESS | DIRECTION_EGRESS,
        },
        target: target_value(rule.target),
        src_prefix,
        dst_prefix,
        flags: if rule.log { RULE_LOG } else { 0 },
        _pad: 0,
    }
}

/// A rule's network as the datapath matches it: masked address, mask, prefix length.
fn stored_net(net: Option<IpNet>) -> (Address, Address, u8) {
    let Some(net) = net else {
        return (Address::UNSPECIFIED, Address::UNSPECIFIED, NO_PREFIX);
    };
    (
        addr::to_address(net.trunc().addr()),
        addr::to_address(net.netmask()),
        net.prefix_len(),
    )
}

/// The configuration rule a stored one was made from, its networks named by `names`; an
/// error for a network none names.
pub(super) fn config_rule(
    stored: &StoredRule,
    names: &[(u64, NetworkName)],
) -> Result<FilterRule, BackendError> {
    let network = |id: u64| -> Result<Option<NetworkName>, BackendError> {
        if id == 0 {
            return Ok(None);
        }
        names
            .iter()
            .find(|(named, _)| *named == id)
            .map(|(_, name)| Some(name.clone()))
            .ok_or_else(|| {
                BackendError::CheckFailed(format!(
                    "rule {} names network id {id:016x}, which map network_names does not name",
                    stored.index
                ))
            })
    };
    let net = |addr: Address, prefix: u8| {
        (prefix != NO_PREFIX)
            .then(|| {
                let addr: IpAddr = addr::from_address(addr, stored.family);
                // fail-closed: a prefix too long for the family is no network, shown as any.
                IpNet::new(addr, prefix).ok()
            })
            .flatten()
    };
    let ports =
        |low: u16, high: u16| ((low, high) != (0, u16::MAX)).then_some(PortRange { low, high });
    Ok(FilterRule {
        index: stored.index,
        target: target_of(stored.target),
        src: net(stored.src_addr, stored.src_prefix),
        dst: net(stored.dst_addr, stored.dst_prefix),
        src_network: network(stored.src_network)?,
        dst_network: network(stored.dst_network)?,
        protocol: RuleProtocol::from_number((stored.protocol != 0).then_some(stored.protocol))
            // fail-closed: a number of no known protocol is shown as any, for inspect only.
            .unwrap_or(RuleProtocol::Any),
        sport: ports(stored.sport_low, stored.sport_high),
        dport: ports(stored.dport_low, stored.dport_high),
        connstate: match stored.connstate {
            CONNSTATE_NEW => ConnState::New,
            CONNSTATE_ESTABLISHED => ConnState::Established,
            _ => ConnState::Any,
        },
        direction: match stored.direction {
            DIRECTION_INGRESS => Direction::Ingress,
            DIRECTION_EGRESS => Direction::Egress,
            _ => Direction::Both,
        },
        log: stored.flags & RULE_LOG != 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(json: serde_json::Value) -> FilterRule {
        let conf = crate::config::NetConf::parse(
            serde_json::json!({
                "cniVersion": "1.0.0", "name": "n", "type": "cnibpf", "filter": [json]
            })
            .to_string()
            .as_bytes(),
        )
        .unwrap_or_else(|error| panic!("test rule does not parse: {error}"));
        conf.plugin.filter[0].clone()
    }

    #[test]
    fn stored_rules_read_back_as_configured() {
        for json in [
            serde_json::json!({"index": 1, "target": "DROP"}),
            serde_json::json!({"index": 2, "target": "ALLOW", "src": "10.1.2.3/16", "proto": "tcp", "dport": "80-90", "connstate": "new", "direction": "ingress"}),
            serde_json::json!({"index": 3, "target": "ALLOW", "dst": "2001:db8::/32", "proto": "udp", "sport": 53, "connstate": "established", "direction": "egress"}),
            serde_json::json!({"index": 4, "target": "DROP", "proto": "icmpv6"}),
            serde_json::json!({"index": 5, "target": "DROP", "src": "0.0.0.0/0"}),
            serde_json::json!({"index": 6, "target": "REJECT", "srcNetwork": "dmz", "dstNetwork": "protected", "proto": "tcp", "dport": 389, "log": true}),
        ] {
            let configured = rule(json);
            let stored = stored_rule(&configured);
            let mut expected = configured;
            expected.src = expected.src.map(|net| net.trunc());
            let names: Vec<(u64, NetworkName)> = ["dmz", "protected"]
                .into_iter()
                .map(|name| NetworkName::new(name).expect("valid"))
                .map(|name| (name.id(), name))
                .collect();
            assert_eq!(config_rule(&stored, &names).expect("named"), expected);
            if expected.src_network.is_some() {
                assert!(config_rule(&stored, &[]).is_err(), "an unnamed network");
            }
        }
    }

    #[test]
    fn stored_addresses_are_masked_with_their_masks() {
        let stored = stored_rule(&rule(
            serde_json::json!({"index": 1, "target": "DROP", "src": "172.64.9.9/13"}),
        ));
        assert_eq!(stored.src_addr.bytes[..4], [172, 64, 0, 0]);
        assert_eq!(stored.src_mask.bytes[..4], [255, 248, 0, 0]);
        assert_eq!(stored.dst_prefix, NO_PREFIX);
        assert_eq!(stored.family, FAMILY_IPV4);
    }
}
