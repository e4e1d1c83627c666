//! What a scrape of `cnibpf metrics` reads of the nftables datapath: the attachments' records
//! (the state file), both tables in one netlink dump each (`host::dump_rules`) — the filters'
//! counters, the drops by reason — and conntrack's fill. `inspect` and the verbs read the table through
//! `nft`, whose listing also fetches every anonymous set's elements, one request each: 0.6 s
//! of a scrape at 1,000 attachments.

use std::collections::BTreeMap;

use cnibpf_common::drops::{DropCount, DropReason};

use super::{
    GUARD_CHAIN_PREFIX, LOCALNET_GUARD_CHAIN, NftablesBackend, NftablesError, conntrack,
    filter::write,
    host::{self, DumpedRule, NFPROTO_INET, NFPROTO_NETDEV},
    names::{RuleComment, parse_rule_comment},
    parse_owner, reject_chain,
};
use crate::{
    backend::{
        BackendError, FlowTable, MATCH_EVENTS_SUPPRESSED, REJECT_ANSWERS_SENT,
        REJECT_ANSWERS_SUPPRESSED,
    },
    model::{Attachment, Pod, Target},
};

/// `NF_DROP`, `NFT_RETURN` (what an ALLOW rule of a filter chain does) and `NFT_JUMP` (a
/// REJECT rule's, to its attachment's reject chain).
const VERDICT_DROP: i32 = 0;
const VERDICT_RETURN: i32 = -5;
const VERDICT_JUMP: i32 = -3;
/// The `meta protocol` value a rule matching ARP depends on (big-endian).
const ETHERTYPE_ARP: [u8; 2] = [0x08, 0x06];
/// `NFT_PAYLOAD_TRANSPORT_HEADER`.
const TRANSPORT_HEADER: u32 = 2;

/// One scrape's read of the nftables datapath.
#[derive(Debug, Default)]
pub struct Scraped {
    pub attachments: Vec<(u64, Attachment, Option<Pod>)>,
    /// Installed hostPorts by protocol name.
    pub host_ports: BTreeMap<&'static str, u64>,
    pub rules: Vec<ScrapedRule>,
    pub drops: Vec<(DropReason, DropCount)>,
    pub flow_tables: Vec<FlowTable>,
    /// What `Inspect::counters` reports: the reject chains' answers, the log chains' limits.
    pub counters: Vec<(&'static str, u64)>,
}

/// The packets one filter rule of one attachment decided (both directions' chains summed).
#[derive(Debug, PartialEq, Eq)]
pub struct ScrapedRule {
    pub owner: u64,
    /// The rule's `index`; `None` for the default verdict.
    pub index: Option<u32>,
    pub target: Target,
    pub packets: u64,
    pub bytes: u64,
}

impl NftablesBackend {
    /// The table read for a scrape, without `nft`.
    pub fn scrape(&self) -> Result<Scraped, BackendError> {
        // The two dumps at once: the kernel walks and encodes each table on its own.
        let (inet, netdev) = std::thread::scope(|scope| {
            let netdev = scope.spawn(|| host::dump_rules(NFPROTO_NETDEV));
            let inet = host::dump_rules(NFPROTO_INET);
            // fail-closed: a panic of the dump is not an error to report but a bug: it goes on.
            let netdev = netdev
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (inet, netdev)
        });
        let (inet, netdev) = (inet?, netdev?);
        let mut chains: BTreeMap<&str, Vec<&DumpedRule>> = BTreeMap::new();
        for rule in &inet {
            chains.entry(rule.chain.as_str()).or_default().push(rule);
        }
        let mut scraped = Scraped::default();
        for (owner, record) in self.store.records() {
            for mapping in &record.mappings {
                *scraped
                    .host_ports
                    .entry(mapping.protocol.as_str())
                    .or_default() += 1;
            }
            if let Some(attachment) = parse_owner(&record.owner) {
                scraped
                    .attachments
                    .push((owner, attachment, record.pod.clone()));
            }
        }
        for (owner, _, _) in &scraped.attachments {
            scraped.rules.extend(filter_rules(&chains, *owner)?);
        }
        let owners: Vec<u64> = scraped
            .attachments
            .iter()
            .map(|(owner, _, _)| *owner)
            .collect();
        scraped.drops = drops(&scraped.rules, &chains, &netdev);
        scraped.counters = answers_and_logs(&owners, &chains);
        if let Some((entries, capacity)) =
            conntrack::fill().map_err(NftablesError::ConntrackFill)?
        {
            scraped.flow_tables.push(FlowTable {
                name: "conntrack",
                entries,
                capacity,
            });
        }
        Ok(scraped)
    }
}

/// The counted rules of attachment `owner`'s filter chains (`f_<owner>_out`, `f_<owner>_in`),
/// by the index their comments name (`rule <index>`, `default`); none when it has no filter.
fn filter_rules(
    chains: &BTreeMap<&str, Vec<&DumpedRule>>,
    owner: u64,
) -> Result<Vec<ScrapedRule>, BackendError> {
    let mut rules: Vec<ScrapedRule> = Vec::new();
    for chain in [format!("f_{owner:016x}_out"), format!("f_{owner:016x}_in")] {
        for rule in chains.get(chain.as_str()).into_iter().flatten() {
            let unreadable = |reason: String| NftablesError::Rule {
                chain: chain.clone(),
                reason,
            };
            let comment = rule
                .comment
                .as_deref()
                .ok_or_else(|| unreadable("a rule has no comment".to_owned()))?;
            let index = match comment {
                "default" => None,
                _ => match parse_rule_comment(comment) {
                    Some((RuleComment::Rule, index, _)) => Some(index),
                    // A log rule counts nothing: its rule, next, counts what it decides.
                    Some((RuleComment::Log, ..)) => continue,
                    None => return Err(unreadable(format!("comment {comment:?}")).into()),
                },
            };
            let target = match rule.verdict {
                Some(VERDICT_DROP) => Target::Drop,
                Some(VERDICT_RETURN) => Target::Allow,
                Some(VERDICT_JUMP) => Target::Reject,
                other => return Err(unreadable(format!("verdict {other:?}")).into()),
            };
            // fail-closed: a rule without a counter counted nothing.
            let (packets, bytes) = rule.counter.unwrap_or_default();
            match rules.iter_mut().find(|held| held.index == index) {
                // In both chains: a rule of both directions, counted once per chain it judged.
                Some(held) => {
                    held.packets += packets;
                    held.bytes += bytes;
                }
                None => rules.push(ScrapedRule {
                    owner,
                    index,
                    target,
                    packets,
                    bytes,
                }),
            }
        }
    }
    Ok(rules)
}

/// The answers the reject chains of `owners` sent and held back, and what their log chains'
/// limits held back, as `Inspect::counters` names them.
fn answers_and_logs(
    owners: &[u64],
    chains: &BTreeMap<&str, Vec<&DumpedRule>>,
) -> Vec<(&'static str, u64)> {
    let counted = |rules: &[&DumpedRule], comments: &[&str]| -> u64 {
        rules
            .iter()
            .filter(|rule| {
                rule.comment
                    .as_deref()
                    .is_some_and(|comment| comments.contains(&comment))
            })
            .filter_map(|rule| rule.counter)
            .map(|(packets, _)| packets)
            .sum()
    };
    let (mut sent, mut suppressed, mut unlogged) = (0, 0, 0);
    for owner in owners {
        if let Some(rules) = chains.get(reject_chain(*owner).as_str()) {
            sent += counted(rules, &[write::RESET, write::PROHIBITED]);
            suppressed += counted(rules, &[write::SUPPRESSED]);
        }
        let logging = format!("l_{owner:016x}_");
        for (_, rules) in chains
            .iter()
            .filter(|(chain, _)| chain.starts_with(&logging))
        {
            unlogged += counted(rules, &[write::SUPPRESSED]);
        }
    }
    vec![
        (REJECT_ANSWERS_SENT, sent),
        (REJECT_ANSWERS_SUPPRESSED, suppressed),
        (MATCH_EVENTS_SUPPRESSED, unlogged),
    ]
}

/// Every reason the nftables datapath counts, from the filters' rules, the localnet guard and,
/// in table `netdev cnibpf`, the source checks' rules and the masquerade guards'.
fn drops(
    rules: &[ScrapedRule],
    chains: &BTreeMap<&str, Vec<&DumpedRule>>,
    netdev: &[DumpedRule],
) -> Vec<(DropReason, DropCount)> {
    let mut drops = counted_drops();
    let mut add = |reason, counted| add_drops(&mut drops, reason, counted);
    for rule in rules.iter().filter(|rule| rule.target != Target::Allow) {
        let reason = match (rule.index, rule.target) {
            (_, Target::Reject) => DropReason::FilterReject,
            (Some(_), _) => DropReason::FilterRule,
            (None, _) => DropReason::FilterDefault,
        };
        add(reason, (rule.packets, rule.bytes));
    }
    for rule in netdev {
        if let Some(counted) = rule.counter {
            let reason = if rule.chain.starts_with(GUARD_CHAIN_PREFIX) {
                DropReason::MasqueradeUntranslatable
            } else {
                source_check_reason(rule)
            };
            add(reason, counted);
        }
    }
    let counted_in = |chain: &str| {
        chains
            .get(chain)
            .into_iter()
            .flatten()
            .find_map(|rule| rule.counter)
    };
    if let Some(counted) = counted_in(LOCALNET_GUARD_CHAIN) {
        add(DropReason::LocalnetGuard, counted);
    }
    drops.into_iter().collect()
}

/// What a source-check rule drops, told by what it reads: an ICMPv6 field (a neighbour
/// advertisement's target), ARP (its dependency on that protocol), nothing but the protocol
/// (one other than IP and ARP), or else an IP source. The same rules `sources::reason_of`
/// tells apart as `nft` lists them.
fn source_check_reason(rule: &DumpedRule) -> DropReason {
    if rule.payload_bases.contains(&TRANSPORT_HEADER) {
        DropReason::SourceCheckNeighbourAdvertisement
    } else if rule.equal_to.iter().any(|value| value[..] == ETHERTYPE_ARP) {
        DropReason::SourceCheckArp
    } else if rule.payload_bases.is_empty() && rule.reads_protocol {
        DropReason::SourceCheckNotIp
    } else {
        DropReason::SourceCheckAddress
    }
}

/// The drop reasons the nftables datapath counts, each at zero: what it reports lists every
/// one, counted or not (what the kernel's own connection tracking and NAT drop is the
/// kernel's to count).
pub(super) fn counted_drops() -> BTreeMap<DropReason, DropCount> {
    [
        DropReason::FilterRule,
        DropReason::FilterDefault,
        DropReason::FilterReject,
        DropReason::SourceCheckAddress,
        DropReason::SourceCheckArp,
        DropReason::SourceCheckNeighbourAdvertisement,
        DropReason::SourceCheckNotIp,
        DropReason::LocalnetGuard,
        DropReason::MasqueradeUntranslatable,
    ]
    .into_iter()
    .map(|reason| (reason, DropCount::default()))
    .collect()
}

/// Adds (packets, bytes) to `reason`'s count in `drops`.
pub(super) fn add_drops(
    drops: &mut BTreeMap<DropReason, DropCount>,
    reason: DropReason,
    (packets, bytes): (u64, u64),
) {
    let count = drops.entry(reason).or_default();
    count.packets += packets;
    count.bytes += bytes;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(payload_bases: &[u32], equal_to: &[&[u8]], reads_protocol: bool) -> DumpedRule {
        DumpedRule {
            chain: "s_1".to_owned(),
            counter: Some((1, 60)),
            verdict: Some(VERDICT_DROP),
            payload_bases: payload_bases.to_vec(),
            reads_protocol,
            equal_to: equal_to.iter().map(|value| value.to_vec()).collect(),
            ..DumpedRule::default()
        }
    }

    #[test]
    fn each_source_check_rule_is_told_by_what_it_reads() {
        let ip = [0x08, 0x00];
        let ip6 = [0x86, 0xdd];
        for (dumped, reason) in [
            // ip saddr != 10.22.0.2: meta protocol == ip, the network header's source.
            (rule(&[1], &[&ip], true), DropReason::SourceCheckAddress),
            (rule(&[1], &[&ip6], true), DropReason::SourceCheckAddress),
            // icmpv6 type nd-neighbor-advert @th,64,128 != {…}
            (
                rule(&[1, 2, 2], &[&ip6, &[58], &[136]], true),
                DropReason::SourceCheckNeighbourAdvertisement,
            ),
            // arp saddr ip != {…}
            (
                rule(&[1], &[&ETHERTYPE_ARP], true),
                DropReason::SourceCheckArp,
            ),
            // meta protocol != { ip, arp, ip6 }
            (rule(&[], &[], true), DropReason::SourceCheckNotIp),
        ] {
            assert_eq!(source_check_reason(&dumped), reason, "{dumped:?}");
        }
    }

    #[test]
    fn a_rule_of_both_directions_is_counted_once_per_chain_and_drops_by_reason() {
        let filter = |chain: &str, comment: &str, verdict: i32, packets: u64| DumpedRule {
            chain: chain.to_owned(),
            comment: Some(comment.to_owned()),
            counter: Some((packets, packets * 100)),
            verdict: Some(verdict),
            ..DumpedRule::default()
        };
        let dumped = [
            filter("f_0000000000000007_out", "rule 10", VERDICT_DROP, 3),
            filter("f_0000000000000007_out", "default", VERDICT_RETURN, 5),
            filter("f_0000000000000007_in", "rule 10", VERDICT_DROP, 2),
            filter("f_0000000000000007_in", "rule 20", VERDICT_RETURN, 4),
            filter("f_0000000000000007_in", "log 30 ip", VERDICT_JUMP, 0),
            filter("f_0000000000000007_in", "rule 30 ip", VERDICT_JUMP, 2),
            filter("f_0000000000000007_in", "rule 30 ip6", VERDICT_JUMP, 1),
            filter("f_0000000000000007_in", "default", VERDICT_RETURN, 1),
            filter("r_0000000000000007", "suppressed", VERDICT_DROP, 1),
            filter("r_0000000000000007", "reset", VERDICT_DROP, 2),
            filter("r_0000000000000007", "prohibited", VERDICT_DROP, 0),
            filter("l_0000000000000007_in_30", "suppressed", VERDICT_RETURN, 4),
        ];
        let mut chains: BTreeMap<&str, Vec<&DumpedRule>> = BTreeMap::new();
        for rule in &dumped {
            chains.entry(rule.chain.as_str()).or_default().push(rule);
        }
        let rules = filter_rules(&chains, 7).expect("readable");
        let summary: Vec<(Option<u32>, Target, u64)> = rules
            .iter()
            .map(|rule| (rule.index, rule.target, rule.packets))
            .collect();
        assert_eq!(
            summary,
            [
                (Some(10), Target::Drop, 5),
                (None, Target::Allow, 6),
                (Some(20), Target::Allow, 4),
                (Some(30), Target::Reject, 3),
            ]
        );
        let guard = filter(
            "g_0000000000000007",
            "drop reason masquerade_untranslatable",
            VERDICT_DROP,
            9,
        );
        let drops = drops(&rules, &chains, &[guard]);
        let of = |reason| {
            drops
                .iter()
                .find(|(held, _)| *held == reason)
                .map(|(_, count)| count.packets)
        };
        assert_eq!(
            (of(DropReason::FilterRule), of(DropReason::FilterDefault)),
            (Some(5), Some(0))
        );
        assert_eq!(of(DropReason::FilterReject), Some(3));
        assert_eq!(of(DropReason::MasqueradeUntranslatable), Some(9));
        assert_eq!(
            answers_and_logs(&[7], &chains),
            [
                (REJECT_ANSWERS_SENT, 2),
                (REJECT_ANSWERS_SUPPRESSED, 1),
                (MATCH_EVENTS_SUPPRESSED, 4)
            ]
        );
    }
}
