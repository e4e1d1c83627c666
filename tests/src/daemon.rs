//! A long-running cnibpf process a test starts (`install --watch`): stopped as its pod would
//! be, or killed when the test fails before it gets there, so that no test leaves one behind.

use std::process::Child;

#[derive(Debug)]
pub struct Daemon(Child);

impl From<Child> for Daemon {
    fn from(child: Child) -> Self {
        Self(child)
    }
}

impl Daemon {
    /// Stops the process with SIGTERM, as a pod's container is stopped, and checks that it
    /// exits cleanly.
    pub fn terminate(mut self) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(self.0.id()).expect("a pid")),
            nix::sys::signal::Signal::SIGTERM,
        )
        .expect("SIGTERM");
        let status = self.0.wait().expect("wait for the daemon");
        assert!(
            status.success(),
            "the daemon exits cleanly on SIGTERM: {status}"
        );
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}
