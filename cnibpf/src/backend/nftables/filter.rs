//! The filter: one chain pair per attachment (`f<owner>_out`, `f<owner>_in`) holding its rules
//! in index order, and the dispatch maps that jump to them by container address.

use ipnet::IpNet;

use super::{
    COMMENT_MAX, FILTER_MAPS, NftablesBackend, TABLE, family_suffix, owner_comment, parse_owner,
};
use crate::{
    backend::{BackendError, Endpoint, Filtering},
    model::{ConnState, Direction, Filter, FilterRule, RuleProtocol, Target},
};

impl NftablesBackend {
    fn remove_filter_chains(&mut self, owner: &str) {
        self.delete_elements(owner, &FILTER_MAPS);
        for chain in filter_chains(owner) {
            if self.chains.contains(&chain) {
                self.script.push(format!("delete chain {TABLE} {chain}"));
                self.chains.retain(|known| *known != chain);
                self.rules.retain(|rule| rule.chain != chain);
            }
        }
    }
}

impl Filtering for NftablesBackend {
    fn setup_filter(
        &mut self,
        endpoint: &Endpoint,
        filter: Option<&Filter>,
    ) -> Result<(), BackendError> {
        let owner = owner_comment(&endpoint.attachment)?;
        self.ensure_table();
        let Some(filter) = filter else {
            self.remove_filter_chains(&owner);
            return Ok(());
        };
        let [out_chain, in_chain] = filter_chains(&owner);
        for (chain, direction) in [
            (&out_chain, Direction::Egress),
            (&in_chain, Direction::Ingress),
        ] {
            // Flushing and refilling in one transaction: packets see the old rules or the new.
            if self.chains.contains(chain) {
                self.script.push(format!("flush chain {TABLE} {chain}"));
            } else {
                self.script.push(format!("add chain {TABLE} {chain}"));
                self.chains.push(chain.clone());
            }
            self.rules.retain(|rule| rule.chain != *chain);
            let mut lines = vec![
                // Replies of tracked connections and errors about them pass.
                "ct direction reply return".to_owned(),
                "ct state related return".to_owned(),
                // Link-local control, as the eBPF backend lets it pass.
                "icmpv6 type { nd-router-solicit, nd-router-advert, nd-neighbor-solicit, nd-neighbor-advert, nd-redirect, mld-listener-query, mld-listener-report, mld-listener-done, mld2-listener-report } return".to_owned(),
            ];
            for rule in &filter.rules {
                if rule.direction == direction || rule.direction == Direction::Both {
                    lines.push(format!(
                        "{} counter {} comment \"{}\"",
                        rule_match(rule),
                        verdict(rule.target),
                        rule_comment(rule)
                    ));
                }
            }
            lines.push(format!(
                "counter {} comment \"default\"",
                verdict(filter.default)
            ));
            for line in lines {
                self.script.push(format!("add rule {TABLE} {chain} {line}"));
            }
        }
        self.delete_elements(&owner, &FILTER_MAPS);
        for network in &endpoint.container_networks {
            let addr = network.addr();
            let suffix = family_suffix(addr);
            self.add_element(
                &format!("filter_out{suffix}"),
                addr.to_string(),
                Some(format!("jump {out_chain}")),
                &owner,
            );
            self.add_element(
                &format!("filter_in{suffix}"),
                addr.to_string(),
                Some(format!("jump {in_chain}")),
                &owner,
            );
        }
        Ok(())
    }

    fn teardown_filter(&mut self, owner: u64) -> Result<(), BackendError> {
        if let Some(text) = self.owner_text(owner) {
            self.remove_filter_chains(&text);
        }
        Ok(())
    }

    fn check_filter(
        &self,
        endpoint: &Endpoint,
        filter: Option<&Filter>,
    ) -> Result<(), BackendError> {
        let owner = owner_comment(&endpoint.attachment)?;
        let [out_chain, in_chain] = filter_chains(&owner);
        let installed: Vec<&str> = self
            .rules
            .iter()
            .filter(|rule| rule.chain == out_chain || rule.chain == in_chain)
            .filter(|rule| !rule.comment.is_empty())
            .map(|rule| rule.comment.as_str())
            .collect();
        let expected: Vec<String> = filter
            .map(|filter| {
                let mut comments = Vec::new();
                for direction in [Direction::Egress, Direction::Ingress] {
                    comments.extend(
                        filter
                            .rules
                            .iter()
                            .filter(|rule| {
                                rule.direction == direction || rule.direction == Direction::Both
                            })
                            .map(rule_comment),
                    );
                    comments.push("default".to_owned());
                }
                comments
            })
            .unwrap_or_default();
        let dispatched = self.elements_of(&owner, &FILTER_MAPS).count();
        let wanted_dispatch = filter.map_or(0, |_| endpoint.container_networks.len() * 2);
        if installed != expected || dispatched != wanted_dispatch {
            return Err(BackendError::CheckFailed(format!(
                "the filter of {} differs from its configuration",
                endpoint.attachment
            )));
        }
        Ok(())
    }
}

/// The filter chains of an attachment: what it sends (`_out`) and receives (`_in`).
pub(super) fn filter_chains(owner: &str) -> [String; 2] {
    let id = parse_owner(owner).map_or(0, |attachment| attachment.owner_id());
    [format!("f{id:016x}_out"), format!("f{id:016x}_in")]
}

/// A filter rule in nft syntax (without its verdict's counter and comment).
fn rule_match(rule: &FilterRule) -> String {
    let mut parts = Vec::new();
    let family = |net: &IpNet| {
        if matches!(net, IpNet::V4(_)) {
            "ip"
        } else {
            "ip6"
        }
    };
    if let Some(src) = rule.src {
        parts.push(format!("{} saddr {}", family(&src), src.trunc()));
    }
    if let Some(dst) = rule.dst {
        parts.push(format!("{} daddr {}", family(&dst), dst.trunc()));
    }
    if let Some(protocol) = nft_protocol(rule.protocol) {
        parts.push(format!("meta l4proto {protocol}"));
        if let Some(sport) = rule.sport {
            parts.push(format!("th sport {sport}"));
        }
        if let Some(dport) = rule.dport {
            parts.push(format!("th dport {dport}"));
        }
    }
    // nft's conntrack states are spelt as the configuration's.
    if rule.connstate != ConnState::Any {
        parts.push(format!("ct state {}", rule.connstate));
    }
    parts.join(" ")
}

/// nft's name of a rule's protocol (`meta l4proto`); `None` matches any.
fn nft_protocol(protocol: RuleProtocol) -> Option<&'static str> {
    match protocol {
        RuleProtocol::Any => None,
        RuleProtocol::Icmpv6 => Some("ipv6-icmp"),
        other => Some(other.as_str()),
    }
}

/// A rule's verdict in an attachment's chain. ALLOW returns rather than accepts: an accept
/// would end the hook, and the other side's chain (the receiving container's ingress after
/// the sender's egress) must still judge the packet.
fn verdict(target: Target) -> &'static str {
    match target {
        Target::Allow => "return",
        Target::Drop => "drop",
    }
}

/// The comment that identifies a filter rule: its index and its match, so that CHECK and
/// inspect read the rule back as configured.
fn rule_comment(rule: &FilterRule) -> String {
    let mut text = format!(
        "{} {} {}",
        rule.index,
        verdict(rule.target),
        rule_match(rule)
    );
    text.truncate(COMMENT_MAX);
    text
}

/// A filter rule read back from its comment (`rule_comment`): index, verdict, nft match.
pub(super) fn rule_from_comment(
    index: u32,
    comment: &str,
    direction: Direction,
) -> Option<FilterRule> {
    let mut words = comment.split(' ').skip(1);
    let word = words.next()?;
    let target = Target::ALL
        .iter()
        .copied()
        .find(|target| verdict(*target) == word)?;
    let mut rule = FilterRule {
        index,
        target,
        src: None,
        dst: None,
        protocol: RuleProtocol::Any,
        sport: None,
        dport: None,
        connstate: ConnState::Any,
        direction,
    };
    let words: Vec<&str> = words.collect();
    for pair in words.windows(3) {
        match (pair[0], pair[1], pair[2]) {
            ("ip" | "ip6", "saddr", net) => rule.src = net.parse().ok(),
            ("ip" | "ip6", "daddr", net) => rule.dst = net.parse().ok(),
            ("meta", "l4proto", name) => {
                rule.protocol = RuleProtocol::ALL
                    .iter()
                    .copied()
                    .find(|protocol| nft_protocol(*protocol) == Some(name))?;
            }
            ("th", "sport", ports) => rule.sport = ports.parse().ok(),
            ("th", "dport", ports) => rule.dport = ports.parse().ok(),
            ("ct", "state", state) => rule.connstate = state.parse().ok()?,
            _ => {}
        }
    }
    Some(rule)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::PortRange;

    #[test]
    fn a_rule_reads_back_from_its_comment_as_configured() {
        let rule = FilterRule {
            index: 20,
            target: Target::Drop,
            src: Some("10.22.0.0/16".parse().expect("literal")),
            dst: None,
            protocol: RuleProtocol::Tcp,
            sport: None,
            dport: Some(PortRange { low: 80, high: 90 }),
            connstate: ConnState::New,
            direction: Direction::Egress,
        };
        let comment = rule_comment(&rule);
        assert_eq!(
            comment,
            "20 drop ip saddr 10.22.0.0/16 meta l4proto tcp th dport 80-90 ct state new"
        );
        assert_eq!(
            rule_from_comment(20, &comment, Direction::Egress),
            Some(rule)
        );
    }

    #[test]
    fn allow_returns_so_the_other_side_still_judges() {
        assert_eq!(verdict(Target::Allow), "return");
        assert_eq!(verdict(Target::Drop), "drop");
    }
}
