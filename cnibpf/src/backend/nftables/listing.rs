//! The table read back from the kernel (`nft -j list`), typed: one attachment's record for
//! ADD and DEL; the whole table for inspect, CHECK, GC and the slow paths (a hostPort held by
//! another, found after the transaction refused it).

use std::collections::BTreeMap;

use nftables::{
    expr::{Expression, NamedExpression},
    schema::Rule,
};

use super::{
    NftablesError, family_suffix, host,
    nft::{self, TABLE, address_of, port_of},
    parse_owner,
    record::Record,
    record_chain,
};
use crate::{
    backend::BackendError,
    model::{Attachment, Pod, ResolvedMapping},
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

/// The record of `owner`, read from its chain's rule comments; `None` when it has none.
pub fn record_of(owner: u64) -> Result<Option<Record>, BackendError> {
    let chain = record_chain(owner);
    let Some(comments) = host::rule_comments(&chain)? else {
        return Ok(None);
    };
    Record::parse(comments.iter().map(String::as_str))
        .map(Some)
        .map_err(|source| {
            NftablesError::Record {
                owner: chain.clone(),
                chain,
                source,
            }
            .into()
        })
}

impl Listing {
    /// The whole table; `None` when there is none.
    pub fn read() -> Result<Option<Self>, BackendError> {
        Ok(nft::list(&["table", "inet", TABLE])?.map(|listing| Self::from(&listing)))
    }

    /// The address-specific hostPort maps only (few elements on any host).
    pub fn read_specific() -> Result<Option<Self>, BackendError> {
        let mut listing = Self::default();
        for map in ["hostports4", "hostports6"] {
            let Some(found) = nft::list(&["map", "inet", TABLE, map])? else {
                return Ok(None);
            };
            listing.sets.extend(Self::from(&found).sets);
        }
        Ok(Some(listing))
    }

    fn from(listing: &[nft::Listed]) -> Self {
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

    pub fn chain_names(&self) -> impl Iterator<Item = &str> {
        self.chains.keys().map(String::as_str)
    }

    pub fn has_chain(&self, chain: &str) -> bool {
        self.chains.contains_key(chain)
    }

    /// The rules of `chain`, in order.
    pub fn rules(&self, chain: &str) -> &[Rule<'static>] {
        // fail-closed: a chain the listing does not hold has no rules.
        self.chains.get(chain).map_or(&[], Vec::as_slice)
    }

    /// The record kept in `chain`.
    pub fn record(&self, chain: &str) -> Result<Record, BackendError> {
        let lines = self
            .rules(chain)
            .iter()
            .filter_map(|rule| rule.comment.as_deref());
        Record::parse(lines).map_err(|source| {
            NftablesError::Record {
                owner: chain.to_owned(),
                chain: chain.to_owned(),
                source,
            }
            .into()
        })
    }

    /// Every attachment's record, by owner id.
    pub fn records(&self) -> Result<Vec<(u64, Record)>, BackendError> {
        let mut records = Vec::new();
        for chain in self.chains.keys() {
            let Some(owner) = chain
                .strip_prefix("a_")
                // fail-closed: a chain not named a_<owner> is no record.
                .and_then(|hex| u64::from_str_radix(hex, 16).ok())
            else {
                continue;
            };
            records.push((owner, self.record(chain)?));
        }
        Ok(records)
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
                for element in self.elements(&set) {
                    if let (Some(owner), Some(mapping)) =
                        (&element.comment, mapping_of(element, any))
                    {
                        out.push((owner.clone(), mapping));
                    }
                }
            }
        }
        out
    }

    /// The attachments other than `owner` holding a hostPort that overlaps `mapping`, with
    /// their pods when the listing has their records.
    pub fn holders_of(
        &self,
        owner: u64,
        mapping: &ResolvedMapping,
    ) -> Result<Vec<(u64, Attachment, Option<Pod>)>, BackendError> {
        let mut holders = Vec::new();
        for (text, installed) in self.mappings() {
            let Some(holder) = parse_owner(&text) else {
                continue;
            };
            let holder_id = holder.owner_id();
            if holder_id == owner || !installed.overlaps(mapping) {
                continue;
            }
            let chain = record_chain(holder_id);
            let pod = if self.has_chain(&chain) {
                self.record(&chain)?.pod
            } else {
                None
            };
            holders.push((holder_id, holder, pod));
        }
        Ok(holders)
    }

    /// The first of [`Self::holders_of`].
    pub fn holder_of(
        &self,
        owner: u64,
        mapping: &ResolvedMapping,
    ) -> Result<Option<(u64, Attachment, Option<Pod>)>, BackendError> {
        Ok(self.holders_of(owner, mapping)?.into_iter().next())
    }

    /// Error 100 when another attachment (not one of `leaving`) holds a hostPort overlapping
    /// `mapping`.
    pub fn overlap_error(
        &self,
        owner: u64,
        mapping: &ResolvedMapping,
        leaving: &[u64],
    ) -> Result<Option<BackendError>, BackendError> {
        Ok(self
            .holders_of(owner, mapping)?
            .into_iter()
            .find(|(holder, _, _)| !leaving.contains(holder))
            .map(|(_, holder, pod)| BackendError::HostPortInUse {
                mapping: mapping.host_side(),
                holder: Box::new(holder),
                pod,
            }))
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

/// A hostPort element back as a mapping.
fn mapping_of(element: &Listed, any: bool) -> Option<ResolvedMapping> {
    let key = parts(&element.key);
    let value = parts(element.value.as_ref()?);
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
        container_addr: address_of(value.first()?)?,
        container_port: port_of(value.get(1)?)?,
    })
}
