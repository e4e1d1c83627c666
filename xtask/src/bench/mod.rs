//! `cargo xtask bench [suite]`: measurements in the simulated host, each reported against a
//! baseline measured in the same run (these machines are noisy), as a table and a PNG chart
//! under `target/bench/`.

mod chart;
mod filter;
mod hot;
mod instructions;
mod isolated;
mod masquerade;
mod nftables;
mod packets;
mod pods;
mod portmap;
mod prices;
mod stats;

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use cnibpf_tests::Netns;
pub use stats::{BpfStats, Hook, Measured, time_per_packet};

/// Seconds of each iperf3 throughput run.
pub const IPERF_SECONDS: u32 = 4;
/// How long each connection-rate measurement counts.
pub const RATE_WINDOW: Duration = Duration::from_secs(3);
/// Concurrent clients of a connection-rate measurement.
pub const RATE_CLIENTS: usize = 2;
/// Clients of the forwarding-bound connection rate, where packets rather than endpoints are
/// the load.
pub const BUSY_CLIENTS: usize = 8;

/// Runs `suite` (every suite when `None`); `older` are commits measured beside the last
/// release by the suites that compare builds (`hot`, `packets`).
pub fn run(suite: Option<&str>, older: &[String]) -> Result<()> {
    let release = crate::workspace_root().join("target/release/cnibpf");
    // SAFETY: set before any thread of this process starts; the simulated host reads it to run
    // the optimised plugin, the build users install.
    unsafe { std::env::set_var("CNIBPF_BIN", &release) };
    let out_dir = crate::workspace_root().join("target/bench");
    std::fs::create_dir_all(&out_dir)?;
    match suite {
        None => {
            portmap::run(&out_dir)?;
            masquerade::run(&out_dir)?;
            nftables::run(&out_dir)?;
            filter::run(&out_dir)?;
            packets::run(&out_dir, older)?;
            pods::run(&out_dir)
        }
        Some("portmap") => portmap::run(&out_dir),
        Some("masquerade") => masquerade::run(&out_dir),
        Some("nftables") => nftables::run(&out_dir),
        Some("filter") => filter::run(&out_dir),
        Some("packets") => packets::run(&out_dir, older),
        Some("hot") => hot::run(&out_dir, older),
        Some("pods") => pods::run(&out_dir),
        Some(other) => {
            bail!(
                "unknown bench suite {other:?}; suites: portmap, masquerade, nftables, filter, packets, hot, pods"
            )
        }
    }
}

/// Progress with elapsed time, for runs that take minutes.
pub struct Progress {
    started: Instant,
}

impl Progress {
    pub fn new() -> Self {
        Self {
            started: Instant::now(),
        }
    }

    pub fn step(&self, what: &str) {
        eprintln!(
            "\x1b[1m[{:6.1}s]\x1b[0m {what}",
            self.started.elapsed().as_secs_f64()
        );
    }
}

/// One line of a report: a measurement and, when it has one, the baseline it is compared to.
pub struct Row {
    pub scenario: String,
    pub metric: &'static str,
    pub unit: &'static str,
    pub value: f64,
    pub baseline: Option<(String, f64)>,
}

impl Row {
    pub fn ratio(&self) -> Option<f64> {
        self.baseline
            .as_ref()
            .map(|(_, baseline)| self.value / baseline)
    }
}

/// Writes `<name>.md` (and prints it) and `<name>.json` into `out_dir`.
pub fn write_report(
    out_dir: &Path,
    name: &str,
    title: &str,
    rows: &[Row],
    notes: &[String],
) -> Result<PathBuf> {
    let mut table = format!(
        "# {title}\n\n| scenario | metric | value | baseline | ratio |\n|---|---|---:|---|---:|\n"
    );
    for row in rows {
        let (baseline, ratio) = match (&row.baseline, row.ratio()) {
            (Some((label, value)), Some(ratio)) => (
                format!("{label}: {} {}", format_value(*value), row.unit),
                format!("{ratio:.3}×"),
            ),
            _ => ("—".to_owned(), "—".to_owned()),
        };
        writeln!(
            table,
            "| {} | {} | {} {} | {} | {} |",
            row.scenario,
            row.metric,
            format_value(row.value),
            row.unit,
            baseline,
            ratio
        )?;
    }
    let json: Vec<_> = rows
        .iter()
        .map(|row| {
            serde_json::json!({
                "scenario": row.scenario, "metric": row.metric, "unit": row.unit, "value": row.value,
                "baseline": row.baseline.as_ref().map(|(label, value)| serde_json::json!({ "label": label, "value": value })),
                "ratio": row.ratio(),
            })
        })
        .collect();
    save(out_dir, name, table, notes, &json)
}

/// Appends `notes` to `table` and writes it as `<name>.md` (printing it too), and `json` as
/// `<name>.json`, into `out_dir`; the table's path.
pub fn save(
    out_dir: &Path,
    name: &str,
    mut table: String,
    notes: &[String],
    json: &[serde_json::Value],
) -> Result<PathBuf> {
    for note in notes {
        writeln!(table, "\n{note}")?;
    }
    let markdown = out_dir.join(format!("{name}.md"));
    std::fs::write(&markdown, &table)?;
    println!("{table}");
    std::fs::write(
        out_dir.join(format!("{name}.json")),
        serde_json::to_string_pretty(json)?,
    )?;
    Ok(markdown)
}

fn format_value(value: f64) -> String {
    if value >= 100.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.2}")
    }
}

/// The commit this build is made from, `+` marking changes not yet committed (but to docs/,
/// which a run of several suites writes as it goes).
pub fn this_commit() -> Result<String> {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .current_dir(crate::workspace_root())
            .output()
            .with_context(|| format!("run git {}", args.join(" ")))
    };
    let head = git(&["rev-parse", "--short=7", "HEAD"])?;
    if !head.status.success() {
        bail!("git rev-parse: {}", String::from_utf8_lossy(&head.stderr));
    }
    let changed = git(&["status", "--porcelain", "--", ".", ":(exclude)docs"])?;
    let dirty = if changed.stdout.is_empty() { "" } else { "+" };
    Ok(format!("{}{dirty}", String::from_utf8(head.stdout)?.trim()))
}

/// Publishes a suite's last run for users when docs/benchmarks.md shows the run `command`
/// makes: `<suite>.{md,json,png}` copied from `out_dir` to docs/bench/, and the table (its
/// title line dropped), under a line naming the command and the commit measured, written
/// between the markers `<!-- generated by: <command> -->` and `<!-- end of generated -->`.
/// `false` (nothing written) when the page has no such marker.
pub fn publish(out_dir: &Path, suite: &str, command: &str) -> Result<bool> {
    let docs = crate::workspace_root().join("docs");
    let page = docs.join("benchmarks.md");
    let text = std::fs::read_to_string(&page)?;
    let begin = format!("<!-- generated by: {command} -->");
    let end = "<!-- end of generated -->";
    let Some((before, rest)) = text.split_once(&begin) else {
        return Ok(false);
    };
    let (_, after) = rest
        .split_once(end)
        .with_context(|| format!("docs/benchmarks.md has no {end} after {begin}"))?;
    let table = std::fs::read_to_string(out_dir.join(format!("{suite}.md")))?;
    let body = table.split_once('\n').map_or("", |(_, body)| body).trim();
    for extension in ["md", "json", "png"] {
        let name = format!("{suite}.{extension}");
        std::fs::copy(out_dir.join(&name), docs.join("bench").join(&name))
            .with_context(|| format!("copy {name} to docs/bench"))?;
    }
    let measured = format!("Measured by `{command}` at commit {}.", this_commit()?);
    std::fs::write(
        &page,
        format!("{before}{begin}\n{measured}\n\n{body}\n{end}{after}"),
    )?;
    Ok(true)
}

/// The order in which round `round` (from 1) measures `count` series: each goes first in turn.
/// A round's first measurement follows the previous round's other traffic, and on this machine
/// that costs it several per cent (`./dev bench nftables` with the order fixed had the side
/// measured first behind in every figure): taken in turn, that falls on every series alike.
pub fn in_turn(round: usize, count: usize) -> impl Iterator<Item = usize> {
    (0..count).map(move |place| (place + round - 1) % count)
}

pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// An iperf3 server in a namespace, killed on drop.
pub struct Iperf3Server {
    child: Child,
}

impl Iperf3Server {
    pub fn start(netns: &Netns, port: u16) -> Result<Self> {
        let child = netns
            .command(&["iperf3", "--server", "--port", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("start iperf3 server")?;
        // iperf3 has no readiness signal; it listens within milliseconds.
        std::thread::sleep(Duration::from_millis(300));
        Ok(Self { child })
    }
}

impl Drop for Iperf3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// TCP throughput in Gbit/s from `netns` to `target` over `seconds` (iperf3, one stream).
pub fn iperf3(netns: &Netns, target: std::net::SocketAddr, seconds: u32) -> Result<f64> {
    iperf3_streams(netns, target, seconds, 1)
}

/// TCP throughput in Gbit/s from `netns` to `target` over `seconds`, summed over `streams`
/// parallel streams of one iperf3 client.
pub fn iperf3_streams(
    netns: &Netns,
    target: std::net::SocketAddr,
    seconds: u32,
    streams: u32,
) -> Result<f64> {
    let report = iperf3_client(
        netns,
        target,
        seconds,
        &["--parallel", &streams.to_string()],
    )?;
    report["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .map(|bits| bits / 1e9)
        .with_context(|| format!("iperf3 to {target} failed: {}", report["error"]))
}

/// Datagrams per second that reach `target` when `netns` sends `length`-byte UDP payloads as
/// fast as one iperf3 client can for `seconds` (sent less lost, as the server counted them).
pub fn iperf3_udp_rate(
    netns: &Netns,
    target: std::net::SocketAddr,
    seconds: u32,
    length: u32,
) -> Result<f64> {
    let report = iperf3_client(
        netns,
        target,
        seconds,
        &["--udp", "--bitrate", "0", "--length", &length.to_string()],
    )?;
    let sum = &report["end"]["sum"];
    match (
        sum["packets"].as_f64(),
        sum["lost_packets"].as_f64(),
        sum["seconds"].as_f64(),
    ) {
        (Some(packets), Some(lost), Some(seconds)) if seconds > 0.0 => {
            Ok((packets - lost) / seconds)
        }
        _ => bail!("iperf3 UDP to {target} failed: {}", report["error"]),
    }
}

/// The JSON report of one iperf3 client run from `netns` to `target` for `seconds`, with
/// `options` besides.
fn iperf3_client(
    netns: &Netns,
    target: std::net::SocketAddr,
    seconds: u32,
    options: &[&str],
) -> Result<serde_json::Value> {
    let (address, port, seconds) = (
        target.ip().to_string(),
        target.port().to_string(),
        seconds.to_string(),
    );
    let mut arguments = vec![
        "iperf3", "--client", &address, "--port", &port, "--time", &seconds, "--json",
    ];
    arguments.extend_from_slice(options);
    let output = netns
        .command(&arguments)
        .output()
        .context("run iperf3 client")?;
    serde_json::from_slice(&output.stdout).context("iperf3 prints JSON")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_series_goes_first_in_turn_and_once_a_round() {
        let orders: Vec<Vec<usize>> = (1..=3).map(|round| in_turn(round, 3).collect()).collect();
        assert_eq!(orders, [[0, 1, 2], [1, 2, 0], [2, 0, 1]]);
        assert_eq!(in_turn(4, 2).collect::<Vec<_>>(), [1, 0]);
    }
}
