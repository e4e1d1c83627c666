//! Filter rules: one rule as configured, and an attachment's filter.

use std::{fmt, net::IpAddr};

use ipnet::IpNet;

use super::{ConnState, Direction, NetworkName, PortRange, RuleProtocol, Target};

/// A new connection a rule with `log` decided, as either datapath reports it: whose rule,
/// its verdict and direction, and the tuple of the connection's first packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleMatch {
    pub owner: u64,
    pub rule: u32,
    pub target: Target,
    pub direction: Direction,
    pub protocol: u8,
    pub source: IpAddr,
    pub source_port: u16,
    pub destination: IpAddr,
    pub destination_port: u16,
}

/// One validated `filter` rule.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FilterRule {
    pub index: u32,
    pub target: Target,
    pub src: Option<IpNet>,
    pub dst: Option<IpNet>,
    /// The source is an address of an attachment of this network on the node (`srcNetwork`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub src_network: Option<NetworkName>,
    /// The destination is one (`dstNetwork`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dst_network: Option<NetworkName>,
    pub protocol: RuleProtocol,
    pub sport: Option<PortRange>,
    pub dport: Option<PortRange>,
    pub connstate: ConnState,
    pub direction: Direction,
    /// Each new connection the rule decides is reported (`cnibpf monitor --matches`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub log: bool,
}

impl FilterRule {
    /// Rule `index` matching every packet of `direction`, its verdict `target`: what a rule
    /// is before its keys narrow it.
    pub fn matching_all(index: u32, target: Target, direction: Direction) -> Self {
        Self {
            index,
            target,
            src: None,
            dst: None,
            src_network: None,
            dst_network: None,
            protocol: RuleProtocol::Any,
            sport: None,
            dport: None,
            connstate: ConnState::Any,
            direction,
            log: false,
        }
    }
}

/// A rule's match in the words of its configuration ("any" when it matches everything).
impl fmt::Display for FilterRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(src) = self.src {
            parts.push(format!("src {src}"));
        }
        if let Some(dst) = self.dst {
            parts.push(format!("dst {dst}"));
        }
        if let Some(network) = &self.src_network {
            parts.push(format!("srcNetwork {network}"));
        }
        if let Some(network) = &self.dst_network {
            parts.push(format!("dstNetwork {network}"));
        }
        if self.protocol != RuleProtocol::Any {
            parts.push(self.protocol.to_string());
        }
        if let Some(range) = self.sport {
            parts.push(format!("sport {range}"));
        }
        if let Some(range) = self.dport {
            parts.push(format!("dport {range}"));
        }
        if self.connstate != ConnState::Any {
            parts.push(self.connstate.to_string());
        }
        if self.direction != Direction::Both {
            parts.push(self.direction.to_string());
        }
        if self.log {
            parts.push("log".to_owned());
        }
        if parts.is_empty() {
            f.write_str("any")
        } else {
            f.write_str(&parts.join(" "))
        }
    }
}

/// An attachment's filter: its rules in evaluation order (ascending `index`) and the verdict
/// when none matches.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Filter {
    pub rules: Vec<FilterRule>,
    pub default: Target,
}

/// One change of an attachment's rules (`cnibpf filter apply`), validated as a rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RuleChange {
    /// Adds the rule at its index, which no rule may hold.
    Insert(FilterRule),
    /// Adds the rule after the last: at its index, past the last rule's, or (not given) at the
    /// next multiple of [`APPEND_STEP`] past it.
    Append { rule: FilterRule, index_given: bool },
    /// Removes the rule at `index`, which must be that rule when `matching` gives one.
    Delete {
        index: u32,
        matching: Option<FilterRule>,
    },
}

/// The spacing of the indexes `append` picks, as the CNI filter proposal numbers its rules
/// (10, 20, …, leaving room to insert between them).
pub const APPEND_STEP: u32 = 10;

/// Why a list of changes does not apply to an attachment's rules: the change (by its position
/// in the list) and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChangeRefused {
    pub key: String,
    pub reason: String,
}

impl Filter {
    /// The filter after `changes`, applied in order, all or none; with what each did, in
    /// words (`inserted rule 15`).
    pub fn changed(
        &self,
        changes: &[RuleChange],
        max_rules: usize,
    ) -> Result<(Self, Vec<String>), ChangeRefused> {
        let mut rules = self.rules.clone();
        let mut done = Vec::new();
        for (position, change) in changes.iter().enumerate() {
            let refused = |key: &str, reason: String| ChangeRefused {
                key: format!("filter[{position}]{key}"),
                reason,
            };
            match change {
                RuleChange::Insert(rule) => {
                    if rules.iter().any(|held| held.index == rule.index) {
                        return Err(refused(
                            ".index",
                            format!("index {} is already used by a rule", rule.index),
                        ));
                    }
                    rules.push(rule.clone());
                    done.push(format!("inserted rule {}", rule.index));
                }
                RuleChange::Append { rule, index_given } => {
                    let last = rules.iter().map(|held| held.index).max();
                    let index = match (index_given, last) {
                        (true, Some(last)) if rule.index <= last => {
                            return Err(refused(
                                ".index",
                                format!(
                                    "index {} is not past the last rule's ({last}): insert puts a rule between others",
                                    rule.index
                                ),
                            ));
                        }
                        (true, _) => rule.index,
                        (false, None) => APPEND_STEP,
                        (false, Some(last)) => (last / APPEND_STEP)
                            .checked_add(1)
                            .and_then(|step| step.checked_mul(APPEND_STEP))
                            .ok_or_else(|| {
                                refused(
                                    ".index",
                                    format!("no index is left past the last rule's ({last})"),
                                )
                            })?,
                    };
                    rules.push(FilterRule {
                        index,
                        ..rule.clone()
                    });
                    done.push(format!("appended rule {index}"));
                }
                RuleChange::Delete { index, matching } => {
                    let Some(at) = rules.iter().position(|held| held.index == *index) else {
                        return Err(refused(".index", format!("no rule has index {index}")));
                    };
                    if let Some(matching) = matching
                        && *matching != rules[at]
                    {
                        return Err(refused(
                            "",
                            format!(
                                "rule {index} is {} {}, not the rule given ({} {})",
                                rules[at], rules[at].target, matching, matching.target
                            ),
                        ));
                    }
                    rules.remove(at);
                    done.push(format!("deleted rule {index}"));
                }
            }
            rules.sort_by_key(|rule| rule.index);
        }
        if rules.len() > max_rules {
            return Err(ChangeRefused {
                key: "filter".to_owned(),
                reason: format!(
                    "{} rules, at most {max_rules} are allowed per attachment",
                    rules.len()
                ),
            });
        }
        Ok((
            Self {
                rules,
                default: self.default,
            },
            done,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(index: u32, target: Target) -> FilterRule {
        FilterRule::matching_all(index, target, Direction::Both)
    }

    fn indexes(filter: &Filter) -> Vec<u32> {
        filter.rules.iter().map(|rule| rule.index).collect()
    }

    #[test]
    fn changes_insert_append_and_delete_in_order_and_keep_the_default() {
        let filter = Filter {
            rules: vec![rule(10, Target::Drop), rule(20, Target::Allow)],
            default: Target::Drop,
        };
        let (changed, done) = filter
            .changed(
                &[
                    RuleChange::Insert(rule(15, Target::Allow)),
                    RuleChange::Append {
                        rule: rule(0, Target::Drop),
                        index_given: false,
                    },
                    RuleChange::Delete {
                        index: 10,
                        matching: Some(rule(10, Target::Drop)),
                    },
                    RuleChange::Append {
                        rule: rule(45, Target::Allow),
                        index_given: true,
                    },
                    RuleChange::Append {
                        rule: rule(0, Target::Allow),
                        index_given: false,
                    },
                ],
                256,
            )
            .expect("applies");
        assert_eq!(indexes(&changed), [15, 20, 30, 45, 50]);
        assert_eq!(changed.default, Target::Drop);
        assert_eq!(
            done,
            [
                "inserted rule 15",
                "appended rule 30",
                "deleted rule 10",
                "appended rule 45",
                "appended rule 50"
            ]
        );
        let (first, _) = Filter {
            rules: Vec::new(),
            default: Target::Allow,
        }
        .changed(
            &[RuleChange::Append {
                rule: rule(0, Target::Drop),
                index_given: false,
            }],
            256,
        )
        .expect("applies");
        assert_eq!(indexes(&first), [APPEND_STEP]);
    }

    #[test]
    fn a_list_with_one_change_that_cannot_apply_changes_nothing_and_names_it() {
        let filter = Filter {
            rules: vec![rule(10, Target::Drop)],
            default: Target::Allow,
        };
        let refused =
            |changes: &[RuleChange], max: usize| filter.changed(changes, max).expect_err("refused");
        let valid_first = RuleChange::Insert(rule(5, Target::Allow));
        assert_eq!(
            refused(
                &[
                    valid_first.clone(),
                    RuleChange::Insert(rule(10, Target::Allow))
                ],
                256
            ),
            ChangeRefused {
                key: "filter[1].index".to_owned(),
                reason: "index 10 is already used by a rule".to_owned()
            }
        );
        let missing = RuleChange::Delete {
            index: 11,
            matching: None,
        };
        assert_eq!(
            refused(&[valid_first.clone(), missing], 256).reason,
            "no rule has index 11"
        );
        let other = RuleChange::Delete {
            index: 10,
            matching: Some(rule(10, Target::Allow)),
        };
        assert_eq!(
            refused(&[other], 256).reason,
            "rule 10 is any DROP, not the rule given (any ALLOW)"
        );
        let behind = RuleChange::Append {
            rule: rule(10, Target::Allow),
            index_given: true,
        };
        assert!(
            refused(&[behind], 256)
                .reason
                .starts_with("index 10 is not past the last rule's (10)")
        );
        assert_eq!(
            refused(&[valid_first], 1).reason,
            "2 rules, at most 1 are allowed per attachment"
        );
        let full = Filter {
            rules: vec![rule(u32::MAX - 3, Target::Drop)],
            default: Target::Allow,
        };
        let append = RuleChange::Append {
            rule: rule(0, Target::Allow),
            index_given: false,
        };
        assert!(
            full.changed(&[append], 256)
                .expect_err("no index left")
                .reason
                .starts_with("no index is left")
        );
    }

    #[test]
    fn a_rule_reads_as_configured() {
        let rule = FilterRule {
            index: 20,
            target: Target::Allow,
            src: None,
            dst: Some("10.22.0.0/16".parse().expect("literal")),
            src_network: Some(NetworkName::new("dmz").expect("valid")),
            dst_network: None,
            protocol: RuleProtocol::Tcp,
            sport: None,
            dport: Some(PortRange { low: 80, high: 90 }),
            connstate: ConnState::New,
            direction: Direction::Ingress,
            log: true,
        };
        assert_eq!(
            rule.to_string(),
            "dst 10.22.0.0/16 srcNetwork dmz tcp dport 80-90 new ingress log"
        );
        let any = FilterRule {
            dst: None,
            src_network: None,
            protocol: RuleProtocol::Any,
            dport: None,
            connstate: ConnState::Any,
            direction: Direction::Both,
            log: false,
            ..rule
        };
        assert_eq!(any.to_string(), "any");
    }
}
