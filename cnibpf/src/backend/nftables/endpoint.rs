//! Endpoints: an attachment's record in the state file, its element of set `attachments`
//! (keyed by its host-side interface, for builds that drain a table of a layout they do not
//! write) and its addresses in its network's member sets (`members`).

use super::{NftablesBackend, host, member_set, owner_comment};
use crate::backend::{BackendError, Endpoint, Endpoints};

impl Endpoints for NftablesBackend {
    fn setup_endpoint(&mut self, endpoint: &Endpoint) -> Result<(), BackendError> {
        // On a bridge that hands its frames to the IP hooks — a Kubernetes node's (kube-proxy
        // needs br_netfilter), one with a filtered container — a container reaches its own
        // hostPorts only with its port in hairpin mode. br_netfilter may come on after the
        // ADD (the sysctl is global), so the port of a container with hostPorts gets it
        // whatever the bridge does now, as kubelet's hairpin-veth mode gives it.
        if endpoint.host.master.is_some() && endpoint.host_ports_mapped {
            host::hairpin_on(&endpoint.host.name)?;
        }
        self.attach(endpoint).map(|_| ())
    }

    /// The attachment leaves with the commit; the last one takes the tables with it, as the
    /// eBPF backend's pins go.
    fn teardown_endpoint(&mut self, owner: u64) -> Result<(), BackendError> {
        self.change(owner).after = None;
        Ok(())
    }

    fn check_endpoint(&self, endpoint: &Endpoint) -> Result<(), BackendError> {
        let owner = owner_comment(&endpoint.attachment)?;
        let recorded = self
            .store
            .record(endpoint.attachment.owner_id())
            .is_some_and(|record| record.host == endpoint.host.name);
        let listed = self.listing()?.elements("attachments").iter().any(|element| {
            element.comment.as_deref() == Some(owner.as_str())
                && matches!(&element.key, nftables::expr::Expression::String(name) if *name == endpoint.host.name)
        });
        if !recorded || !listed {
            return Err(BackendError::CheckFailed(format!(
                "{} is not {} with interface {} in table inet cnibpf",
                endpoint.attachment,
                if recorded { "listed" } else { "recorded" },
                endpoint.host.name
            )));
        }
        for net in &endpoint.container_networks {
            let set = member_set(&endpoint.attachment.network, net.addr().is_ipv4());
            // A table an earlier release made has no member sets until this build's first
            // change, which fills them from the records.
            if !self.listing()?.has_set(&set) {
                continue;
            }
            let member = self.listing()?.elements(&set).iter().any(|element| {
                matches!(&element.key, nftables::expr::Expression::String(addr) if *addr == net.addr().to_string())
            });
            if !member {
                return Err(BackendError::CheckFailed(format!(
                    "{} of {} is not a member of its network in set {set}",
                    net.addr(),
                    endpoint.attachment
                )));
            }
        }
        Ok(())
    }
}
