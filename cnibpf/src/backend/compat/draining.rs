//! Backends that only let attachments go: state of a layout this build does not write (a
//! newer eBPF layout, an older nftables table). Nothing is applied, checked or read back there
//! but which attachments it holds; an attachment leaves whole, as each such state releases it.

use cnibpf_common::drops::{DropCount, DropReason};

use crate::{
    backend::{
        AttachmentRecord, Backend, BackendError, FilterRecord, FlowTable, Inspect,
        MasqueradeRecord, NetworkMembers, Plan, SourceCheckRecord, UplinkAddresses,
    },
    model::{Filter, ResolvedMapping},
};

/// State of another layout, as [`Drained`] serves it.
pub trait Draining {
    /// The backend whose state it is.
    fn backend_name(&self) -> &'static str;

    /// The error every apply, check and read-back answers: what the state is, and that DEL
    /// and GC still release its attachments.
    fn refused(&self) -> BackendError;

    /// The attachments the state still holds, from what every layout keeps of them.
    fn held(&self) -> Result<Vec<AttachmentRecord>, BackendError>;

    /// Whether the state holds the attachment `owner`.
    fn holds(&self, owner: u64) -> Result<bool, BackendError> {
        Ok(self.held()?.iter().any(|record| record.owner == owner))
    }

    /// Lets the attachment `owner` go, with all it holds; nothing held is nothing to do.
    fn release(&mut self, owner: u64) -> Result<(), BackendError>;

    /// Makes the releases of this operation take effect (and what is left of the state go
    /// with its last attachment).
    fn commit_releases(&mut self) -> Result<(), BackendError>;
}

/// The four verbs on state of another layout: its attachments are removed and listed, never
/// applied or checked. Its flows are the other build's (or the kernel's) to expire.
pub struct Drained<S>(pub S);

impl<S: Draining> Backend for Drained<S> {
    fn name(&self) -> &'static str {
        self.0.backend_name()
    }

    fn apply(&mut self, _: &Plan) -> Result<(), BackendError> {
        Err(self.0.refused())
    }

    fn remove(&mut self, owner: u64) -> Result<(), BackendError> {
        self.0.release(owner)
    }

    fn check(&mut self, _: &Plan) -> Result<(), BackendError> {
        Err(self.0.refused())
    }

    fn change_filter(&mut self, _: u64, _: &Filter) -> Result<(), BackendError> {
        Err(self.0.refused())
    }

    /// Which hostPorts such state holds is not known here: an ADD served by the other
    /// backend is refused rather than risk a conflict.
    fn holder_of(&self, _: u64, _: &ResolvedMapping) -> Result<Option<u64>, BackendError> {
        Err(self.0.refused())
    }

    /// Such state takes no new hostPort: nothing follows the node's addresses there.
    fn refresh_host_addresses(&mut self, _: &[String]) -> Result<(), BackendError> {
        Ok(())
    }

    fn sweep_expired(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    fn commit(&mut self) -> Result<(), BackendError> {
        self.0.commit_releases()
    }
}

impl<S: Draining> Inspect for Drained<S> {
    fn attachments(&self) -> Result<Vec<AttachmentRecord>, BackendError> {
        self.0.held()
    }

    fn holds(&self, owner: u64) -> Result<bool, BackendError> {
        self.0.holds(owner)
    }

    fn port_mappings(&self) -> Result<Vec<(u64, ResolvedMapping)>, BackendError> {
        Err(self.0.refused())
    }

    fn masquerades(&self) -> Result<Vec<(u64, MasqueradeRecord)>, BackendError> {
        Err(self.0.refused())
    }

    fn uplink_addresses(&self) -> Result<Vec<UplinkAddresses>, BackendError> {
        Err(self.0.refused())
    }

    fn filters(&self) -> Result<Vec<(u64, FilterRecord)>, BackendError> {
        Err(self.0.refused())
    }

    fn source_checks(&self) -> Result<Vec<(u64, SourceCheckRecord)>, BackendError> {
        Err(self.0.refused())
    }

    fn counters(&self) -> Result<Vec<(&'static str, u64)>, BackendError> {
        Err(self.0.refused())
    }

    fn drops(&self) -> Result<Option<Vec<(DropReason, DropCount)>>, BackendError> {
        Err(self.0.refused())
    }

    fn flow_tables(&self) -> Result<Vec<FlowTable>, BackendError> {
        Err(self.0.refused())
    }

    fn network_members(&self) -> Result<Vec<NetworkMembers>, BackendError> {
        Err(self.0.refused())
    }
}
