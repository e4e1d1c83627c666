//! One cnibpf instance (a `pinPath`): its lock, the backend that serves new attachments and
//! every other backend that holds state. The CNI verbs, `cnibpf gc` and `inspect` work on
//! attachments through it; each backend is worked on even when another fails, and every
//! failure is reported.

pub use crate::backend::Plan;
use crate::{
    backend::{self, Access, AttachmentRecord, Backend, BackendError},
    journal,
    lock::{InstanceLock, LockError, lock_timeout},
    model::{BackendChoice, Capacity},
    paths::PinLayout,
    phases,
};

#[derive(Debug, thiserror::Error)]
pub enum InstanceError {
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// What [`Instance::collect`] removed (committed) and what failed, by backend.
#[derive(Default)]
pub struct Collected {
    pub removed: Vec<(&'static str, AttachmentRecord)>,
    pub failures: Vec<(&'static str, BackendError)>,
}

pub struct Instance {
    /// `None` for a look without changes (inspect).
    _lock: Option<InstanceLock>,
    /// Every backend that holds state under the instance (for an ADD: but the serving one).
    backends: Vec<Box<dyn Backend>>,
}

/// An instance opened by an ADD: the backend chosen to serve the attachment beside the others.
pub struct Serving {
    instance: Instance,
    backend: Box<dyn Backend>,
}

impl Serving {
    /// The lock, the backend `choice` selects (loaded and migrated as need be), and every
    /// other backend holding state.
    pub fn open(
        pins: &PinLayout,
        choice: BackendChoice,
        capacity: &Capacity,
    ) -> Result<Self, InstanceError> {
        let lock = InstanceLock::acquire(&pins.lock_file(), lock_timeout())?;
        phases::mark("lock");
        let backend = backend::select(choice, pins, capacity)?;
        journal::backend(backend.name());
        phases::mark("backend");
        let others = backend::existing_except(pins, Some(backend.name()), Access::Changes)?;
        Ok(Self {
            instance: Instance {
                _lock: Some(lock),
                backends: others,
            },
            backend,
        })
    }

    /// Sets up `plan`'s attachment on the serving backend: complete or, on a failure, absent.
    /// A hostPort held by an attachment of another backend is refused; a re-ADD the other
    /// backend served before moves to this one.
    pub fn add(&mut self, plan: &Plan) -> Result<(), BackendError> {
        let backend = &mut self.backend;
        let owner = plan.attachment.owner_id();
        // A hostPort may be held by an attachment of either backend: the others' are checked
        // here, the serving backend's own refuses in its apply, atomically with claiming.
        for other in &mut self.instance.backends {
            backend::refuse_held_host_ports(other.as_mut(), owner, &plan.mappings)?;
            // What it reclaimed from attachments whose interface is gone.
            other.commit()?;
        }
        phases::mark("other backends");
        backend.apply(plan)?;
        for mapping in &plan.mappings {
            journal::note(journal::Change::HostPortHeld(mapping.to_string()));
        }
        // A re-ADD served by the other backend (the host gained or lost BPF, or `backend`
        // changed) moves the attachment: what the previous backend holds of it goes, once the
        // new one serves it.
        for other in &mut self.instance.backends {
            if other.holds(owner)? {
                other.remove(owner)?;
                other.commit()?;
            }
        }
        Ok(())
    }
}

impl Instance {
    /// For DEL, CHECK, GC and `cnibpf gc`: the lock and every backend holding state.
    pub fn to_change(pins: &PinLayout) -> Result<Self, InstanceError> {
        let lock = InstanceLock::acquire(&pins.lock_file(), lock_timeout())?;
        phases::mark("lock");
        let others = backend::existing(pins, Access::Changes)?;
        phases::mark("backend");
        Ok(Self {
            _lock: Some(lock),
            backends: others,
        })
    }

    /// For `install --watch`, as the host changes: every backend holding state takes the
    /// node's addresses anew (a wildcard hostPort listens on them, never on an address of
    /// `service_interfaces`), and the nftables tables a firewall reload took are made again
    /// (opening the instance for changes does that). Nothing to do for an instance without
    /// state.
    pub fn follow_host(
        pins: &PinLayout,
        service_interfaces: &[String],
    ) -> Result<(), InstanceError> {
        let mut instance = Self::to_change(pins)?;
        let mut failures = Vec::new();
        for backend in &mut instance.backends {
            journal::backend(backend.name());
            let outcome = backend
                .refresh_host_addresses(service_interfaces)
                .and_then(|()| backend.commit());
            failures.extend(outcome.err().map(|error| (backend.name(), error)));
        }
        Ok(BackendError::collect(failures)?)
    }

    /// For `inspect`: every backend holding state, looked at without the lock.
    pub fn to_read(pins: &PinLayout) -> Result<Self, BackendError> {
        Ok(Self {
            _lock: None,
            backends: backend::existing(pins, Access::ReadOnly)?,
        })
    }

    /// Every backend of the instance.
    pub fn backends(&self) -> impl Iterator<Item = &dyn Backend> {
        self.backends.iter().map(|backend| backend.as_ref())
    }

    /// Every backend of the instance, to change (under the lock, see [`Self::to_change`]).
    pub fn backends_mut(&mut self) -> impl Iterator<Item = &mut Box<dyn Backend>> {
        self.backends.iter_mut()
    }

    /// Whether any backend holds the attachment `owner`. A state that cannot be read is an
    /// error, never "no".
    pub fn holds(&self, owner: u64) -> Result<bool, BackendError> {
        for backend in self.backends() {
            if backend.holds(owner)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Removes the attachment `owner` from every backend (nothing to remove is no failure).
    pub fn remove(&mut self, owner: u64) -> Result<(), BackendError> {
        let mut failures = Vec::new();
        for backend in &mut self.backends {
            journal::backend(backend.name());
            let removed = backend.remove(owner);
            phases::mark("remove");
            let committed = backend.commit();
            phases::mark("commit");
            failures.extend(
                [removed, committed]
                    .into_iter()
                    .filter_map(Result::err)
                    .map(|error| (backend.name(), error)),
            );
        }
        BackendError::collect(failures)
    }

    /// Compares the backend that holds `plan`'s attachment, whichever the configuration asks
    /// for now, with the plan (and refreshes the uplinks' addresses: CHECK is how an operator
    /// makes a changed one take effect).
    pub fn check(&mut self, plan: &Plan, pins: &PinLayout) -> Result<(), BackendError> {
        let owner = plan.attachment.owner_id();
        let mut serving = None;
        for (position, backend) in self.backends.iter().enumerate() {
            if backend.holds(owner)? {
                serving = Some(position);
                break;
            }
        }
        let Some(backend) = serving.and_then(|position| self.backends.get_mut(position)) else {
            // A backend that cannot list its attachments (a datapath another network namespace
            // serves) says why none holds it.
            for backend in &self.backends {
                backend.attachments()?;
            }
            // fail-closed: no backend holds it; the error says so.
            return Err(BackendError::CheckFailed(format!(
                "no backend holds state for {} (pinPath {}, table inet cnibpf)",
                plan.attachment,
                pins.root().display()
            )));
        };
        journal::backend(backend.name());
        backend.check(plan)
    }

    /// Garbage collection on every backend: the attachments `stale` says are stale are
    /// removed, expired connection state is swept, and the backend commits. An attachment
    /// `stale` cannot tell counts as live (its error is a failure); one backend's failures
    /// keep none of the others from being collected. What a backend removed counts once its
    /// commit went through.
    pub fn collect(
        &mut self,
        mut stale: impl FnMut(&AttachmentRecord) -> Result<bool, BackendError>,
    ) -> Collected {
        let mut collected = Collected::default();
        for backend in &mut self.backends {
            journal::backend(backend.name());
            let mut removed = Vec::new();
            match backend.attachments() {
                Ok(records) => {
                    for record in records {
                        let outcome = stale(&record).and_then(|gone| {
                            if gone {
                                backend.remove(record.owner)?;
                            }
                            Ok(gone)
                        });
                        match outcome {
                            Ok(false) => {}
                            Ok(true) => removed.push(record),
                            Err(error) => collected.failures.push((backend.name(), error)),
                        }
                    }
                }
                Err(error) => collected.failures.push((backend.name(), error)),
            }
            let swept = backend.sweep_expired();
            // What the nftables backend removed is in once its transaction is.
            match backend.commit() {
                Ok(()) => collected
                    .removed
                    .extend(removed.into_iter().map(|record| (backend.name(), record))),
                Err(error) => collected.failures.push((backend.name(), error)),
            }
            collected
                .failures
                .extend(swept.err().map(|error| (backend.name(), error)));
        }
        collected
    }
}
