//! The filter: one chain pair per attachment (`f_<owner>_out`, `f_<owner>_in`) holding its rules
//! in index order, reached through the dispatch maps by container address (`write`). Each rule
//! is typed nft matches with a counter, its comment `rule <index>`; inspect and CHECK read the
//! rule back from its matches (`read`), so what they show is what the kernel runs, whole.
//!
//! Containers on one bridge reach each other without the IP stack: the bridge is switched to
//! hand its frames to the IP hooks (`nf_call_iptables`, `nf_call_ip6tables`, br_netfilter) so
//! that their filters judge that traffic too, statefully, as every other.

mod read;
pub mod write;

pub use self::read::filter_of;
use super::{NftablesBackend, hooks::Hooks, host, listing::Counters, owner_comment};
use crate::{
    backend::{BackendError, Endpoint, Filtering},
    model::Filter,
    netlink,
};

impl Filtering for NftablesBackend {
    fn setup_filter(
        &mut self,
        endpoint: &Endpoint,
        filter: Option<&Filter>,
    ) -> Result<(), BackendError> {
        if filter.is_some() && endpoint.gateway_ifindex != endpoint.host.index {
            self.filter_on_bridge(endpoint.gateway_ifindex)?;
        }
        let Some(filter) = filter else {
            // Unfiltered: nothing to add, and no record to start (an ADD's undo ends here).
            return self.teardown_filter(endpoint.attachment.owner_id());
        };
        if let Some(after) = self.attach(endpoint)?.after.as_mut() {
            after.filter = Some(filter.clone());
            after.filter_changed = false;
        }
        Ok(())
    }

    fn change_filter(&mut self, owner: u64, filter: &Filter) -> Result<(), BackendError> {
        // Refused before anything of the operation changes.
        let record = self.store.record(owner).ok_or(BackendError::NotRecorded)?;
        if record.filter.is_none() {
            // Its first rules: on a bridge, as an ADD's filter is set up.
            let host = record.host.clone();
            let port = netlink::link_if_there_by_name(&host).map_err(|source| {
                BackendError::Interface {
                    action: format!("could not look up interface {host}"),
                    source: Box::new(source),
                }
            })?;
            if let Some(bridge) = port.and_then(|port| port.master) {
                self.filter_on_bridge(bridge)?;
            }
        }
        let kept = Counters::of(self.listing()?);
        let change = self.change(owner);
        if let Some(after) = change.after.as_mut() {
            after.filter = Some(filter.clone());
            after.filter_changed = true;
        }
        change.kept_counters = Some(kept);
        Ok(())
    }

    fn teardown_filter(&mut self, owner: u64) -> Result<(), BackendError> {
        if let Some(after) = self.change(owner).after.as_mut() {
            after.filter = None;
        }
        Ok(())
    }

    fn check_filter(
        &self,
        endpoint: &Endpoint,
        filter: Option<&Filter>,
    ) -> Result<(), BackendError> {
        let listing = self.listing()?;
        let owner = endpoint.attachment.owner_id();
        let installed = filter_of(listing, owner)
            .map_err(|error| {
                BackendError::CheckFailed(format!("{}: {error}", endpoint.attachment))
            })?
            .map(|record| record.filter);
        // Rules a live change set are the attachment's, as its record holds them.
        let filter = match self.store.record(owner) {
            Some(record) if record.filter_changed => record.filter.as_ref(),
            _ => filter,
        };
        let owner_text = owner_comment(&endpoint.attachment)?;
        let dispatched = ["filter_out4", "filter_in4", "filter_out6", "filter_in6"]
            .iter()
            .flat_map(|map| listing.elements(map))
            .filter(|element| element.comment.as_deref() == Some(owner_text.as_str()))
            .count();
        // fail-closed: an Option of the configuration.
        let wanted_dispatch = filter.map_or(0, |_| endpoint.container_networks.len() * 2);
        if filter.is_some() && !Hooks::of_listing(listing).filter {
            return Err(BackendError::CheckFailed(format!(
                "the filter of {} is not hooked (chain forward is missing)",
                endpoint.attachment
            )));
        }
        if installed.as_ref() != filter || dispatched != wanted_dispatch {
            return Err(BackendError::CheckFailed(format!(
                "the filter of {} differs from its configuration",
                endpoint.attachment
            )));
        }
        Ok(())
    }
}

impl NftablesBackend {
    /// A filter on a container of the bridge `gateway_ifindex` (when it is a bridge whose
    /// frames reach the IP hooks): the ports of the attachments on it reach their own
    /// hostPorts from now on only through their hairpin mode (see `host::hairpin_on`), and
    /// the bridge is recorded as filtered.
    fn filter_on_bridge(&mut self, gateway_ifindex: u32) -> Result<(), BackendError> {
        let gateway =
            netlink::link_by_index(gateway_ifindex).map_err(|source| BackendError::Interface {
                action: format!("could not look up bridge {gateway_ifindex}"),
                source: Box::new(source),
            })?;
        if gateway.kind.as_deref() != Some("bridge") || !host::bridge_netfilter_on(&gateway)? {
            return Ok(());
        }
        let ports: Vec<String> = self
            .store
            .records()
            .map(|(_, record)| record.host.clone())
            .collect();
        for port in ports {
            let on_this_bridge = netlink::link_if_there_by_name(&port)
                .map_err(|source| BackendError::Interface {
                    action: format!("could not look up interface {port}"),
                    source: Box::new(source),
                })?
                .is_some_and(|link| link.master == Some(gateway.index));
            if on_this_bridge {
                host::hairpin_on(&port)?;
            }
        }
        self.filtered_bridges.push(gateway.name);
        Ok(())
    }
}
