//! The table read back from the kernel (`nft -j list`), typed: the whole table for inspect,
//! CHECK and the slow paths (a hostPort held by another, found after the transaction refused
//! it), a migration's reading of an older table, and what its rules had counted (`Counters`,
//! carried into a table or chains made again).

use std::collections::BTreeMap;

use nftables::{
    expr::{Expression, NamedExpression},
    schema::Rule,
};

use super::{
    family_suffix,
    nft::{self, TABLE, address_of, port_of},
    parse_owner,
};
use crate::{
    backend::BackendError,
    model::{Attachment, ResolvedMapping},
};

/// One element of a set or map.
#[derive(Clone, Debug)]
pub struct Listed {
    pub key: Expression<'static>,
    pub value: Option<Expression<'static>>,
    pub comment: Option<String>,
}

/// What `nft -j list` showed: elements by set, rules by chain.
#[derive(Debug, Default)]
pub struct Listing {
    sets: BTreeMap<String, Vec<Listed>>,
    chains: BTreeMap<String, Vec<Rule<'static>>>,
}

impl Listing {
    /// The whole table; `None` when there is none.
    pub fn read() -> Result<Option<Self>, BackendError> {
        Ok(nft::list(&["table", "inet", TABLE])?.map(|listing| Self::from(&listing)))
    }

    /// Table `netdev cnibpf`; `None` when there is none.
    pub fn read_netdev() -> Result<Option<Self>, BackendError> {
        Ok(nft::list(&["table", "netdev", TABLE])?.map(|listing| Self::from(&listing)))
    }

    /// The address-specific hostPort maps only (few elements on any host).
    pub fn read_specific() -> Result<Option<Self>, BackendError> {
        let mut listing = Self::default();
        for map in [
            "hostports4",
            "hostports4_port",
            "hostports6",
            "hostports6_port",
        ] {
            let Some(found) = nft::list(&["map", "inet", TABLE, map])? else {
                return Ok(None);
            };
            listing.sets.extend(Self::from(&found).sets);
        }
        Ok(Some(listing))
    }

    pub(super) fn from(listing: &[nft::Listed]) -> Self {
        let mut out = Self::default();
        for object in listing {
            match object {
                nft::Listed::Set(set) => {
                    out.sets
                        .insert(set.name.clone(), set.elem.iter().map(listed).collect());
                }
                nft::Listed::Chain(name) => {
                    out.chains.entry(name.clone()).or_default();
                }
                nft::Listed::Rule(rule) => {
                    out.chains
                        .entry(rule.chain.to_string())
                        .or_default()
                        .push(rule.clone());
                }
            }
        }
        out
    }

    pub fn elements(&self, set: &str) -> &[Listed] {
        // fail-closed: a set the listing does not hold has no elements.
        self.sets.get(set).map_or(&[], Vec::as_slice)
    }

    /// Every element whose comment is `owner`, with its set.
    pub fn owned_by<'a>(
        &'a self,
        owner: &'a str,
    ) -> impl Iterator<Item = (&'a str, &'a Listed)> + 'a {
        self.sets.iter().flat_map(move |(set, elements)| {
            elements
                .iter()
                .filter(move |element| element.comment.as_deref() == Some(owner))
                .map(move |element| (set.as_str(), element))
        })
    }

    /// Every comment of an element: the owners of a table of any layout.
    pub fn element_comments(&self) -> impl Iterator<Item = &str> {
        self.sets
            .values()
            .flatten()
            .filter_map(|element| element.comment.as_deref())
    }

    pub fn set_names(&self) -> impl Iterator<Item = &str> {
        self.sets.keys().map(String::as_str)
    }

    pub fn chain_names(&self) -> impl Iterator<Item = &str> {
        self.chains.keys().map(String::as_str)
    }

    pub fn has_set(&self, set: &str) -> bool {
        self.sets.contains_key(set)
    }

    pub fn has_chain(&self, chain: &str) -> bool {
        self.chains.contains_key(chain)
    }

    /// The rules of `chain`, in order.
    pub fn rules(&self, chain: &str) -> &[Rule<'static>] {
        // fail-closed: a chain the listing does not hold has no rules.
        self.chains.get(chain).map_or(&[], Vec::as_slice)
    }

    /// Every installed hostPort with the owner text in its comment.
    pub fn mappings(&self) -> Vec<(String, ResolvedMapping)> {
        let mut out = Vec::new();
        for ipv4 in [true, false] {
            for any in [false, true] {
                let set = format!(
                    "hostports{}{}",
                    family_suffix(ipv4),
                    if any { "_any" } else { "" }
                );
                let ports = self.elements(&format!("{set}_port"));
                for element in self.elements(&set) {
                    let port = ports.iter().find(|port| port.key == element.key);
                    if let (Some(owner), Some(mapping)) = (
                        &element.comment,
                        port.and_then(|port| mapping_of(element, port, any)),
                    ) {
                        out.push((owner.clone(), mapping));
                    }
                }
            }
        }
        out
    }

    /// The attachments other than `owner` holding a hostPort that overlaps `mapping`.
    pub fn holders_of(&self, owner: u64, mapping: &ResolvedMapping) -> Vec<(u64, Attachment)> {
        let mut holders = Vec::new();
        for (text, installed) in self.mappings() {
            let Some(holder) = parse_owner(&text) else {
                continue;
            };
            let holder_id = holder.owner_id();
            if holder_id != owner && installed.overlaps(mapping) {
                holders.push((holder_id, holder));
            }
        }
        holders
    }

    /// Whether an attachment other than `owner` holds an address-specific hostPort on the
    /// protocol and port of `mapping` (in its family).
    pub fn specific_held_by_others(&self, owner: u64, mapping: &ResolvedMapping) -> bool {
        self.mappings().iter().any(|(text, installed)| {
            installed.host_addr.is_some()
                && installed.is_ipv4() == mapping.is_ipv4()
                && installed.protocol == mapping.protocol
                && installed.host_port == mapping.host_port
                && parse_owner(text).is_some_and(|holder| holder.owner_id() != owner)
        })
    }
}

/// An element as listed: a key (maybe with a comment), or `[key, value]` for a map.
fn listed(expression: &Expression<'static>) -> Listed {
    let (key, value) = match expression {
        Expression::List(pair) if pair.len() == 2 => (&pair[0], Some(&pair[1])),
        other => (other, None),
    };
    let (key, comment) = match key {
        Expression::Named(NamedExpression::Elem(elem)) => (
            elem.val.as_ref(),
            elem.comment.as_ref().map(ToString::to_string),
        ),
        other => (other, None),
    };
    Listed {
        key: key.clone(),
        value: value.cloned(),
        comment,
    }
}

/// The parts of a concatenation (a single expression is one part).
pub fn parts<'e>(expression: &'e Expression<'static>) -> Vec<&'e Expression<'static>> {
    match expression {
        Expression::Named(NamedExpression::Concat(parts)) => parts.iter().collect(),
        other => vec![other],
    }
}

/// A hostPort's elements back as a mapping: its container address's, and its port's.
fn mapping_of(element: &Listed, port: &Listed, any: bool) -> Option<ResolvedMapping> {
    let key = parts(&element.key);
    let (host_addr, rest) = if any {
        (None, &key[..])
    } else {
        (Some(address_of(key.first()?)?), &key[1..])
    };
    let protocol = match rest.first()? {
        // fail-closed: an element of no known protocol is not a hostPort of ours.
        Expression::String(name) => name.parse().ok()?,
        _ => return None,
    };
    Some(ResolvedMapping {
        protocol,
        host_addr,
        host_port: port_of(rest.get(1)?)?,
        container_addr: address_of(element.value.as_ref()?)?,
        container_port: port_of(port.value.as_ref()?)?,
    })
}

/// What the counted rules of a table had counted, by chain and comment: carried into the
/// table that replaces it.
#[derive(Clone, Debug, Default)]
pub struct Counters(BTreeMap<(String, String), (u64, u64)>);

impl Counters {
    /// The counters of every commented rule `listing` holds.
    pub fn of(listing: &Listing) -> Self {
        let mut counted = BTreeMap::new();
        for chain in listing.chain_names() {
            for rule in listing.rules(chain) {
                let Some(comment) = &rule.comment else {
                    continue;
                };
                if let Some(counter) = nft::counter_of(&rule.expr) {
                    counted.insert((chain.to_owned(), comment.to_string()), counter);
                }
            }
        }
        Self(counted)
    }

    /// What the rule commented `comment` of `chain` had counted.
    pub fn of_rule(&self, chain: &str, comment: &str) -> Option<(u64, u64)> {
        self.0.get(&(chain.to_owned(), comment.to_owned())).copied()
    }

    /// Starts the counter of each rule `commands` add where this says.
    pub fn seed(&self, commands: &mut [serde_json::Value]) {
        if self.0.is_empty() {
            return;
        }
        for command in commands {
            let Some(rule) = command.pointer_mut("/add/rule") else {
                continue;
            };
            let (Some(chain), Some(comment)) = (rule["chain"].as_str(), rule["comment"].as_str())
            else {
                continue;
            };
            let Some(&(packets, bytes)) = self.0.get(&(chain.to_owned(), comment.to_owned()))
            else {
                continue;
            };
            for statement in rule["expr"].as_array_mut().into_iter().flatten() {
                if let Some(counter) = statement.get_mut("counter") {
                    *counter = serde_json::json!({ "packets": packets, "bytes": bytes });
                }
            }
        }
    }
}
