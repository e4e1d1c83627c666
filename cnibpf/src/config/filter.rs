//! The `filter` key: rules validated one by one, then put in index order.

use std::collections::BTreeMap;

use ipnet::IpNet;

use super::{
    ConfigError,
    input::{RuleIndex, RuleInput},
    parse_word,
};
use crate::model::{
    ConnState, Direction, FilterRule, NetworkName, RuleAction, RuleChange, RuleProtocol,
};

/// Most rules one attachment may carry (the datapath evaluates them in a bounded loop).
pub const MAX_FILTER_RULES: usize = cnibpf_common::filter::MAX_RULES;

/// The keys a rule may have (rules deny unknown keys: a typo would silently widen a rule).
pub(crate) const RULE_KEYS: &[&str] = &[
    "index",
    "action",
    "target",
    "src",
    "dst",
    "srcNetwork",
    "dstNetwork",
    "proto",
    "sport",
    "dport",
    "connstate",
    "direction",
    "log",
];

pub(super) fn parse_filter(entries: Vec<RuleInput>) -> Result<Vec<FilterRule>, ConfigError> {
    if entries.len() > MAX_FILTER_RULES {
        return Err(ConfigError::invalid(
            "filter",
            format!(
                "{} rules, at most {MAX_FILTER_RULES} are allowed per attachment",
                entries.len()
            ),
        ));
    }
    let mut by_index: BTreeMap<u32, (usize, FilterRule)> = BTreeMap::new();
    for (position, entry) in entries.into_iter().enumerate() {
        let rule = parse_rule(position, entry)?;
        if let Some((earlier, _)) = by_index.get(&rule.index) {
            return Err(ConfigError::invalid(
                format!("filter[{position}].index"),
                format!("index {} is already used by filter[{earlier}]", rule.index),
            ));
        }
        by_index.insert(rule.index, (position, rule));
    }
    Ok(by_index.into_values().map(|(_, rule)| rule).collect())
}

/// The rule changes `cnibpf filter apply` reads: each rule with its `action`, validated as a
/// configuration's rule is (and named as one is, `filter[<position>]`).
pub(super) fn parse_changes(entries: Vec<RuleInput>) -> Result<Vec<RuleChange>, ConfigError> {
    if entries.is_empty() {
        return Err(ConfigError::invalid("filter", "the list holds no change"));
    }
    entries
        .into_iter()
        .enumerate()
        .map(|(position, entry)| parse_change(position, entry))
        .collect()
}

fn parse_change(position: usize, mut entry: RuleInput) -> Result<RuleChange, ConfigError> {
    let key = |name: &str| format!("filter[{position}].{name}");
    let action = match entry.action.take() {
        None => {
            return Err(ConfigError::invalid(
                key("action"),
                "is required: insert, append or delete",
            ));
        }
        Some(text) => parse_word::<RuleAction>(&key("action"), &text)?,
    };
    match action {
        RuleAction::Insert => Ok(RuleChange::Insert(parse_rule(position, entry)?)),
        RuleAction::Append => {
            let index_given = entry.index.is_some();
            // An index left out is the next free one, given once the attachment's rules are
            // known; the rest is validated now.
            entry.index.get_or_insert(RuleIndex(0));
            let rule = parse_rule(position, entry)?;
            Ok(RuleChange::Append { rule, index_given })
        }
        RuleAction::Delete => {
            let index = entry
                .index
                .ok_or_else(|| ConfigError::invalid(key("index"), "is required"))?
                .0;
            let only_index = RuleInput {
                index: entry.index,
                ..RuleInput::default()
            } == entry;
            let matching = if only_index {
                None
            } else {
                Some(parse_rule(position, entry)?)
            };
            Ok(RuleChange::Delete { index, matching })
        }
    }
}

fn parse_rule(position: usize, rule: RuleInput) -> Result<FilterRule, ConfigError> {
    let prefix = format!("filter[{position}]");
    let key = |name: &str| format!("{prefix}.{name}");
    let index = rule
        .index
        .ok_or_else(|| ConfigError::invalid(key("index"), "is required"))?
        .0;
    if let Some(text) = &rule.action
        && parse_word::<RuleAction>(&key("action"), text)? == RuleAction::Delete
    {
        return Err(ConfigError::invalid(
            key("action"),
            "\"delete\" removes a rule of a running attachment (`cnibpf filter apply`); a configuration's rules are added (insert or append)",
        ));
    }
    let target = match rule.target {
        None => return Err(ConfigError::invalid(key("target"), "is required")),
        Some(text) => parse_word(&key("target"), &text)?,
    };
    let src = rule.src.map(|cidr| cidr.0);
    let dst = rule.dst.map(|cidr| cidr.0);
    let network = |name: &str, text: Option<String>| {
        text.map(|text| {
            NetworkName::new(&text).map_err(|reason| ConfigError::invalid(key(name), reason))
        })
        .transpose()
    };
    let src_network = network("srcNetwork", rule.src_network)?;
    let dst_network = network("dstNetwork", rule.dst_network)?;
    if let (Some(src), Some(dst)) = (src, dst)
        && matches!(src, IpNet::V4(_)) != matches!(dst, IpNet::V4(_))
    {
        return Err(ConfigError::invalid(
            key("dst"),
            format!(
                "{dst} and src {src} are of different address families: the rule could never match"
            ),
        ));
    }
    let protocol = match rule.proto {
        None => RuleProtocol::Any,
        Some(text) => parse_word(&key("proto"), &text)?,
    };
    let family_conflict = match protocol {
        RuleProtocol::Icmp => [src, dst]
            .into_iter()
            .flatten()
            .find(|net| matches!(net, IpNet::V6(_))),
        RuleProtocol::Icmpv6 => [src, dst]
            .into_iter()
            .flatten()
            .find(|net| matches!(net, IpNet::V4(_))),
        _ => None,
    };
    if let Some(net) = family_conflict {
        return Err(ConfigError::invalid(
            key("proto"),
            format!("{protocol} cannot match address {net}"),
        ));
    }
    let sport = rule.sport.map(|range| range.0);
    let dport = rule.dport.map(|range| range.0);
    for (name, range) in [("sport", sport), ("dport", dport)] {
        if range.is_some() && !protocol.has_ports() {
            return Err(ConfigError::invalid(
                key(name),
                "ports need proto tcp, udp or sctp",
            ));
        }
    }
    Ok(FilterRule {
        index,
        target,
        src,
        dst,
        src_network,
        dst_network,
        protocol,
        sport,
        dport,
        connstate: match rule.connstate {
            None => ConnState::Any,
            Some(text) => parse_word(&key("connstate"), &text)?,
        },
        direction: match rule.direction {
            None => Direction::Both,
            Some(text) => parse_word(&key("direction"), &text)?,
        },
        log: rule.log.unwrap_or(false),
    })
}
