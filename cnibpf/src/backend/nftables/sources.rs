//! The source check: one chain per checked attachment, `s_<owner>` in table `netdev cnibpf`,
//! hooked on the ingress of its host-side interface — where every frame the container sends
//! passes, bridged to a neighbour or routed, ARP included, which no `inet` hook sees. Its rules
//! drop (and count) an IPv4 or IPv6 source, an ARP sender address or a neighbour
//! advertisement's target that is not the container's, and any frame that is neither IP nor
//! ARP. The table (which holds the masquerade guard too, `super::guard`) lives as long as
//! table `inet cnibpf`; the records say which attachment has a chain there.

use std::{
    borrow::Cow,
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use nftables::{
    batch::Batch,
    expr::{Expression, MetaKey, NamedExpression, Payload, PayloadBase, PayloadRaw, SetItem},
    schema::{Chain, FlushObject, NfCmd, NfListObject, Rule, Table},
    stmt::{AnonymousCounter, Counter, Operator, Statement},
    types::{NfChainPolicy, NfChainType, NfFamily, NfHook},
};

use cnibpf_common::drops::DropReason;

use super::{NftablesBackend, host, nft, parse_owner, record::Sources};
use crate::{
    backend::{BackendError, Endpoint, SourceCheckRecord, SourceChecking, fits_a_source_check},
    model::SourceCheck,
};

/// The table of the source checks is named as the `inet` one, in family `netdev`.
const TABLE: &str = nft::TABLE;
const FAMILY: NfFamily = nft::NETDEV;
/// The start of the name of a source check's chain.
const CHAIN_PREFIX: &str = "s_";
/// Before anything else on the interface's netfilter ingress.
const PRIORITY: i32 = -500;

pub fn chain_name(owner: u64) -> String {
    format!("{CHAIN_PREFIX}{owner:016x}")
}

impl SourceChecking for NftablesBackend {
    fn setup_source_check(
        &mut self,
        endpoint: &Endpoint,
        check: Option<&SourceCheck>,
    ) -> Result<(), BackendError> {
        let owner = endpoint.attachment.owner_id();
        // A container with no other interface has no sibling to look for.
        let siblings = if endpoint.may_have_siblings {
            self.siblings(&endpoint.attachment.container_id, owner)?
        } else {
            Vec::new()
        };
        let sibling_owns: Vec<SourceCheck> =
            siblings.iter().map(|sibling| sibling.own.clone()).collect();
        let admitted = check.map(|check| check.admitting(&sibling_owns));
        if let Some(admitted) = &admitted {
            fits_a_source_check(&endpoint.attachment.container_id, admitted)?;
        }
        let change = self.attach(endpoint)?;
        if let Some(after) = change.after.as_mut() {
            after.sources =
                // fail-closed: an Option of the configuration.
                check.map_or(Sources::Unchecked, |check| Sources::Checked(check.clone()));
        }
        change.admitted = admitted;
        self.rewrite_siblings(siblings, check);
        Ok(())
    }

    fn teardown_source_check(&mut self, owner: u64) -> Result<(), BackendError> {
        let change = self.change(owner);
        let container_id = change
            .before
            .as_ref()
            .and_then(|record| parse_owner(&record.owner))
            .map(|attachment| attachment.container_id);
        if let Some(after) = change.after.as_mut() {
            after.sources = Sources::Unrecorded;
        }
        change.admitted = None;
        if let Some(container_id) = container_id {
            let siblings = self.siblings(&container_id, owner)?;
            self.rewrite_siblings(siblings, None);
        }
        Ok(())
    }

    fn check_source_check(
        &self,
        endpoint: &Endpoint,
        check: Option<&SourceCheck>,
    ) -> Result<(), BackendError> {
        let owner = endpoint.attachment.owner_id();
        let recorded = self
            .store
            .record(owner)
            .map(|record| record.sources.clone())
            // fail-closed: an attachment without a record has none of its sources recorded.
            .unwrap_or_default();
        let matching = match (&recorded, check) {
            // Made by a cnibpf without source checks: checked from its next ADD.
            (Sources::Unrecorded, _) | (Sources::Unchecked, None) => true,
            (Sources::Checked(held), Some(wanted)) => held == wanted,
            _ => false,
        };
        if !matching {
            let described = |sources: &Sources| match sources {
                Sources::Checked(held) => held.to_string(),
                _ => "not checked".to_owned(),
            };
            return Err(BackendError::CheckFailed(format!(
                "the addresses {} may send from are {}, its configuration says {}",
                endpoint.attachment,
                described(&recorded),
                // fail-closed: an Option of the configuration, for the message.
                check.map_or_else(|| "not checked".to_owned(), ToString::to_string)
            )));
        }
        if matches!(recorded, Sources::Checked(_)) && !host::has_netdev_chain(&chain_name(owner))? {
            return Err(BackendError::CheckFailed(format!(
                "the source check of {} is missing from table netdev {TABLE}",
                endpoint.attachment
            )));
        }
        Ok(())
    }
}

/// A checked attachment of the same container: its owner, host interface and own addresses.
struct Sibling {
    owner: u64,
    host: String,
    own: SourceCheck,
}

impl NftablesBackend {
    /// The checked attachments of container `container_id` other than `owner`, as their
    /// records say (those this operation removes aside).
    fn siblings(&self, container_id: &str, owner: u64) -> Result<Vec<Sibling>, BackendError> {
        let mut siblings = Vec::new();
        for (sibling, record) in self.store.records() {
            let Some(attachment) = parse_owner(&record.owner) else {
                continue;
            };
            let leaving = self
                .changes
                .get(&sibling)
                .is_some_and(|change| change.after.is_none());
            if sibling == owner || attachment.container_id != container_id || leaving {
                continue;
            }
            if let Sources::Checked(own) = &record.sources {
                siblings.push(Sibling {
                    owner: sibling,
                    host: record.host.clone(),
                    own: own.clone(),
                });
            }
        }
        Ok(siblings)
    }

    /// Has each sibling's chain rewritten to admit its own addresses and the others': those of
    /// `siblings` and `joining` (the attachment set up now; `None` when it leaves or is not
    /// checked).
    fn rewrite_siblings(&mut self, siblings: Vec<Sibling>, joining: Option<&SourceCheck>) {
        let owns: Vec<SourceCheck> = siblings.iter().map(|sibling| sibling.own.clone()).collect();
        let admitting = SourceCheck::each_admitting(&owns, joining);
        for (sibling, admitted) in siblings.into_iter().zip(admitting) {
            self.sibling_sources
                .insert(sibling.owner, (sibling.host, admitted));
        }
    }

    pub(super) fn source_check_records(
        &self,
    ) -> Result<Vec<(u64, SourceCheckRecord)>, BackendError> {
        let records: Vec<(u64, SourceCheck)> = self
            .store
            .records()
            .filter_map(|(owner, record)| match &record.sources {
                Sources::Checked(check) => Some((owner, check.clone())),
                _ => None,
            })
            .collect();
        if records.is_empty() {
            return Ok(Vec::new());
        }
        let dropped = dropped_by_chain()?;
        Ok(records
            .into_iter()
            .map(|(owner, check)| {
                // fail-closed: a chain without a counted rule dropped nothing.
                let dropped = dropped.get(&chain_name(owner)).copied().unwrap_or_default();
                (owner, SourceCheckRecord { check, dropped })
            })
            .collect())
    }
}

/// Adds chain `s_<owner>` on `host`'s ingress with the rules of `check`, replacing what it
/// held (the table is created with the first).
pub fn add_chain(batch: &mut Batch<'static>, owner: u64, host: &str, check: &SourceCheck) {
    let name = chain_name(owner);
    batch.add(NfListObject::Table(table()));
    batch.add(NfListObject::Chain(Chain {
        _type: Some(NfChainType::Filter),
        hook: Some(NfHook::Ingress),
        prio: Some(PRIORITY),
        dev: Some(Cow::Owned(host.to_owned())),
        policy: Some(NfChainPolicy::Accept),
        ..chain(&name)
    }));
    batch.add_cmd(NfCmd::Flush(FlushObject::Chain(chain(&name))));
    for statements in rules(check) {
        batch.add(NfListObject::Rule(Rule {
            family: FAMILY,
            table: TABLE.into(),
            chain: Cow::Owned(name.clone()),
            expr: Cow::Owned(statements),
            ..Rule::default()
        }));
    }
}

pub fn delete_chain(batch: &mut Batch<'static>, owner: u64) {
    batch.delete(NfListObject::Chain(chain(&chain_name(owner))));
}

pub fn delete_table(batch: &mut Batch<'static>) {
    batch.delete(NfListObject::Table(table()));
}

fn table() -> Table<'static> {
    Table {
        family: FAMILY,
        name: TABLE.into(),
        handle: None,
    }
}

fn chain(name: &str) -> Chain<'static> {
    Chain {
        family: FAMILY,
        table: TABLE.into(),
        name: Cow::Owned(name.to_owned()),
        ..Chain::default()
    }
}

/// The chain's rules: IPv4 from an own address let on, then each a match of what is not the
/// container's, counted and dropped.
fn rules(check: &SourceCheck) -> Vec<Vec<Statement<'static>>> {
    let ipv4: Vec<Ipv4Addr> = check
        .addresses
        .iter()
        .filter_map(|address| match address {
            IpAddr::V4(v4) => Some(*v4),
            IpAddr::V6(_) => None,
        })
        .collect();
    let ipv6: Vec<Ipv6Addr> = check
        .addresses
        .iter()
        .filter_map(|address| match address {
            IpAddr::V6(v6) => Some(*v6),
            IpAddr::V4(_) => None,
        })
        .collect();
    let mut rules = vec![
        ipv4_source(&ipv4),
        ipv6_source(&ipv6),
        advertised_target(&ipv6),
        arp_sender(&ipv4),
        // Anything else carries no address of the container's (a VLAN tag would hide one).
        vec![not_in(
            nft::meta(MetaKey::Protocol),
            ["ip", "ip6", "arp"].map(str::to_owned).to_vec(),
        )],
    ];
    for rule in &mut rules {
        rule.push(Statement::Counter(Counter::Anonymous(Some(
            AnonymousCounter::default(),
        ))));
        rule.push(Statement::Drop(None));
    }
    if !ipv4.is_empty() {
        // Nearly every packet is IPv4 from an own address, which no later rule drops: it is
        // let on at the first rule rather than walk the other four.
        rules.insert(
            0,
            vec![
                protocol("ip"),
                membership(nft::payload("ip", "saddr"), Operator::EQ, words(&ipv4)),
                Statement::Accept(None),
            ],
        );
    }
    rules
}

/// IPv4: the source; a container without IPv4 addresses sends no IPv4.
fn ipv4_source(ipv4: &[Ipv4Addr]) -> Vec<Statement<'static>> {
    let mut rule = vec![protocol("ip")];
    if !ipv4.is_empty() {
        rule.push(not_in(nft::payload("ip", "saddr"), words(ipv4)));
    }
    rule
}

/// IPv6: the source, or the unspecified address (duplicate address detection, MLD).
fn ipv6_source(ipv6: &[Ipv6Addr]) -> Vec<Statement<'static>> {
    vec![
        protocol("ip6"),
        not_in(
            nft::payload("ip6", "saddr"),
            unspecified_or("::", words(ipv6)),
        ),
    ]
}

/// A neighbour advertisement's target: nft 1.0.6 names no such field, so it is read raw (64
/// bits into the ICMPv6 header, 128 long) and compared as a number.
fn advertised_target(ipv6: &[Ipv6Addr]) -> Vec<Statement<'static>> {
    let mut rule = vec![
        protocol("ip6"),
        nft::matches(
            nft::meta(MetaKey::L4proto),
            Operator::EQ,
            nft::text("ipv6-icmp"),
        ),
        nft::matches(
            nft::payload("icmpv6", "type"),
            Operator::EQ,
            nft::text("nd-neighbor-advert"),
        ),
    ];
    if !ipv6.is_empty() {
        let numbers = ipv6
            .iter()
            .map(|address| format!("0x{:032x}", u128::from(*address)))
            .collect();
        rule.push(not_in(
            Expression::Named(NamedExpression::Payload(Payload::PayloadRaw(PayloadRaw {
                base: PayloadBase::TH,
                offset: 64,
                len: 128,
            }))),
            numbers,
        ));
    }
    rule
}

/// ARP: the sender address, or none (a probe).
fn arp_sender(ipv4: &[Ipv4Addr]) -> Vec<Statement<'static>> {
    vec![
        protocol("arp"),
        not_in(
            nft::payload("arp", "saddr ip"),
            unspecified_or("0.0.0.0", words(ipv4)),
        ),
    ]
}

fn protocol(name: &'static str) -> Statement<'static> {
    nft::matches(nft::meta(MetaKey::Protocol), Operator::EQ, nft::text(name))
}

/// `field` is none of `words`.
fn not_in(field: Expression<'static>, words: Vec<String>) -> Statement<'static> {
    membership(field, Operator::NEQ, words)
}

/// `field` is (`EQ`) or is not (`NEQ`) one of `words`.
fn membership(field: Expression<'static>, op: Operator, words: Vec<String>) -> Statement<'static> {
    nft::matches(
        field,
        op,
        Expression::Named(NamedExpression::Set(
            words
                .into_iter()
                .map(|word| SetItem::Element(nft::text(word)))
                .collect(),
        )),
    )
}

/// The unspecified address of a family, then the container's own.
fn unspecified_or(unspecified: &str, own: Vec<String>) -> Vec<String> {
    let mut words = vec![unspecified.to_owned()];
    words.extend(own);
    words
}

fn words(addresses: &[impl ToString]) -> Vec<String> {
    addresses.iter().map(ToString::to_string).collect()
}

/// (packets, bytes) each chain of the table dropped, by chain name.
fn dropped_by_chain() -> Result<BTreeMap<String, (u64, u64)>, BackendError> {
    let mut dropped = BTreeMap::new();
    for (chain, _, (packets, bytes)) in counted_rules()? {
        let total: &mut (u64, u64) = dropped.entry(chain).or_default();
        total.0 += packets;
        total.1 += bytes;
    }
    Ok(dropped)
}

/// (packets, bytes) the table dropped, by reason.
pub fn dropped_by_reason() -> Result<BTreeMap<DropReason, (u64, u64)>, BackendError> {
    let mut dropped = BTreeMap::new();
    for (_, reason, (packets, bytes)) in counted_rules()? {
        let total: &mut (u64, u64) = dropped.entry(reason).or_default();
        total.0 += packets;
        total.1 += bytes;
    }
    Ok(dropped)
}

/// A counted rule of the table: its chain, what it drops and its (packets, bytes).
type CountedRule = (String, DropReason, (u64, u64));

/// Every counted rule of the table's source checks.
fn counted_rules() -> Result<Vec<CountedRule>, BackendError> {
    let mut counted = Vec::new();
    // fail-closed: `list` kept the errors; no table counted nothing.
    let listed = nft::list(&["table", "netdev", TABLE])?.unwrap_or_default();
    for object in listed {
        if let nft::Listed::Rule(rule) = object
            && rule.chain.starts_with(CHAIN_PREFIX)
            && let Some(counter) = nft::counter_of(&rule.expr)
        {
            counted.push((rule.chain.to_string(), reason_of(&rule.expr), counter));
        }
    }
    Ok(counted)
}

/// What a rule of [`rules`] drops, told by what it matches: a protocol other than IP and
/// ARP, an ICMPv6 type (a neighbour advertisement's target), ARP (its sender), or else IP (its
/// source).
fn reason_of(statements: &[Statement<'static>]) -> DropReason {
    let matched = || {
        statements.iter().filter_map(|statement| match statement {
            Statement::Match(matched) => Some(matched),
            _ => None,
        })
    };
    let is_payload_of = |expression: &Expression<'static>, protocol: &str| {
        matches!(
            expression,
            Expression::Named(NamedExpression::Payload(Payload::PayloadField(field)))
                if field.protocol == protocol
        )
    };
    let not_a_protocol = matched().any(|matched| {
        matched.op == Operator::NEQ
            && matches!(
                &matched.left,
                Expression::Named(NamedExpression::Meta(meta)) if meta.key == MetaKey::Protocol
            )
    });
    if not_a_protocol {
        DropReason::SourceCheckNotIp
    } else if matched().any(|matched| is_payload_of(&matched.left, "icmpv6")) {
        DropReason::SourceCheckNeighbourAdvertisement
    } else if matched().any(|matched| is_payload_of(&matched.left, "arp")) {
        DropReason::SourceCheckArp
    } else {
        DropReason::SourceCheckAddress
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rule_is_told_by_what_it_drops() {
        for addresses in [vec!["10.22.0.2", "fd00::2"], vec!["fd00::2"], vec![]] {
            let check =
                SourceCheck::new(addresses.iter().map(|text| text.parse().expect("literal")));
            let reasons: Vec<DropReason> = rules(&check)
                .iter()
                .filter(|rule| matches!(rule.last(), Some(Statement::Drop(None))))
                .map(|rule| reason_of(rule))
                .collect();
            assert_eq!(
                reasons,
                [
                    DropReason::SourceCheckAddress,
                    DropReason::SourceCheckAddress,
                    DropReason::SourceCheckNeighbourAdvertisement,
                    DropReason::SourceCheckArp,
                    DropReason::SourceCheckNotIp,
                ],
                "{addresses:?}"
            );
        }
    }

    #[test]
    fn every_rule_counts_and_drops_and_names_the_own_addresses() {
        let check = SourceCheck::new(
            ["10.22.0.2", "fd00::2", "fe80::1"].map(|text| text.parse().expect("literal")),
        );
        let rules = rules(&check);
        assert_eq!(rules.len(), 6);
        assert!(
            matches!(rules[0].last(), Some(Statement::Accept(None))),
            "IPv4 from an own address is let on first"
        );
        for rule in &rules[1..] {
            assert!(matches!(rule.last(), Some(Statement::Drop(None))));
        }
        let json = serde_json::to_string(&rules).expect("encodes");
        for expected in [
            "10.22.0.2",
            "0xfd000000000000000000000000000002",
            "0xfe800000000000000000000000000001",
            "\"::\"",
            "0.0.0.0",
        ] {
            assert!(json.contains(expected), "{expected} in {json}");
        }
    }
}
