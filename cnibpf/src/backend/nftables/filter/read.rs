//! An attachment's filter read back from its chains, for inspect and CHECK: each rule from its
//! matches and verdict, so what they show is what the kernel runs, whole. Anything this build
//! does not write is an error.

use nftables::{
    expr::{Expression, MetaKey, NamedExpression, Payload},
    schema::Rule,
    stmt::{Counter, Statement},
};

use super::{
    super::{
        NftablesError, filter_chains,
        listing::Listing,
        log_chain,
        names::{RuleComment, parse_rule_comment},
        nft::{network_of, port_of},
        reject_chain,
    },
    write::nft_protocol,
};
use crate::{
    backend::{BackendError, FilterRecord},
    model::{
        ConnState, Direction, Filter, FilterRule, NetworkName, PortRange, RuleProtocol, Target,
    },
};

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
        let read = chain_of(listing, owner, chain, direction).map_err(unreadable)?;
        defaults.push(read.default.0);
        default_hits = (
            default_hits.0 + read.default.1.0,
            default_hits.1 + read.default.1.1,
        );
        for (rule, hits) in read.rules {
            match rules.iter_mut().find(|(held, _)| held.index == rule.index) {
                // In both chains: a rule of both directions, counted once per chain it judged.
                Some((held, held_hits)) => {
                    if (FilterRule {
                        direction: held.direction,
                        ..rule.clone()
                    }) != *held
                    {
                        return Err(unreadable(format!(
                            "rule {} differs between the chains",
                            rule.index
                        ))
                        .into());
                    }
                    held.direction = Direction::Both;
                    *held_hits = (held_hits.0 + hits.0, held_hits.1 + hits.1);
                }
                None => rules.push((rule, hits)),
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

/// One filter chain read back.
struct ChainRead {
    rules: Vec<(FilterRule, (u64, u64))>,
    default: (Target, (u64, u64)),
}

/// A rule of one chain as read so far: the families it was written for, and those its log rule
/// was.
struct Written {
    rule: FilterRule,
    hits: (u64, u64),
    families: Vec<Option<bool>>,
    logged: Vec<Option<bool>>,
}

fn chain_of(
    listing: &Listing,
    owner: u64,
    chain: &str,
    direction: Direction,
) -> Result<ChainRead, String> {
    let mut written: Vec<Written> = Vec::new();
    let mut logs: Vec<(u32, Option<bool>, FilterRule)> = Vec::new();
    let mut default = None;
    for rule in listing.rules(chain) {
        let comment = rule.comment.as_deref().ok_or("a rule has no comment")?;
        if comment == "default" {
            let (read, hits) = rule_of(rule, 0, direction, owner)?;
            default = Some((read.target, hits));
            continue;
        }
        let (kind, index, family) =
            parse_rule_comment(comment).ok_or_else(|| format!("comment {comment:?}"))?;
        if kind == RuleComment::Log {
            logs.push((index, family, log_rule_of(rule, index, direction, chain)?));
            continue;
        }
        let (read, hits) = rule_of(rule, index, direction, owner)?;
        match written.iter_mut().find(|held| held.rule.index == index) {
            Some(held) if held.rule == read && !held.families.contains(&family) => {
                held.families.push(family);
                held.hits = (held.hits.0 + hits.0, held.hits.1 + hits.1);
            }
            Some(_) => return Err(format!("rule {index} is written twice, differently")),
            None => written.push(Written {
                rule: read,
                hits,
                families: vec![family],
                logged: Vec::new(),
            }),
        }
    }
    for (index, family, log) in logs {
        let held = written
            .iter_mut()
            .find(|held| held.rule.index == index)
            .filter(|held| same_matches(&held.rule, &log))
            .ok_or_else(|| format!("log rule {index} does not match as its rule"))?;
        held.logged.push(family);
    }
    let rules = written
        .into_iter()
        .map(|mut held| {
            let mut families = held.families.clone();
            families.sort();
            if families != [None] && families != [Some(false), Some(true)] {
                return Err(format!("rule {} lacks a family", held.rule.index));
            }
            held.logged.sort();
            if !held.logged.is_empty() && held.logged != families {
                return Err(format!("rule {} is logged in part", held.rule.index));
            }
            held.rule.log = !held.logged.is_empty();
            Ok((held.rule, held.hits))
        })
        .collect::<Result<_, String>>()?;
    Ok(ChainRead {
        rules,
        default: default.ok_or("the chain lacks its default rule")?,
    })
}

/// Whether `log`, read from a log rule (its matches and `ct state new`), matches as `rule`.
fn same_matches(rule: &FilterRule, log: &FilterRule) -> bool {
    FilterRule {
        index: rule.index,
        target: rule.target,
        connstate: rule.connstate,
        direction: rule.direction,
        log: rule.log,
        ..log.clone()
    } == *rule
}

/// A listed rule read back as the filter rule `index` it was written from.
pub(super) fn rule_of(
    rule: &Rule<'_>,
    index: u32,
    direction: Direction,
    owner: u64,
) -> Result<(FilterRule, (u64, u64)), String> {
    let mut out = unmatched(index, direction);
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
            Statement::Jump(jump) if jump.target == reject_chain(owner) => {
                target = Some(Target::Reject);
            }
            other => return Err(format!("unexpected statement {other:?}")),
        }
    }
    out.target = target.ok_or("no verdict")?;
    Ok((out, hits.ok_or("no counter")?))
}

/// A log rule read back: its matches (with `ct state new`), its jump to its rule's log chain.
fn log_rule_of(
    rule: &Rule<'_>,
    index: u32,
    direction: Direction,
    chain: &str,
) -> Result<FilterRule, String> {
    let mut out = unmatched(index, direction);
    let mut jumped = false;
    for statement in rule.expr.iter() {
        match statement {
            Statement::Match(matched) => read_match(&mut out, &matched.left, &matched.right)?,
            Statement::Jump(jump) if jump.target == log_chain(chain, index) => jumped = true,
            other => return Err(format!("unexpected statement {other:?}")),
        }
    }
    if !jumped || out.connstate != ConnState::New {
        return Err(format!("log rule {index} does not log new connections"));
    }
    Ok(out)
}

fn unmatched(index: u32, direction: Direction) -> FilterRule {
    FilterRule::matching_all(index, Target::Allow, direction)
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
                (family @ ("ip" | "ip6"), address @ ("saddr" | "daddr")) => {
                    read_address(rule, family == "ip", address == "saddr", right)
                        .ok_or_else(unreadable)?;
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

/// An address match into `rule`: a network (`ip saddr 10.0.0.0/8`) or a lookup in a network's
/// member set of the same family (`ip saddr @net4_dmz`).
fn read_address(
    rule: &mut FilterRule,
    ipv4: bool,
    source: bool,
    right: &Expression<'_>,
) -> Option<()> {
    if let Expression::String(text) = right
        && let Some(set) = text.strip_prefix('@')
    {
        let prefix = if ipv4 { "net4_" } else { "net6_" };
        // fail-closed: decoding a set name; one that is not a network's is an error.
        let network = NetworkName::new(set.strip_prefix(prefix)?).ok()?;
        let field = if source {
            &mut rule.src_network
        } else {
            &mut rule.dst_network
        };
        *field = Some(network);
        return Some(());
    }
    let net = network_of(right)?;
    if net.addr().is_ipv4() != ipv4 {
        return None;
    }
    if source {
        rule.src = Some(net);
    } else {
        rule.dst = Some(net);
    }
    Some(())
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

#[cfg(test)]
mod tests {
    use nftables::{
        schema::NfListObject,
        stmt::{Operator, Statement},
    };

    use super::{super::write, *};
    use crate::backend::nftables::nft::{self, matches, meta};

    const OWNER: u64 = 0xab;

    fn rule(index: u32, target: Target) -> FilterRule {
        FilterRule {
            target,
            ..unmatched(index, Direction::Egress)
        }
    }

    /// The table as nft lists `filter`'s chains: what `write::rules` writes, through JSON.
    fn listing(filter: &Filter) -> Listing {
        let mut listed: Vec<nft::Listed> = write::chains(OWNER, filter)
            .into_iter()
            .map(nft::Listed::Chain)
            .collect();
        for object in write::rules(OWNER, filter, None, 7) {
            let NfListObject::Rule(rule) = object else {
                panic!("only rules are written: {object:?}");
            };
            let json = serde_json::to_string(&rule).expect("encodes");
            listed.push(nft::Listed::Rule(
                serde_json::from_str(&json).expect("decodes"),
            ));
        }
        Listing::from(&listed)
    }

    fn read_back(filter: &Filter) -> Result<Filter, BackendError> {
        Ok(filter_of(&listing(filter), OWNER)?
            .expect("the filter is there")
            .filter)
    }

    #[test]
    fn the_longest_rule_reads_back_whole() {
        let rule = FilterRule {
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
            src_network: Some(NetworkName::new("dmz").expect("valid")),
            dst_network: Some(NetworkName::new("protected").expect("valid")),
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
            log: true,
            ..rule(7, Target::Drop)
        };
        let filter = Filter {
            rules: vec![rule],
            default: Target::Allow,
        };
        assert_eq!(read_back(&filter).expect("readable"), filter);
    }

    #[test]
    fn network_rules_of_both_families_read_back_once_with_their_log_and_reject() {
        let dmz = NetworkName::new("dmz").expect("valid");
        let filter = Filter {
            rules: vec![
                FilterRule {
                    src_network: Some(dmz.clone()),
                    protocol: RuleProtocol::Tcp,
                    dport: Some(PortRange::single(389)),
                    direction: Direction::Ingress,
                    log: true,
                    ..rule(10, Target::Allow)
                },
                FilterRule {
                    dst_network: Some(dmz),
                    direction: Direction::Both,
                    ..rule(20, Target::Reject)
                },
                FilterRule {
                    src: Some("10.0.0.0/8".parse().expect("literal")),
                    log: true,
                    ..rule(30, Target::Reject)
                },
            ],
            default: Target::Drop,
        };
        assert_eq!(read_back(&filter).expect("readable"), filter);
        let listing = listing(&filter);
        let comments: Vec<&str> = listing
            .rules("f_00000000000000ab_in")
            .iter()
            .filter_map(|rule| rule.comment.as_deref())
            .collect();
        assert_eq!(
            comments,
            [
                "log 10 ip",
                "rule 10 ip",
                "log 10 ip6",
                "rule 10 ip6",
                "rule 20 ip",
                "rule 20 ip6",
                "default"
            ]
        );
    }

    #[test]
    fn a_family_or_a_log_rule_gone_is_an_error() {
        let filter = Filter {
            rules: vec![FilterRule {
                src_network: Some(NetworkName::new("dmz").expect("valid")),
                log: true,
                ..rule(10, Target::Allow)
            }],
            default: Target::Drop,
        };
        for gone in ["rule 10 ip6", "log 10 ip"] {
            let mut listed: Vec<nft::Listed> =
                vec![nft::Listed::Chain("f_00000000000000ab_in".to_owned())];
            for object in write::rules(OWNER, &filter, None, 7) {
                if let NfListObject::Rule(rule) = object
                    && rule.comment.as_deref() != Some(gone)
                {
                    listed.push(nft::Listed::Rule(rule));
                }
            }
            assert!(
                filter_of(&Listing::from(&listed), OWNER).is_err(),
                "without {gone}"
            );
        }
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
        let (read, hits) = rule_of(&rule, 20, Direction::Ingress, OWNER).expect("readable");
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
    fn an_unknown_match_or_a_set_of_the_other_family_is_an_error() {
        let filter = Filter {
            rules: vec![rule(7, Target::Allow)],
            default: Target::Allow,
        };
        let mut written = write::rules(OWNER, &filter, None, 7)
            .into_iter()
            .find_map(|object| match object {
                NfListObject::Rule(rule) if rule.comment.as_deref() == Some("rule 7") => Some(rule),
                _ => None,
            })
            .expect("the rule is written");
        assert!(rule_of(&written, 7, Direction::Egress, OWNER).is_ok());
        for unknown in [
            matches(meta(MetaKey::Mark), Operator::EQ, nft::number(1)),
            matches(
                nft::address_field(true, "saddr"),
                Operator::EQ,
                nft::text("@net6_dmz"),
            ),
        ] {
            let mut statements: Vec<Statement<'static>> = written.expr.to_vec();
            statements.insert(0, unknown);
            written.expr = statements.into();
            assert!(rule_of(&written, 7, Direction::Egress, OWNER).is_err());
            written.expr = written.expr[1..].to_vec().into();
        }
    }
}
