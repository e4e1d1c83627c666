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
