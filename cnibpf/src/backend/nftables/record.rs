//! An attachment's record: everything it holds in the table, kept outside the ruleset in the
//! instance's state file (`store`), from which its part of the ruleset is derived. A firewall
//! reload that flushes the ruleset (`nft flush ruleset`) cannot take it, and the next call of
//! the instance (or `install --watch`) puts the ruleset back from it.

use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::model::{
    ExcludeReason, Filter, Masquerade, Pod, ResolvedMapping, SourceCheck, conditions::Conditions,
};

/// What one attachment holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Record {
    /// `<network>/<ifname>/<container id>`, the comment of every element it owns.
    pub owner: String,
    /// Its host-side interface.
    pub host: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<Pod>,
    /// The container's addresses, with their prefixes.
    pub networks: Vec<IpNet>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "masquerade_form"
    )]
    pub masquerade: Option<Masquerade>,
    /// Hairpin traffic to its hostPorts is masqueraded (`snat` not false).
    #[serde(default)]
    pub hairpin: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mappings: Vec<ResolvedMapping>,
    /// The conditions its IPv4 hostPorts are reached under (chain `c_<owner>`); empty: none,
    /// or no IPv4 hostPort.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions_v4: Conditions,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions_v6: Conditions,
    /// Its filter (chains `f_<owner>_out` and `f_<owner>_in`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter: Option<Filter>,
    /// `cnibpf filter apply` set the filter's rules: they are the attachment's until it is
    /// added again (CHECK verifies them, not its configuration's).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub filter_changed: bool,
    /// Its source check (chain `s_<owner>` of table `netdev cnibpf` when checked).
    #[serde(default)]
    pub sources: Sources,
}

impl Record {
    /// Whether its hostPorts of a family are conditioned (it has chain `c_<owner>`).
    pub fn conditioned(&self) -> bool {
        !self.conditions_v4.is_empty() || !self.conditions_v6.is_empty()
    }

    pub fn conditions(&self, ipv4: bool) -> &Conditions {
        if ipv4 {
            &self.conditions_v4
        } else {
            &self.conditions_v6
        }
    }
}

/// What an attachment's record says of its source check.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Sources {
    /// Nothing: recorded by a cnibpf without source checks (checked from its next ADD).
    #[default]
    Unrecorded,
    /// `sourceCheck: false`.
    Unchecked,
    /// The addresses its container may send from.
    Checked(SourceCheck),
}

/// A masquerade as the record writes it: its sources, and each exclusion with why.
mod masquerade_form {
    use super::{Deserialize, ExcludeReason, IpAddr, IpNet, Masquerade, Serialize};

    #[derive(Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Form {
        sources: Vec<IpAddr>,
        excludes: Vec<Exclusion>,
    }

    #[derive(Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Exclusion {
        net: IpNet,
        reason: Reason,
    }

    #[derive(Clone, Copy, Serialize, Deserialize)]
    #[serde(rename_all = "lowercase")]
    enum Reason {
        Own,
        Multicast,
        Configured,
    }

    impl From<ExcludeReason> for Reason {
        fn from(reason: ExcludeReason) -> Self {
            match reason {
                ExcludeReason::OwnSubnet => Self::Own,
                ExcludeReason::Multicast => Self::Multicast,
                ExcludeReason::Configured => Self::Configured,
            }
        }
    }

    impl From<Reason> for ExcludeReason {
        fn from(reason: Reason) -> Self {
            match reason {
                Reason::Own => Self::OwnSubnet,
                Reason::Multicast => Self::Multicast,
                Reason::Configured => Self::Configured,
            }
        }
    }

    #[expect(
        clippy::ref_option,
        reason = "serde's `with` hands the field as it is declared"
    )]
    pub fn serialize<S: serde::Serializer>(
        masquerade: &Option<Masquerade>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        masquerade
            .as_ref()
            .map(|masquerade| Form {
                sources: masquerade.sources.clone(),
                excludes: masquerade
                    .excludes
                    .iter()
                    .map(|(net, reason)| Exclusion {
                        net: *net,
                        reason: (*reason).into(),
                    })
                    .collect(),
            })
            .serialize(serializer)
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<Masquerade>, D::Error> {
        Ok(
            Option::<Form>::deserialize(deserializer)?.map(|form| Masquerade {
                sources: form.sources,
                excludes: form
                    .excludes
                    .into_iter()
                    .map(|exclusion| (exclusion.net, exclusion.reason.into()))
                    .collect(),
            }),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{
        ConnState, Direction, FilterRule, PortRange, Protocol, RuleProtocol, Target,
        conditions::{Condition, Subject},
    };

    fn literal<T: std::str::FromStr>(text: &str) -> T
    where
        T::Err: std::fmt::Debug,
    {
        text.parse().expect("literal")
    }

    #[test]
    fn a_full_record_reads_back_whole() {
        let record = Record {
            owner: "net/eth0/c0ffee".to_owned(),
            host: "veth0123456789a".to_owned(),
            pod: Some(Pod {
                namespace: "shop".to_owned(),
                name: "web-0".to_owned(),
            }),
            networks: vec![literal("10.22.0.2/16"), literal("fd00:22::2/64")],
            masquerade: Some(Masquerade {
                sources: vec![literal("10.22.0.2"), literal("fd00:22::2")],
                excludes: vec![
                    (literal("224.0.0.0/4"), ExcludeReason::Multicast),
                    (literal("10.22.0.0/16"), ExcludeReason::OwnSubnet),
                    (literal("192.168.0.0/16"), ExcludeReason::Configured),
                ],
            }),
            hairpin: true,
            mappings: vec![ResolvedMapping {
                protocol: Protocol::Sctp,
                host_addr: Some(literal("203.0.113.1")),
                host_port: 9,
                container_addr: literal("10.22.0.2"),
                container_port: 90,
            }],
            conditions_v4: vec![Condition {
                negated: true,
                subject: Subject::Source(vec![literal("172.64.0.0/13")]),
            }],
            conditions_v6: Vec::new(),
            filter: Some(Filter {
                rules: vec![FilterRule {
                    index: 20,
                    target: Target::Drop,
                    src: None,
                    dst: Some(literal("10.22.0.0/16")),
                    src_network: None,
                    dst_network: None,
                    log: false,
                    protocol: RuleProtocol::Tcp,
                    sport: None,
                    dport: Some(PortRange { low: 80, high: 90 }),
                    connstate: ConnState::New,
                    direction: Direction::Ingress,
                }],
                default: Target::Allow,
            }),
            filter_changed: true,
            sources: Sources::Checked(SourceCheck::new([
                literal::<IpAddr>("10.22.0.2"),
                literal("fe80::1"),
            ])),
        };
        let json = serde_json::to_string(&record).expect("serialisable");
        assert_eq!(
            serde_json::from_str::<Record>(&json).expect("readable"),
            record,
            "{json}"
        );
    }

    #[test]
    fn each_source_check_state_reads_back_as_itself() {
        for sources in [
            Sources::Unrecorded,
            Sources::Unchecked,
            // Without addresses, still a check: everything is dropped.
            Sources::Checked(SourceCheck::default()),
        ] {
            let record = Record {
                owner: "n/eth0/c".to_owned(),
                host: "veth1".to_owned(),
                sources: sources.clone(),
                ..Record::default()
            };
            let json = serde_json::to_string(&record).expect("serialisable");
            let read: Record = serde_json::from_str(&json).expect("readable");
            assert_eq!(read.sources, sources);
        }
    }

    #[test]
    fn an_unknown_key_is_an_error_not_a_default() {
        let error = serde_json::from_str::<Record>(
            r#"{"owner":"n/eth0/c","host":"veth1","networks":[],"mapings":[]}"#,
        )
        .expect_err("unknown key");
        assert!(error.to_string().contains("mapings"), "{error}");
    }
}
