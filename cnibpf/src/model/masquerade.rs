//! Masquerade as an attachment asks for it: which of its addresses, never towards which
//! destinations, and why.

use std::{fmt, net::IpAddr};

pub use cnibpf_common::masquerade::excludes::Reason as ExcludeReason;
use ipnet::IpNet;

/// How one attachment is masqueraded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Masquerade {
    /// The container's addresses whose traffic is masqueraded.
    pub sources: Vec<IpAddr>,
    /// Destinations never masqueraded, and why.
    pub excludes: Vec<(IpNet, ExcludeReason)>,
}

/// Why a destination is never masqueraded, as inspect shows it.
pub struct ReasonText(pub ExcludeReason);

impl fmt::Display for ReasonText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            ExcludeReason::OwnSubnet => "own subnet",
            ExcludeReason::Multicast => "multicast",
            ExcludeReason::Configured => "ipMasqExclude",
        })
    }
}
