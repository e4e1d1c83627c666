//! Network namespaces for tests: created with `ip netns add`, removed on drop, entered per
//! thread with `setns` (never `ip netns exec`, which remounts /sys and hides bpffs).

use std::{
    fs::File,
    os::fd::AsFd as _,
    path::PathBuf,
    process::{Command, Output},
    thread,
};

use nix::sched::{CloneFlags, setns};

#[derive(Debug)]
pub struct Netns {
    name: String,
    path: PathBuf,
    /// Created here (and deleted on drop), or only entered (a runtime's pod namespace).
    owned: bool,
}

impl Netns {
    pub fn create(name: &str) -> Self {
        // A namespace left over by an earlier, killed run of the same test would make `add` fail.
        let _ = Command::new("ip").args(["netns", "del", name]).output();
        run_checked(Command::new("ip").args(["netns", "add", name]));
        let netns = Self {
            name: name.to_owned(),
            path: PathBuf::from(format!("/run/netns/{name}")),
            owned: true,
        };
        netns.exec(&["ip", "link", "set", "lo", "up"]);
        // Duplicate address detection would hold every new IPv6 address back for a second or
        // two, and the reference plugins wait for it; these namespaces are private links.
        netns.sysctl("net.ipv6.conf.all.accept_dad", "0");
        netns.sysctl("net.ipv6.conf.default.accept_dad", "0");
        netns
    }

    /// A namespace someone else made (a runtime's pod), entered by its path and left in
    /// place on drop.
    pub fn at(path: &std::path::Path) -> Self {
        Self {
            name: path.display().to_string(),
            path: path.to_owned(),
            owned: false,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> PathBuf {
        self.path.clone()
    }

    /// Runs a command inside the namespace (and only its network namespace), panicking with
    /// its output when it fails.
    pub fn exec(&self, argv: &[&str]) -> String {
        let output = run_checked(&mut self.command(argv));
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// A command that runs inside the namespace, for callers that inspect failures themselves.
    pub fn command(&self, argv: &[&str]) -> Command {
        let mut command = Command::new("nsenter");
        command
            .arg(format!("--net={}", self.path().display()))
            .arg("--");
        command.args(argv);
        command
    }

    /// Runs `work` on a new thread that has entered this namespace.
    pub fn spawn<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> thread::JoinHandle<T> {
        let path = self.path();
        thread::spawn(move || {
            let file = File::open(&path)
                .unwrap_or_else(|error| panic!("open {}: {error}", path.display()));
            setns(file.as_fd(), CloneFlags::CLONE_NEWNET)
                .unwrap_or_else(|error| panic!("setns {}: {error}", path.display()));
            work()
        })
    }

    /// Runs `work` inside this namespace and waits for its result.
    pub fn run<T: Send + 'static>(&self, work: impl FnOnce() -> T + Send + 'static) -> T {
        self.spawn(work)
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }

    /// The MAC address of interface `ifname` of this namespace.
    pub fn mac(&self, ifname: &str) -> [u8; 6] {
        let line = self.exec(&["ip", "-o", "link", "show", "dev", ifname]);
        let text = line
            .split_whitespace()
            .skip_while(|word| *word != "link/ether")
            .nth(1)
            .unwrap_or_else(|| panic!("no MAC address of {ifname} in {line:?}"));
        let mut mac = [0u8; 6];
        for (byte, part) in mac.iter_mut().zip(text.split(':')) {
            *byte = u8::from_str_radix(part, 16).expect("a MAC address");
        }
        mac
    }

    /// Writes a sysctl of this namespace.
    pub fn sysctl(&self, key: &str, value: &str) {
        self.exec(&["sysctl", "-q", "-w", &format!("{key}={value}")]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

pub fn run_checked(command: &mut Command) -> Output {
    let output = command
        .output()
        .unwrap_or_else(|error| panic!("could not run {command:?}: {error}"));
    assert!(
        output.status.success(),
        "{command:?} failed ({}):\nstdout: {}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}
