//! The verbs a backend serves (apply, remove, check, and listing through [`Inspect`]) and
//! how a [`Datapath`] serves them from its capabilities.

use super::{
    BackendError, Endpoint, Endpoints, Filtering, Inspect, Masquerading, PortMappings,
    SourceChecking,
};
use crate::model::{Attachment, Filter, Masquerade, ResolvedMapping, SourceCheck};

/// What one attachment is to be, as ADD sets it up and CHECK compares it.
pub struct Plan {
    pub attachment: Attachment,
    pub endpoint: Endpoint,
    pub mappings: Vec<ResolvedMapping>,
    pub masquerade: Option<Masquerade>,
    /// `None`: the attachment is not filtered (no rules, default ALLOW).
    pub filter: Option<Filter>,
    /// `None`: `sourceCheck: false`.
    pub source_check: Option<SourceCheck>,
}

/// A datapath that serves attachments: every capability, what reads them back, and what
/// spans them. [`Backend`]'s verbs are made of its capabilities' steps.
pub trait Datapath:
    Endpoints + PortMappings + Masquerading + Filtering + SourceChecking + Inspect
{
    fn datapath_name(&self) -> &'static str;
    /// Removes expired connection-tracking state of every attachment.
    fn sweep_expired_state(&mut self) -> Result<(), BackendError>;
    /// Applies the changes of this operation. The eBPF backend applies each as it is made (so
    /// it has nothing left to do); the nftables backend collects them into one transaction.
    fn commit_changes(&mut self) -> Result<(), BackendError>;
}

/// A backend as the verbs use it: apply an attachment's plan, remove an attachment, check one
/// against its plan, and list what is there ([`Inspect`]); beside them what spans attachments
/// (a hostPort's holder, the node's addresses, expiry, the commit). Served by every
/// [`Datapath`], and by state of another layout that only lets its attachments go
/// ([`compat::Drained`]).
pub trait Backend: Inspect {
    fn name(&self) -> &'static str;
    /// Makes the attachment exactly what `plan` says — a first ADD, a re-ADD, a repair and a
    /// change alike: complete or, on a failure, absent (its partial work undone).
    fn apply(&mut self, plan: &Plan) -> Result<(), BackendError>;
    /// Removes everything of the attachment `owner`. Every capability is torn down even when
    /// another fails, and its record goes only once they all did: as long as anything of the
    /// attachment is left, a retried DEL or a GC still finds it.
    fn remove(&mut self, owner: u64) -> Result<(), BackendError>;
    /// Compares the attachment with `plan` (and takes the node's and the uplinks' addresses
    /// anew: CHECK is how an operator makes a changed one take effect).
    fn check(&mut self, plan: &Plan) -> Result<(), BackendError>;
    /// Replaces the filter rules of the running attachment `owner` (`cnibpf filter apply`;
    /// see [`Filtering::change_filter`]), in effect once committed: the one change made from
    /// the attachment's state rather than a plan.
    fn change_filter(&mut self, owner: u64, filter: &Filter) -> Result<(), BackendError>;
    /// The attachment, other than `owner`, holding a mapping that overlaps `mapping`.
    fn holder_of(&self, owner: u64, mapping: &ResolvedMapping)
    -> Result<Option<u64>, BackendError>;
    /// Takes the node's addresses as they are now as those a wildcard hostPort listens on.
    fn refresh_host_addresses(&mut self, service_interfaces: &[String])
    -> Result<(), BackendError>;
    /// Removes expired connection-tracking state of every attachment. GC, which runtimes call
    /// periodically, runs it: no daemon runs between CNI calls.
    fn sweep_expired(&mut self) -> Result<(), BackendError>;
    /// Applies the changes of this operation (see [`Datapath::commit_changes`]).
    fn commit(&mut self) -> Result<(), BackendError>;
}

impl<T: Datapath> Backend for T {
    fn name(&self) -> &'static str {
        self.datapath_name()
    }

    fn apply(&mut self, plan: &Plan) -> Result<(), BackendError> {
        let Err(error) = apply_capabilities(self, plan) else {
            return Ok(());
        };
        // Undo: an attachment is either complete or absent. (The filter is found by its
        // interface: the attachment may not be recorded yet; the source check by its owner.)
        let undone = BackendError::collect(
            [
                ("remove", Backend::remove(self, plan.attachment.owner_id())),
                ("unfilter", self.setup_filter(&plan.endpoint, None)),
                ("commit", self.commit_changes()),
            ]
            .into_iter()
            .filter_map(|(step, outcome)| outcome.err().map(|error| (step, error)))
            .collect(),
        );
        Err(match undone {
            Ok(()) => error,
            Err(undo) => BackendError::UndoFailed {
                failed: Box::new(error),
                undo: Box::new(undo),
            },
        })
    }

    fn remove(&mut self, owner: u64) -> Result<(), BackendError> {
        let failures: Vec<(&'static str, BackendError)> = [
            ("masquerade", self.teardown_masquerade(owner)),
            ("port mappings", self.teardown_port_mappings(owner)),
            ("filter", self.teardown_filter(owner)),
            ("source check", self.teardown_source_check(owner)),
        ]
        .into_iter()
        .filter_map(|(step, outcome)| outcome.err().map(|error| (step, error)))
        .collect();
        BackendError::collect(failures)?;
        self.teardown_endpoint(owner)
    }

    fn check(&mut self, plan: &Plan) -> Result<(), BackendError> {
        self.check_endpoint(&plan.endpoint)?;
        self.check_port_mappings(&plan.endpoint, &plan.mappings)?;
        PortMappings::refresh_host_addresses(self, &plan.endpoint.service_interfaces)?;
        self.refresh_uplinks(&plan.endpoint.uplinks)?;
        self.check_masquerade(&plan.endpoint, plan.masquerade.as_ref())?;
        self.check_filter(&plan.endpoint, plan.filter.as_ref())?;
        self.check_source_check(&plan.endpoint, plan.source_check.as_ref())?;
        self.commit_changes()
    }

    fn change_filter(&mut self, owner: u64, filter: &Filter) -> Result<(), BackendError> {
        Filtering::change_filter(self, owner, filter)
    }

    fn holder_of(
        &self,
        owner: u64,
        mapping: &ResolvedMapping,
    ) -> Result<Option<u64>, BackendError> {
        PortMappings::holder_of(self, owner, mapping)
    }

    fn refresh_host_addresses(
        &mut self,
        service_interfaces: &[String],
    ) -> Result<(), BackendError> {
        PortMappings::refresh_host_addresses(self, service_interfaces)
    }

    fn sweep_expired(&mut self) -> Result<(), BackendError> {
        self.sweep_expired_state()
    }

    fn commit(&mut self) -> Result<(), BackendError> {
        self.commit_changes()
    }
}

/// [`Backend::apply`]'s steps, each capability's setup. The filter and the source check go
/// first: once the datapath is hooked onto the interface, no packet may pass unfiltered or
/// unchecked.
fn apply_capabilities<T: Datapath>(datapath: &mut T, plan: &Plan) -> Result<(), BackendError> {
    datapath.setup_filter(&plan.endpoint, plan.filter.as_ref())?;
    crate::phases::mark("filter");
    datapath.setup_source_check(&plan.endpoint, plan.source_check.as_ref())?;
    crate::phases::mark("source check");
    datapath.setup_endpoint(&plan.endpoint)?;
    crate::phases::mark("endpoint");
    PortMappings::refresh_host_addresses(datapath, &plan.endpoint.service_interfaces)?;
    datapath.refresh_uplinks(&plan.endpoint.uplinks)?;
    crate::phases::mark("uplinks");
    datapath.setup_port_mappings(&plan.endpoint, &plan.mappings)?;
    crate::phases::mark("port mappings");
    datapath.setup_masquerade(&plan.endpoint, plan.masquerade.as_ref())?;
    crate::phases::mark("masquerade");
    datapath.commit_changes()?;
    crate::phases::mark("commit");
    Ok(())
}
