//! `cnibpf monitor` run as a user runs it, its lines read as they come.

use std::{
    io::{BufRead as _, BufReader},
    process::{Child, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use crate::SimHost;

/// `cnibpf monitor` in the host namespace, stdout piped.
pub fn start_monitor(host: &SimHost, json: bool) -> Child {
    let pin_path = host.pin_path.display().to_string();
    let mut args = vec!["monitor", "--pin-path", pin_path.as_str()];
    if json {
        args.push("--json");
    }
    host.cnibpf_command(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start cnibpf monitor")
}

/// The lines a monitor prints, as they come.
pub fn monitor_lines(monitor: &mut Child) -> mpsc::Receiver<String> {
    let stdout = monitor.stdout.take().expect("piped stdout");
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if sender.send(line).is_err() {
                break;
            }
        }
    });
    receiver
}

pub fn first_line_matching(
    lines: &mpsc::Receiver<String>,
    matches: impl Fn(&str) -> bool,
) -> Option<String> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match lines.recv_timeout(left) {
            Ok(line) if matches(&line) => return Some(line),
            Ok(_) => {}
            Err(_) => return None,
        }
    }
    None
}

/// Ctrl-C (SIGINT) ends a monitor cleanly and promptly.
pub fn interrupt(mut monitor: Child) {
    let pid = nix::unistd::Pid::from_raw(monitor.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).expect("SIGINT");
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        if let Some(status) = monitor.try_wait().expect("wait for monitor") {
            assert!(
                status.success(),
                "monitor exits cleanly on Ctrl-C: {status}"
            );
            return;
        }
        assert!(
            Instant::now() < deadline,
            "monitor still running 3 s after Ctrl-C"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A running monitor that a test ends with [`Self::interrupt`]; one still running when it is
/// dropped (its test failed on the way) is killed, so that it holds no instance's lock after.
#[derive(Debug)]
pub struct Monitor {
    child: Option<Child>,
}

impl Monitor {
    /// `cnibpf monitor` with `args` in the host namespace, stdout piped.
    pub fn start(host: &SimHost, args: &[&str]) -> Self {
        let pin_path = host.pin_path.display().to_string();
        let mut all = vec!["monitor", "--pin-path", pin_path.as_str()];
        all.extend(args);
        let child = host
            .cnibpf_command(&all)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start cnibpf monitor");
        Self { child: Some(child) }
    }

    /// The lines it prints, as they come.
    pub fn lines(&mut self) -> mpsc::Receiver<String> {
        monitor_lines(self.child.as_mut().expect("running"))
    }

    /// Ctrl-C, as [`interrupt`].
    pub fn interrupt(mut self) {
        interrupt(self.child.take().expect("running"));
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
