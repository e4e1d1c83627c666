//! An attachment's filter as the chains that hold it: its two filter chains (`f_<owner>_out`,
//! `f_<owner>_in`) with its rules in index order and the default; the chain its REJECT rules
//! jump to (`r_<owner>`), which answers within the attachment's limit; and one chain a
//! direction per rule with `log` (`l_<owner>_<out|in>_<index>`), which logs its new
//! connections within the rule's limit.
//!
//! A rule that names a network and no address is written once a family (its member sets are a
//! family's each), its comment saying which (`rule 10 ip`); any other rule once.

use std::borrow::Cow;

use cnibpf_common::filter::{
    answers::{ANSWER_BURST, NS_PER_ANSWER},
    matches::{MATCH_BURST, NS_PER_MATCH},
};
use nftables::{
    expr::{BinaryOperation, Expression, MetaKey, NamedExpression},
    schema::NfListObject,
    stmt::{
        AnonymousCounter, Counter, JumpTarget, Limit, Log, Operator, Reject, RejectType, Statement,
    },
    types::RejectCode,
};

use super::super::{
    filter_chains,
    listing::Counters,
    log_chain, member_set,
    names::{RuleComment, rule_comment},
    nflog,
    nft::{self, address_field, matches, meta, network, text},
    reject_chain,
};
use crate::model::{ConnState, Direction, Filter, FilterRule, PortRange, RuleProtocol, Target};

/// The reject chain's rules, by comment: a reset is never answered; past the limit, nothing
/// is; a segment that opens a connection is answered with a reset; anything else with an
/// ICMP or ICMPv6 "administratively prohibited".
pub const UNANSWERED: &str = "unanswered";
pub const SUPPRESSED: &str = "suppressed";
pub const RESET: &str = "reset";
pub const PROHIBITED: &str = "prohibited";
/// A log chain's rule that logs (after its [`SUPPRESSED`]).
pub const LOGGED: &str = "log";

/// The chains of `filter` for attachment `owner`, in the order they are made: those jumped to
/// first. Deleted in the reverse order. A filter without REJECT or `log` has only its filter
/// chains, as a filter an older build wrote.
pub fn chains(owner: u64, filter: &Filter) -> Vec<String> {
    let mut chains = Vec::new();
    if rejects(filter) {
        chains.push(reject_chain(owner));
    }
    chains.extend(
        directed(owner, filter)
            .filter(|(_, rule)| rule.log)
            .map(|(chain, rule)| log_chain(&chain, rule.index)),
    );
    chains.extend(filter_chains(owner));
    chains
}

fn rejects(filter: &Filter) -> bool {
    filter
        .rules
        .iter()
        .any(|rule| rule.target == Target::Reject)
}

/// Each rule with each filter chain it is in (a rule of both directions is in both).
fn directed(owner: u64, filter: &Filter) -> impl Iterator<Item = (String, &FilterRule)> {
    filter_chains(owner)
        .into_iter()
        .zip([Direction::Egress, Direction::Ingress])
        .flat_map(move |(chain, direction)| {
            filter
                .rules
                .iter()
                .filter(move |rule| {
                    rule.direction == direction || rule.direction == Direction::Both
                })
                .map(move |rule| (chain.clone(), rule))
        })
}

/// The rules of [`chains`], in the same order. What passes every filter (replies, related
/// errors, IPv6 neighbour and listener control) is let through by the hook chains before any
/// filter chain. Each rule's counter starts where `kept` says its rule of the same chain and
/// comment had counted (a live change's rules that stay), else from zero. `log_group` is the
/// NFLOG group of the instance.
pub fn rules(
    owner: u64,
    filter: &Filter,
    kept: Option<&Counters>,
    log_group: u16,
) -> Vec<NfListObject<'static>> {
    let counter = |chain: &str, comment: &str| {
        // fail-closed: Options of what was counted; a rule without a count starts at zero.
        let (packets, bytes) = kept
            .and_then(|kept| kept.of_rule(chain, comment))
            .unwrap_or_default();
        counter(packets, bytes)
    };
    let mut rules = if rejects(filter) {
        reject_rules(&reject_chain(owner), counter)
    } else {
        Vec::new()
    };
    for (chain, rule) in directed(owner, filter).filter(|(_, rule)| rule.log) {
        let direction = if chain.ends_with("_out") {
            Direction::Egress
        } else {
            Direction::Ingress
        };
        let logging = log_chain(&chain, rule.index);
        let prefix = nflog::prefix(owner, rule.index, rule.target, direction);
        rules.push(nft::rule(
            &logging,
            vec![
                limit_over(MATCH_BURST, NS_PER_MATCH),
                counter(&logging, SUPPRESSED),
                Statement::Return(None),
            ],
            Some(SUPPRESSED.to_owned()),
        ));
        rules.push(nft::rule(
            &logging,
            vec![Statement::Log(Some(Log {
                prefix: Some(Cow::Owned(prefix)),
                ..Log::new(Some(u32::from(log_group)))
            }))],
            Some(LOGGED.to_owned()),
        ));
    }
    for chain in filter_chains(owner) {
        for (_, rule) in directed(owner, filter).filter(|(held, _)| *held == chain) {
            for family in families(rule) {
                let statements = rule_matches(rule, family);
                if rule.log {
                    let mut logging = statements.clone();
                    logging.push(ct_state(text(ConnState::New)));
                    logging.push(Statement::Jump(JumpTarget {
                        target: Cow::Owned(log_chain(&chain, rule.index)),
                    }));
                    let comment = rule_comment(RuleComment::Log, rule.index, family);
                    rules.push(nft::rule(&chain, logging, Some(comment)));
                }
                let comment = rule_comment(RuleComment::Rule, rule.index, family);
                let mut statements = statements;
                statements.push(counter(&chain, &comment));
                statements.push(verdict(owner, rule.target));
                rules.push(nft::rule(&chain, statements, Some(comment)));
            }
        }
        rules.push(nft::rule(
            &chain,
            vec![counter(&chain, "default"), verdict(owner, filter.default)],
            Some("default".to_owned()),
        ));
    }
    rules
}

/// The families a rule is written for: `None` once for both (it names no network, or an
/// address, which is of one family); else each.
fn families(rule: &FilterRule) -> Vec<Option<bool>> {
    let named = rule.src_network.is_some() || rule.dst_network.is_some();
    let addressed = rule.src.is_some() || rule.dst.is_some();
    if named && !addressed {
        vec![Some(true), Some(false)]
    } else {
        vec![None]
    }
}

fn reject_rules(
    chain: &str,
    counter: impl Fn(&str, &str) -> Statement<'static> + Copy,
) -> Vec<NfListObject<'static>> {
    let tcp_flags = || nft::payload("tcp", "flags");
    let opening = Expression::BinaryOperation(Box::new(BinaryOperation::AND(
        tcp_flags(),
        Expression::List(vec![text("syn"), text("ack")]),
    )));
    let reject = |kind, code| Statement::Reject(Some(Reject::new(Some(kind), code)));
    [
        (
            UNANSWERED,
            vec![matches(tcp_flags(), Operator::IN, text("rst"))],
            Statement::Drop(None),
        ),
        (
            SUPPRESSED,
            vec![limit_over(ANSWER_BURST, NS_PER_ANSWER)],
            Statement::Drop(None),
        ),
        (
            RESET,
            vec![matches(opening, Operator::EQ, text("syn"))],
            reject(RejectType::TCPReset, None),
        ),
        (
            PROHIBITED,
            Vec::new(),
            reject(RejectType::ICMPX, Some(RejectCode::AdminProhibited)),
        ),
    ]
    .into_iter()
    .map(|(comment, mut statements, verdict)| {
        statements.push(counter(chain, comment));
        statements.push(verdict);
        nft::rule(chain, statements, Some(comment.to_owned()))
    })
    .collect()
}

/// `limit rate over <rate>/second burst <burst> packets`: matches once the bucket of `burst`,
/// refilled one every `ns_per_token`, is empty (a packet it lets through takes one).
fn limit_over(burst: u64, ns_per_token: u64) -> Statement<'static> {
    // fail-closed: constants of this build, none that large.
    let whole = |value: u64| u32::try_from(value).unwrap_or(u32::MAX);
    Statement::Limit(Limit {
        rate: whole(1_000_000_000 / ns_per_token),
        rate_unit: None,
        per: Some(Cow::Borrowed("second")),
        burst: Some(whole(burst)),
        burst_unit: None,
        inv: Some(true),
    })
}

fn counter(packets: u64, bytes: u64) -> Statement<'static> {
    Statement::Counter(Counter::Anonymous(Some(AnonymousCounter {
        packets: Some(packets as usize),
        bytes: Some(bytes as usize),
    })))
}

/// A rule's verdict. ALLOW returns rather than accepts: an accept would end the hook, and the
/// other side's chain (the receiving container's ingress after the sender's egress) must still
/// judge the packet. REJECT goes to the attachment's reject chain, which answers and drops.
fn verdict(owner: u64, target: Target) -> Statement<'static> {
    match target {
        Target::Allow => Statement::Return(None),
        Target::Drop => Statement::Drop(None),
        Target::Reject => Statement::Jump(JumpTarget {
            target: Cow::Owned(reject_chain(owner)),
        }),
    }
}

/// nft's name of a rule's protocol (`meta l4proto`); `None` matches any.
pub fn nft_protocol(protocol: RuleProtocol) -> Option<&'static str> {
    match protocol {
        RuleProtocol::Any => None,
        RuleProtocol::Icmpv6 => Some("ipv6-icmp"),
        other => Some(other.as_str()),
    }
}

fn ct_state(states: Expression<'static>) -> Statement<'static> {
    matches(
        Expression::Named(NamedExpression::CT(nftables::expr::CT {
            key: Cow::Borrowed("state"),
            family: None,
            dir: None,
        })),
        Operator::IN,
        states,
    )
}

/// The matches of `rule` written for `family` (`None`: as its addresses say), in the order
/// nft lists them.
fn rule_matches(rule: &FilterRule, family: Option<bool>) -> Vec<Statement<'static>> {
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
    let of_its_address = || rule.src.or(rule.dst).is_none_or(|net| net.addr().is_ipv4());
    // fail-closed: an Option of the rule: one written once has an address, of its family.
    let ipv4 = family.unwrap_or_else(of_its_address);
    for (named, field) in [(&rule.src_network, "saddr"), (&rule.dst_network, "daddr")] {
        if let Some(named) = named {
            statements.push(matches(
                address_field(ipv4, field),
                Operator::EQ,
                text(format!("@{}", member_set(named.as_str(), ipv4))),
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
        statements.push(ct_state(text(rule.connstate)));
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
