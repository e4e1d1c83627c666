//! What an operator watches, driven as they would: `cnibpf metrics` (or `install --watch
//! --listen`) spawned in the simulated host and asked over HTTP, a real Prometheus server
//! scraping it, the call log read back line by line.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use serde_json::Value;

use crate::{Netns, SimHost, eventually};

/// Where the endpoint listens inside a simulated host's namespace (each has its own).
pub const METRICS_ADDR: &str = "127.0.0.1:9965";

/// A process serving `/metrics`, `/healthz` and `/readyz` in a simulated host; killed on drop.
#[derive(Debug)]
pub struct Endpoint {
    child: Child,
    netns_path: PathBuf,
    pub address: SocketAddr,
}

impl Endpoint {
    /// `cnibpf metrics --listen` for `host`'s pinPath, with `extra` arguments, on
    /// [`METRICS_ADDR`].
    pub fn metrics(host: &SimHost, extra: &[&str]) -> Self {
        let pin_path = host.pin_path.display().to_string();
        let mut args = vec![
            "metrics",
            "--listen",
            METRICS_ADDR,
            "--pin-path",
            pin_path.as_str(),
        ];
        args.extend(extra);
        Self::spawn_at(host, host.cnibpf_command(&args), METRICS_ADDR)
    }

    /// Runs `command` (a cnibpf admin command that serves the endpoint on `address` of
    /// `host`'s namespace) and waits until the endpoint answers.
    pub fn spawn_at(host: &SimHost, mut command: Command, address: &str) -> Self {
        let child = command
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the metrics endpoint");
        let endpoint = Self {
            child,
            netns_path: host.host.path(),
            address: address.parse().expect("an address"),
        };
        assert!(
            eventually(Duration::from_secs(10), || endpoint.get("/healthz").is_ok()),
            "the endpoint never answered"
        );
        endpoint
    }

    /// The status and body of a GET of `path`.
    pub fn get(&self, path: &str) -> Result<(u16, String), String> {
        let netns = Netns::at(&self.netns_path);
        http_get_path(&netns, self.address, path)
    }

    /// The body of `/metrics`, which must answer 200.
    pub fn scrape(&self) -> String {
        match self.get("/metrics") {
            Ok((200, body)) => body,
            other => panic!("/metrics answered {other:?}"),
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP/1.0 GET of `path` on `target` from `netns`: the status and the body.
pub fn http_get_path(
    netns: &Netns,
    target: SocketAddr,
    path: &str,
) -> Result<(u16, String), String> {
    let request = format!("GET {path} HTTP/1.0\r\nHost: cnibpf-test\r\n\r\n");
    netns.run(move || {
        let mut stream = TcpStream::connect_timeout(&target, Duration::from_secs(2))
            .map_err(|error| error.to_string())?;
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .map_err(|error| error.to_string())?;
        stream
            .write_all(request.as_bytes())
            .map_err(|error| error.to_string())?;
        let mut answer = String::new();
        stream
            .read_to_string(&mut answer)
            .map_err(|error| error.to_string())?;
        let status = answer
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse().ok())
            .ok_or_else(|| format!("no status line in {answer:?}"))?;
        let body = answer
            .split_once("\r\n\r\n")
            .map_or("", |(_, body)| body)
            .to_owned();
        Ok((status, body))
    })
}

/// The value of the sample of `name` whose labels include every one of `labels`, in
/// exposition `text`.
pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (metric, label_text) = match series.split_once('{') {
                Some((metric, rest)) => (metric, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            if metric != name {
                return None;
            }
            let has_all = labels
                .iter()
                .all(|(key, value)| label_text.contains(&format!("{key}=\"{value}\"")));
            has_all.then(|| value.parse().ok()).flatten()
        })
}

/// Runs `promtool check metrics` on `text`; its complaints when it refuses.
pub fn promtool_check_metrics(text: &str) -> Result<(), String> {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool (Debian's prometheus package)");
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(text.as_bytes())
        .expect("feed promtool");
    let output = child.wait_with_output().expect("promtool ran");
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

/// Every line of the call log at `path` and its rotated files (`.1` …), oldest first, each
/// parsed as JSON (a line that is not JSON fails the test).
pub fn call_log(path: &Path) -> Vec<Value> {
    let mut files: Vec<PathBuf> = (1..=100)
        .map(|generation| PathBuf::from(format!("{}.{generation}", path.display())))
        .filter(|file| file.exists())
        .collect();
    files.reverse();
    files.push(path.to_owned());
    let mut lines = Vec::new();
    for file in files {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        for line in text.lines() {
            lines.push(serde_json::from_str(line).unwrap_or_else(|error| {
                panic!(
                    "{}: a line that is not JSON ({error}): {line:?}",
                    file.display()
                )
            }));
        }
    }
    lines
}
