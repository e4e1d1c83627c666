//! The filter: one chain pair per attachment (`f_<owner>_out`, `f_<owner>_in`) holding its rules
//! in index order, reached through the dispatch maps by container address. Each rule is typed
//! nft matches with a counter, its comment only `rule <index>`; inspect and CHECK read the rule
//! back from its matches, so what they show is what the kernel runs, whole.
//!
//! Containers on one bridge reach each other without the IP stack: the bridge is switched to
//! hand its frames to the IP hooks (`nf_call_iptables`, `nf_call_ip6tables`, br_netfilter) so
//! that their filters judge that traffic too, statefully, as every other.

use std::borrow::Cow;

use nftables::{
    expr::{Expression, MetaKey, NamedExpression, Payload},
    schema::{NfListObject, Rule},
    stmt::{AnonymousCounter, Counter, Operator, Statement},
};

use super::{
    NftablesBackend, NftablesError, filter_chains,
    hooks::Hooks,
    host,
    listing::{Counters, Listing},
    nft::{self, address_field, matches, meta, network, network_of, port_of, text},
    owner_comment,
};
use crate::{
    backend::{BackendError, Endpoint, FilterRecord, Filtering},
    model::{ConnState, Direction, Filter, FilterRule, PortRange, RuleProtocol, Target},
    netlink,
};

impl Filtering for NftablesBackend {
    fn setup_filter(
        &mut self,
        endpoint: &Endpoint,
        filter: Option<&Filter>,
    ) -> Result<(), BackendError> {
        if filter.is_some() && endpoint.gateway_ifindex != endpoint.host.index {
            self.filter_on_bridge(endpoint.gateway_ifindex)?;
        }
        let Some(filter) = filter else {
            // Unfiltered: nothing to add, and no record to start (an ADD's undo ends here).
            return self.teardown_filter(endpoint.attachment.owner_id());
        };
        if let Some(after) = self.attach(endpoint)?.after.as_mut() {
            after.filter = Some(filter.clone());
            after.filter_changed = false;
        }
        Ok(())
    }

    fn change_filter(&mut self, owner: u64, filter: &Filter) -> Result<(), BackendError> {
        // Refused before anything of the operation changes.
        let record = self.store.record(owner).ok_or(BackendError::NotRecorded)?;
        if record.filter.is_none() {
            // Its first rules: on a bridge, as an ADD's filter is set up.
            let host = record.host.clone();
            let port = netlink::link_if_there_by_name(&host).map_err(|source| {
                BackendError::Interface {
                    action: format!("could not look up interface {host}"),
                    source: Box::new(source),
                }
            })?;
            if let Some(bridge) = port.and_then(|port| port.master) {
                self.filter_on_bridge(bridge)?;
            }
        }
        let kept = Counters::of(self.listing()?);
        let change = self.change(owner);
        if let Some(after) = change.after.as_mut() {
            after.filter = Some(filter.clone());
            after.filter_changed = true;
        }
        change.kept_counters = Some(kept);
        Ok(())
    }

    fn teardown_filter(&mut self, owner: u64) -> Result<(), BackendError> {
        if let Some(after) = self.change(owner).after.as_mut() {
            after.filter = None;
        }
        Ok(())
    }

    fn check_filter(
        &self,
        endpoint: &Endpoint,
        filter: Option<&Filter>,
    ) -> Result<(), BackendError> {
        let listing = self.listing()?;
        let owner = endpoint.attachment.owner_id();
        let installed = filter_of(listing, owner)
            .map_err(|error| {
                BackendError::CheckFailed(format!("{}: {error}", endpoint.attachment))
            })?
            .map(|record| record.filter);
        // Rules a live change set are the attachment's, as its record holds them.
        let filter = match self.store.record(owner) {
            Some(record) if record.filter_changed => record.filter.as_ref(),
            _ => filter,
        };
        let owner_text = owner_comment(&endpoint.attachment)?;
        let dispatched = ["filter_out4", "filter_in4", "filter_out6", "filter_in6"]
            .iter()
            .flat_map(|map| listing.elements(map))
            .filter(|element| element.comment.as_deref() == Some(owner_text.as_str()))
            .count();
        // fail-closed: an Option of the configuration.
        let wanted_dispatch = filter.map_or(0, |_| endpoint.container_networks.len() * 2);
        if filter.is_some() && !Hooks::of_listing(listing).filter {
            return Err(BackendError::CheckFailed(format!(
                "the filter of {} is not hooked (chain forward is missing)",
                endpoint.attachment
            )));
        }
        if installed.as_ref() != filter || dispatched != wanted_dispatch {
            return Err(BackendError::CheckFailed(format!(
                "the filter of {} differs from its configuration",
                endpoint.attachment
            )));
        }
        Ok(())
    }
}

impl NftablesBackend {
    /// A filter on a container of the bridge `gateway_ifindex` (when it is a bridge whose
    /// frames reach the IP hooks): the ports of the attachments on it reach their own
    /// hostPorts from now on only through their hairpin mode (see `host::hairpin_on`), and
    /// the bridge is recorded as filtered.
    fn filter_on_bridge(&mut self, gateway_ifindex: u32) -> Result<(), BackendError> {
        let gateway =
            netlink::link_by_index(gateway_ifindex).map_err(|source| BackendError::Interface {
                action: format!("could not look up bridge {gateway_ifindex}"),
                source: Box::new(source),
            })?;
        if gateway.kind.as_deref() != Some("bridge") || !host::bridge_netfilter_on(&gateway)? {
            return Ok(());
        }
        let ports: Vec<String> = self
            .store
            .records()
            .map(|(_, record)| record.host.clone())
            .collect();
        for port in ports {
            let on_this_bridge = netlink::link_if_there_by_name(&port)
                .map_err(|source| BackendError::Interface {
                    action: format!("could not look up interface {port}"),
                    source: Box::new(source),
                })?
                .is_some_and(|link| link.master == Some(gateway.index));
            if on_this_bridge {
                host::hairpin_on(&port)?;
            }
        }
        self.filtered_bridges.push(gateway.name);
        Ok(())
    }
}

/// The rules of an attachment's two chains (`[out, in]`): its rules in index order, then the
/// default. What passes every filter (replies, related errors, IPv6 neighbour and listener
/// control) is let through by the hook chains before any filter chain.
/// Each rule's counter starts where `kept` says its rule of the same chain and comment had
/// counted (a live change's rules that stay), else from zero.
pub fn chain_rules(
    chains: &[String; 2],
    filter: &Filter,
    kept: Option<&Counters>,
) -> Vec<NfListObject<'static>> {
    let mut rules = Vec::new();
    let counter = |chain: &str, comment: &str| {
        // fail-closed: Options of what was counted; a rule without a count starts at zero.
        let (packets, bytes) = kept
            .and_then(|kept| kept.of_rule(chain, comment))
            .unwrap_or_default();
        counter(packets, bytes)
    };
    for (chain, direction) in chains.iter().zip([Direction::Egress, Direction::Ingress]) {
        for rule in &filter.rules {
            if rule.direction == direction || rule.direction == Direction::Both {
                let comment = format!("rule {}", rule.index);
                let mut statements = rule_matches(rule);
                statements.push(counter(chain, &comment));
                statements.push(verdict(rule.target));
                rules.push(nft::rule(chain, statements, Some(comment)));
            }
        }
        rules.push(nft::rule(
            chain,
            vec![counter(chain, "default"), verdict(filter.default)],
            Some("default".to_owned()),
        ));
    }
    rules
}

fn counter(packets: u64, bytes: u64) -> Statement<'static> {
    Statement::Counter(Counter::Anonymous(Some(AnonymousCounter {
        packets: Some(packets as usize),
        bytes: Some(bytes as usize),
    })))
}

/// A rule's verdict. ALLOW returns rather than accepts: an accept would end the hook, and the
/// other side's chain (the receiving container's ingress after the sender's egress) must still
/// judge the packet.
fn verdict(target: Target) -> Statement<'static> {
    match target {
        Target::Allow => Statement::Return(None),
        Target::Drop => Statement::Drop(None),
    }
}

/// nft's name of a rule's protocol (`meta l4proto`); `None` matches any.
fn nft_protocol(protocol: RuleProtocol) -> Option<&'static str> {
    match protocol {
        RuleProtocol::Any => None,
        RuleProtocol::Icmpv6 => Some("ipv6-icmp"),
        other => Some(other.as_str()),
    }
}

/// The matches of `rule`, in the order nft lists them.
fn rule_matches(rule: &FilterRule) -> Vec<Statement<'static>> {
    let mut statements = Vec::new();
    for (net, field) in [(rule.src, "saddr"), (rule.dst, "daddr")] {
        if let Some(net) = net {
            statements.push(matches(
                address_field(net.addr().is_ipv4(), field),
                Operator::EQ,
                network(net),
            ));
        }
    }
    if let Some(protocol) = nft_protocol(rule.protocol) {
        statements.push(matches(
            meta(MetaKey::L4proto),
            Operator::EQ,
            text(protocol),
        ));
        for (range, field) in [(rule.sport, "sport"), (rule.dport, "dport")] {
            if let Some(range) = range {
                statements.push(matches(
                    nft::payload("th", field),
                    Operator::EQ,
                    ports(range),
                ));
            }
        }
    }
    if rule.connstate != ConnState::Any {
        statements.push(matches(
            Expression::Named(NamedExpression::CT(nftables::expr::CT {
                key: Cow::Borrowed("state"),
                family: None,
                dir: None,
            })),
            Operator::IN,
            text(rule.connstate),
        ));
    }
    statements
}

fn ports(range: PortRange) -> Expression<'static> {
    if range.low == range.high {
        return nft::number(range.low);
    }
    Expression::Range(Box::new(nftables::expr::Range {
        range: [nft::number(range.low), nft::number(range.high)],
    }))
}

fn ports_of(expression: &Expression<'_>) -> Option<PortRange> {
    match expression {
        Expression::Range(range) => Some(PortRange {
            low: port_of(&range.range[0])?,
            high: port_of(&range.range[1])?,
        }),
        other => port_of(other).map(PortRange::single),
    }
}

/// A listed rule read back as the filter rule `index` it was written from; anything this
/// build does not write is an error.
fn rule_of(
    rule: &Rule<'_>,
    index: u32,
    direction: Direction,
) -> Result<(FilterRule, (u64, u64)), String> {
    let mut out = FilterRule {
        index,
        target: Target::Allow,
        src: None,
        dst: None,
        protocol: RuleProtocol::Any,
        sport: None,
        dport: None,
        connstate: ConnState::Any,
        direction,
    };
    let mut hits = None;
    let mut target = None;
    for statement in rule.expr.iter() {
        match statement {
            Statement::Match(matched) => read_match(&mut out, &matched.left, &matched.right)?,
            Statement::Counter(Counter::Anonymous(counter)) => {
                // fail-closed: a counter nft lists without values has counted nothing.
                let counter = counter.clone().unwrap_or_default();
                hits = Some((
                    // fail-closed: as above.
                    counter.packets.unwrap_or(0) as u64,
                    // fail-closed: as above.
                    counter.bytes.unwrap_or(0) as u64,
                ));
            }
            Statement::Return(_) => target = Some(Target::Allow),
            Statement::Drop(_) => target = Some(Target::Drop),
            other => return Err(format!("unexpected statement {other:?}")),
        }
    }
    out.target = target.ok_or("no verdict")?;
    Ok((out, hits.ok_or("no counter")?))
}

/// One match of a rule into `rule`'s fields.
fn read_match(
    rule: &mut FilterRule,
    left: &Expression<'_>,
    right: &Expression<'_>,
) -> Result<(), String> {
    let unreadable = || format!("unexpected match {left:?} == {right:?}");
    match left {
        Expression::Named(NamedExpression::Payload(Payload::PayloadField(field))) => {
            match (field.protocol.as_ref(), field.field.as_ref()) {
                ("ip" | "ip6", "saddr") => {
                    rule.src = Some(network_of(right).ok_or_else(unreadable)?)
                }
                ("ip" | "ip6", "daddr") => {
                    rule.dst = Some(network_of(right).ok_or_else(unreadable)?)
                }
                // `meta l4proto tcp th dport 80` is listed as `tcp dport 80`.
                (protocol @ ("tcp" | "udp" | "sctp" | "th"), port_field @ ("sport" | "dport")) => {
                    if protocol != "th" {
                        rule.protocol = protocol.parse().map_err(|_| unreadable())?;
                    }
                    let range = ports_of(right).ok_or_else(unreadable)?;
                    if port_field == "sport" {
                        rule.sport = Some(range);
                    } else {
                        rule.dport = Some(range);
                    }
                }
                _ => return Err(unreadable()),
            }
        }
        Expression::Named(NamedExpression::Meta(meta)) if meta.key == MetaKey::L4proto => {
            let Expression::String(name) = right else {
                return Err(unreadable());
            };
            rule.protocol = RuleProtocol::ALL
                .iter()
                .copied()
                .find(|protocol| nft_protocol(*protocol) == Some(name.as_ref()))
                .ok_or_else(unreadable)?;
        }
        Expression::Named(NamedExpression::CT(ct)) if ct.key == "state" => {
            let Expression::String(state) = right else {
                return Err(unreadable());
            };
            rule.connstate = state.parse().map_err(|_| unreadable())?;
        }
        _ => return Err(unreadable()),
    }
    Ok(())
}

/// An attachment's filter as its chains hold it, with the counters; `None` when it has none.
/// A chain that lost its default, or holds a rule cnibpf did not write, is an error.
pub fn filter_of(listing: &Listing, owner: u64) -> Result<Option<FilterRecord>, BackendError> {
    let [out_chain, in_chain] = filter_chains(owner);
    if !listing.has_chain(&out_chain) {
        return Ok(None);
    }
    let mut rules: Vec<(FilterRule, (u64, u64))> = Vec::new();
    let mut defaults = Vec::new();
    let mut default_hits = (0, 0);
    for (chain, direction) in [
        (&out_chain, Direction::Egress),
        (&in_chain, Direction::Ingress),
    ] {
        let unreadable = |reason: String| NftablesError::Rule {
            chain: chain.clone(),
            reason,
        };
        for rule in listing.rules(chain) {
            let comment = rule
                .comment
                .as_deref()
                .ok_or_else(|| unreadable("a rule has no comment".to_owned()))?;
            if comment == "default" {
                let (read, hits) = rule_of(rule, 0, direction).map_err(unreadable)?;
                defaults.push(read.target);
                default_hits = (default_hits.0 + hits.0, default_hits.1 + hits.1);
                continue;
            }
            let index = comment
                .strip_prefix("rule ")
                // fail-closed: decoding a comment; one that does not parse is an error below.
                .and_then(|index| index.parse().ok())
                .ok_or_else(|| unreadable(format!("comment {comment:?}")))?;
            let (read, hits) = rule_of(rule, index, direction).map_err(unreadable)?;
            match rules.iter_mut().find(|(held, _)| held.index == index) {
                // In both chains: a rule of both directions, counted once per chain it judged.
                Some((held, held_hits)) => {
                    held.direction = Direction::Both;
                    *held_hits = (held_hits.0 + hits.0, held_hits.1 + hits.1);
                }
                None => rules.push((read, hits)),
            }
        }
    }
    let [out_default, in_default] = defaults[..] else {
        return Err(NftablesError::Rule {
            chain: out_chain,
            reason: "a chain lacks its default rule".to_owned(),
        }
        .into());
    };
    if out_default != in_default {
        return Err(NftablesError::Rule {
            chain: out_chain,
            reason: "the chains' defaults differ".to_owned(),
        }
        .into());
    }
    rules.sort_by_key(|(rule, _)| rule.index);
    let (rules, hits): (Vec<FilterRule>, Vec<(u64, u64)>) = rules.into_iter().unzip();
    Ok(Some(FilterRecord {
        filter: Filter {
            rules,
            default: out_default,
        },
        hits,
        default_hits,
        flows: 0,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rule as nft lists it: what `chain_rules` writes, through JSON, folded as nft folds
    /// `meta l4proto tcp th dport` into `tcp dport`.
    fn listed(rule: &FilterRule) -> Rule<'static> {
        let filter = Filter {
            rules: vec![*rule],
            default: Target::Allow,
        };
        let chains = ["f_out".to_owned(), "f_in".to_owned()];
        let written = chain_rules(&chains, &filter, None)
            .into_iter()
            .find_map(|object| match object {
                NfListObject::Rule(rule) if rule.comment.as_deref() == Some("rule 7") => Some(rule),
                _ => None,
            })
            .expect("the rule is written");
        let json = serde_json::to_string(&written).expect("encodes");
        serde_json::from_str(&json).expect("decodes")
    }

    #[test]
    fn the_longest_rule_reads_back_whole() {
        let rule = FilterRule {
            index: 7,
            target: Target::Drop,
            src: Some(
                "2001:db8:ffff:ffff:ffff:ffff:ffff:fff1/128"
                    .parse()
                    .expect("literal"),
            ),
            dst: Some(
                "2001:db8:ffff:ffff:ffff:ffff:ffff:fff2/128"
                    .parse()
                    .expect("literal"),
            ),
            protocol: RuleProtocol::Sctp,
            sport: Some(PortRange {
                low: 10_000,
                high: 10_999,
            }),
            dport: Some(PortRange {
                low: 60_000,
                high: 65_535,
            }),
            connstate: ConnState::Established,
            direction: Direction::Egress,
        };
        let (read, hits) = rule_of(&listed(&rule), 7, Direction::Egress).expect("readable");
        assert_eq!(read, rule);
        assert_eq!(hits, (0, 0));
    }

    #[test]
    fn nfts_folded_port_matches_read_as_the_protocol_and_ports() {
        let json = r#"{"nftables":[{"rule":{"family":"inet","table":"cnibpf","chain":"f_out","handle":3,"comment":"rule 20","expr":[
            {"match":{"op":"==","left":{"payload":{"protocol":"ip6","field":"saddr"}},"right":"2001:db8::1"}},
            {"match":{"op":"==","left":{"payload":{"protocol":"tcp","field":"dport"}},"right":{"range":[1000,2000]}}},
            {"match":{"op":"in","left":{"ct":{"key":"state"}},"right":"new"}},
            {"counter":{"packets":3,"bytes":180}},{"drop":null}]}}]}"#;
        let document: serde_json::Value = serde_json::from_str(json).expect("a listing");
        let rule: Rule<'static> =
            serde_json::from_value(document["nftables"][0]["rule"].clone()).expect("a rule");
        let (read, hits) = rule_of(&rule, 20, Direction::Ingress).expect("readable");
        assert_eq!(read.protocol, RuleProtocol::Tcp);
        assert_eq!(
            read.dport,
            Some(PortRange {
                low: 1000,
                high: 2000
            })
        );
        assert_eq!(read.src, Some("2001:db8::1/128".parse().expect("literal")));
        assert_eq!(read.connstate, ConnState::New);
        assert_eq!(read.target, Target::Drop);
        assert_eq!(hits, (3, 180));
    }

    #[test]
    fn an_unknown_match_is_an_error() {
        let mut rule = listed(&FilterRule {
            index: 7,
            target: Target::Allow,
            src: None,
            dst: None,
            protocol: RuleProtocol::Any,
            sport: None,
            dport: None,
            connstate: ConnState::Any,
            direction: Direction::Egress,
        });
        let mut statements = rule.expr.to_vec();
        statements.insert(
            0,
            matches(meta(MetaKey::Mark), Operator::EQ, nft::number(1)),
        );
        rule.expr = statements.into();
        assert!(rule_of(&rule, 7, Direction::Egress).is_err());
    }
}
