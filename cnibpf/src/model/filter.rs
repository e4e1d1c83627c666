//! Filter rules: one rule as configured, and an attachment's filter.

use std::fmt;

use ipnet::IpNet;

use super::{ConnState, Direction, PortRange, RuleProtocol, Target};

/// One validated `filter` rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FilterRule {
    pub index: u32,
    pub target: Target,
    pub src: Option<IpNet>,
    pub dst: Option<IpNet>,
    pub protocol: RuleProtocol,
    pub sport: Option<PortRange>,
    pub dport: Option<PortRange>,
    pub connstate: ConnState,
    pub direction: Direction,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rule_reads_as_configured() {
        let rule = FilterRule {
            index: 20,
            target: Target::Allow,
            src: None,
            dst: Some("10.22.0.0/16".parse().expect("literal")),
            protocol: RuleProtocol::Tcp,
            sport: None,
            dport: Some(PortRange { low: 80, high: 90 }),
            connstate: ConnState::New,
            direction: Direction::Ingress,
        };
        assert_eq!(
            rule.to_string(),
            "dst 10.22.0.0/16 tcp dport 80-90 new ingress"
        );
        let any = FilterRule {
            dst: None,
            protocol: RuleProtocol::Any,
            dport: None,
            connstate: ConnState::Any,
            direction: Direction::Both,
            ..rule
        };
        assert_eq!(any.to_string(), "any");
    }
}
