//! Masquerade: the source and exclusion sets that chain `postrouting` consults, and set
//! `uplinks`.

use super::{NftablesBackend, owner_comment};
use crate::{
    backend::{BackendError, Endpoint, Masquerading},
    model::Masquerade,
    netlink::Link,
};

impl Masquerading for NftablesBackend {
    fn setup_masquerade(
        &mut self,
        endpoint: &Endpoint,
        masquerade: Option<&Masquerade>,
    ) -> Result<(), BackendError> {
        if let Some(after) = self.attach(endpoint)?.after.as_mut() {
            after.masquerade = masquerade.cloned();
        }
        Ok(())
    }

    fn teardown_masquerade(&mut self, owner: u64) -> Result<(), BackendError> {
        if let Some(after) = self.change(owner)?.after.as_mut() {
            after.masquerade = None;
        }
        Ok(())
    }

    fn check_masquerade(
        &self,
        endpoint: &Endpoint,
        masquerade: Option<&Masquerade>,
    ) -> Result<(), BackendError> {
        let listing = self.listing()?;
        let owner = owner_comment(&endpoint.attachment)?;
        let mut installed: Vec<String> = ["masq_sources4", "masq_sources6"]
            .iter()
            .flat_map(|set| listing.elements(set))
            .filter(|element| element.comment.as_deref() == Some(owner.as_str()))
            .filter_map(|element| super::nft::address_of(&element.key).map(|addr| addr.to_string()))
            .collect();
        let mut wanted: Vec<String> = masquerade
            .map(|masquerade| masquerade.sources.iter().map(ToString::to_string).collect())
            .unwrap_or_default();
        installed.sort();
        wanted.sort();
        if installed != wanted {
            return Err(BackendError::CheckFailed(format!(
                "the masquerade of {} differs from its configuration",
                endpoint.attachment
            )));
        }
        Ok(())
    }

    fn refresh_uplinks(&mut self, uplinks: &[Link]) -> Result<(), BackendError> {
        for uplink in uplinks {
            if !self.uplinks.contains(&uplink.name) {
                self.uplinks.push(uplink.name.clone());
            }
        }
        Ok(())
    }
}
