//! Endpoints: an attachment's record chain and its element of set `attachments` (keyed by its
//! host-side interface), which also tells whether it is the last one.

use super::{NftablesBackend, host, owner_comment, record_chain};
use crate::backend::{BackendError, Endpoint, Endpoints};

impl Endpoints for NftablesBackend {
    fn setup_endpoint(&mut self, endpoint: &Endpoint) -> Result<(), BackendError> {
        // On a bridge that hands its frames to the IP hooks (one with a filtered container),
        // the container reaches its own hostPorts only with its port in hairpin mode.
        if let Some(bridge) = endpoint.host.master
            && host::bridge_netfilter_is_on(bridge)?
        {
            host::hairpin_on(&endpoint.host.name)?;
        }
        self.attach(endpoint).map(|_| ())
    }

    fn teardown_endpoint(&mut self, owner: u64) -> Result<(), BackendError> {
        let change = self.change(owner)?;
        change.after = None;
        if change.before.is_none() {
            return Ok(());
        }
        // The last attachment takes the table with it, as the eBPF backend's pins go.
        let leaving: Vec<String> = self
            .changes
            .values()
            .filter(|change| change.after.is_none())
            .filter_map(|change| change.before.as_ref().map(|record| record.host.clone()))
            .collect();
        if !host::others_attached(&leaving)? {
            self.delete_table = Some((
                host::interfaces_in("filtered_bridges")?,
                host::interfaces_in("localnet_interfaces")?,
            ));
        }
        Ok(())
    }

    fn check_endpoint(&self, endpoint: &Endpoint) -> Result<(), BackendError> {
        let listing = self.listing()?;
        let chain = record_chain(endpoint.attachment.owner_id());
        let owner = owner_comment(&endpoint.attachment)?;
        let recorded =
            listing.has_chain(&chain) && listing.record(&chain)?.host == endpoint.host.name;
        let listed = listing.elements("attachments").iter().any(|element| {
            element.comment.as_deref() == Some(owner.as_str())
                && matches!(&element.key, nftables::expr::Expression::String(name) if *name == endpoint.host.name)
        });
        if recorded && listed {
            return Ok(());
        }
        Err(BackendError::CheckFailed(format!(
            "{} is not recorded with interface {} in table inet cnibpf",
            endpoint.attachment, endpoint.host.name
        )))
    }
}
