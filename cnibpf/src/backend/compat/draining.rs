//! Backends that only let attachments go: state of a layout this build does not write (a
//! newer eBPF layout, an older nftables table). Nothing is set up, checked or read back there
//! but which attachments it holds; an attachment's hostPorts, masquerade, filter and source
//! check leave with its endpoint, whose teardown each such backend implements itself.

use cnibpf_common::drops::{DropCount, DropReason};

use crate::backend::{
    AttachmentRecord, BackendError, Endpoint, FilterRecord, Filtering, FlowTable, Inspect,
    MasqueradeRecord, Masquerading, PortMappings, SourceCheckRecord, SourceChecking,
    UplinkAddresses,
};
use crate::{
    model::{Filter, Masquerade, ResolvedMapping, SourceCheck},
    netlink::Link,
};

pub trait Draining {
    /// The error every setup, check and read-back answers: what the state is, and that DEL
    /// and GC still release its attachments.
    fn refused(&self) -> BackendError;

    /// The attachments the state still holds, from what every layout keeps of them.
    fn held(&self) -> Result<Vec<AttachmentRecord>, BackendError>;
}

impl<T: Draining> Inspect for T {
    fn attachments(&self) -> Result<Vec<AttachmentRecord>, BackendError> {
        self.held()
    }

    fn port_mappings(&self) -> Result<Vec<(u64, ResolvedMapping)>, BackendError> {
        Err(self.refused())
    }

    fn masquerades(&self) -> Result<Vec<(u64, MasqueradeRecord)>, BackendError> {
        Err(self.refused())
    }

    fn uplink_addresses(&self) -> Result<Vec<UplinkAddresses>, BackendError> {
        Err(self.refused())
    }

    fn filters(&self) -> Result<Vec<(u64, FilterRecord)>, BackendError> {
        Err(self.refused())
    }

    fn source_checks(&self) -> Result<Vec<(u64, SourceCheckRecord)>, BackendError> {
        Err(self.refused())
    }

    fn counters(&self) -> Result<Vec<(&'static str, u64)>, BackendError> {
        Err(self.refused())
    }

    fn drops(&self) -> Result<Option<Vec<(DropReason, DropCount)>>, BackendError> {
        Err(self.refused())
    }

    fn flow_tables(&self) -> Result<Vec<FlowTable>, BackendError> {
        Err(self.refused())
    }
}

impl<T: Draining> PortMappings for T {
    fn setup_port_mappings(
        &mut self,
        _: &Endpoint,
        _: &[ResolvedMapping],
    ) -> Result<(), BackendError> {
        Err(self.refused())
    }

    fn teardown_port_mappings(&mut self, _: u64) -> Result<(), BackendError> {
        Ok(())
    }

    fn check_port_mappings(&self, _: &Endpoint, _: &[ResolvedMapping]) -> Result<(), BackendError> {
        Err(self.refused())
    }

    /// Which hostPorts such state holds is not known here: an ADD served by the other
    /// backend is refused rather than risk a conflict.
    fn holder_of(&self, _: u64, _: &ResolvedMapping) -> Result<Option<u64>, BackendError> {
        Err(self.refused())
    }

    /// Such state takes no new hostPort: nothing follows the node's addresses there.
    fn refresh_host_addresses(&mut self, _: &[String]) -> Result<(), BackendError> {
        Ok(())
    }
}

impl<T: Draining> Masquerading for T {
    fn setup_masquerade(
        &mut self,
        _: &Endpoint,
        _: Option<&Masquerade>,
    ) -> Result<(), BackendError> {
        Err(self.refused())
    }

    fn teardown_masquerade(&mut self, _: u64) -> Result<(), BackendError> {
        Ok(())
    }

    fn check_masquerade(&self, _: &Endpoint, _: Option<&Masquerade>) -> Result<(), BackendError> {
        Err(self.refused())
    }

    fn refresh_uplinks(&mut self, _: &[Link]) -> Result<(), BackendError> {
        Err(self.refused())
    }
}

impl<T: Draining> Filtering for T {
    fn setup_filter(&mut self, _: &Endpoint, _: Option<&Filter>) -> Result<(), BackendError> {
        Err(self.refused())
    }

    fn teardown_filter(&mut self, _: u64) -> Result<(), BackendError> {
        Ok(())
    }

    fn check_filter(&self, _: &Endpoint, _: Option<&Filter>) -> Result<(), BackendError> {
        Err(self.refused())
    }
}

impl<T: Draining> SourceChecking for T {
    fn setup_source_check(
        &mut self,
        _: &Endpoint,
        _: Option<&SourceCheck>,
    ) -> Result<(), BackendError> {
        Err(self.refused())
    }

    fn teardown_source_check(&mut self, _: u64) -> Result<(), BackendError> {
        Ok(())
    }

    fn check_source_check(
        &self,
        _: &Endpoint,
        _: Option<&SourceCheck>,
    ) -> Result<(), BackendError> {
        Err(self.refused())
    }
}
