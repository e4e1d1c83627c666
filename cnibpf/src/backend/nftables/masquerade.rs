//! Masquerade: the source and exclusion sets that chain `postrouting` consults, and set
//! `uplinks`.

use std::net::IpAddr;

use ipnet::IpNet;

use super::{Element, MASQUERADE_SETS, NftablesBackend, family_suffix, owner_comment};
use crate::{
    backend::{BackendError, Endpoint, Masquerading},
    model::{ExcludeReason, Masquerade},
    netlink::Link,
};

impl Masquerading for NftablesBackend {
    fn setup_masquerade(
        &mut self,
        endpoint: &Endpoint,
        masquerade: Option<&Masquerade>,
    ) -> Result<(), BackendError> {
        let owner = owner_comment(&endpoint.attachment)?;
        self.ensure_table();
        self.delete_elements(&owner, &MASQUERADE_SETS);
        let Some(masquerade) = masquerade else {
            return Ok(());
        };
        for source in &masquerade.sources {
            let suffix = family_suffix(*source);
            self.add_element(
                &format!("masq_sources{suffix}"),
                source.to_string(),
                None,
                &owner,
            );
            for (net, _) in &masquerade.excludes {
                if net.addr().is_ipv4() == source.is_ipv4() {
                    self.add_element(
                        &format!("masq_excludes{suffix}"),
                        format!("{source} . {}", net.trunc()),
                        None,
                        &owner,
                    );
                }
            }
        }
        Ok(())
    }

    fn teardown_masquerade(&mut self, owner: u64) -> Result<(), BackendError> {
        if let Some(text) = self.owner_text(owner) {
            self.delete_elements(&text, &MASQUERADE_SETS);
        }
        Ok(())
    }

    fn check_masquerade(
        &self,
        endpoint: &Endpoint,
        masquerade: Option<&Masquerade>,
    ) -> Result<(), BackendError> {
        let owner = owner_comment(&endpoint.attachment)?;
        let sources: Vec<&Element> = self
            .elements_of(&owner, &["masq_sources4", "masq_sources6"])
            .collect();
        let expected = masquerade.map_or(0, |masquerade| masquerade.sources.len());
        let all_there = masquerade.is_none_or(|masquerade| {
            masquerade.sources.iter().all(|source| {
                sources
                    .iter()
                    .any(|element| element.key_parts == [source.to_string()])
            })
        });
        if sources.len() != expected || !all_there {
            return Err(BackendError::CheckFailed(format!(
                "the masquerade of {} differs from its configuration",
                endpoint.attachment
            )));
        }
        Ok(())
    }

    fn refresh_uplinks(&mut self, uplinks: &[Link]) -> Result<(), BackendError> {
        self.ensure_table();
        for uplink in uplinks {
            let known = self.elements.iter().any(|element| {
                element.set == "uplinks" && element.key_parts == [uplink.name.clone()]
            });
            if !known {
                self.add_element("uplinks", format!("\"{}\"", uplink.name), None, "uplink");
            }
        }
        Ok(())
    }
}

/// Why a destination is excluded from masquerade, told from the destination itself.
pub(super) fn exclude_reason(net: &IpNet, sources: &[IpAddr]) -> ExcludeReason {
    let multicast = match net {
        IpNet::V4(net) => net.addr().is_multicast(),
        IpNet::V6(net) => net.addr().is_multicast(),
    };
    if multicast {
        ExcludeReason::Multicast
    } else if sources.iter().any(|source| net.contains(source)) {
        ExcludeReason::OwnSubnet
    } else {
        ExcludeReason::Configured
    }
}
