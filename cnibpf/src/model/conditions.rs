//! The reference portmap's `conditionsV4` / `conditionsV6` as cnibpf holds them: matches on
//! the client's address, the address it sent to, and the interface it came in on.

use std::fmt;

use ipnet::IpNet;

/// What one condition looks at.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum Subject {
    /// The client's address: in any of these networks.
    Source(Vec<IpNet>),
    /// The address the client sent to.
    Destination(Vec<IpNet>),
    /// The interface the traffic came in on (host processes have none).
    InInterface(String),
}

/// One condition; an attachment's conditions must all hold.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Condition {
    pub negated: bool,
    pub subject: Subject,
}

impl fmt::Display for Condition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nets = |nets: &[IpNet]| {
            nets.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        let not = if self.negated { "not " } else { "" };
        match &self.subject {
            Subject::Source(list) => write!(f, "source {not}in {}", nets(list)),
            Subject::Destination(list) => write!(f, "destination {not}in {}", nets(list)),
            Subject::InInterface(name) => write!(f, "in-interface {not}{name}"),
        }
    }
}

/// The gating conditions of one address family.
pub type Conditions = Vec<Condition>;
