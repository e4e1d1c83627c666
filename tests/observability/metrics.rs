//! The metrics endpoint scraped by a real Prometheus, and the alert rules checked by promtool.

use super::*;

/// A Prometheus server started by the test, scraping the endpoint every second; killed on
/// drop.
struct Prometheus {
    child: Child,
    host_netns: std::path::PathBuf,
}

const PROMETHEUS_ADDR: &str = "127.0.0.1:9090";

impl Prometheus {
    fn start(host: &SimHost) -> Self {
        let dir = host.work_dir.join("prometheus");
        std::fs::create_dir_all(&dir).expect("prometheus dir");
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: cnibpf\n    static_configs:\n      - targets: ['{}']\n",
                alert_rules().display(),
                cnibpf_tests::observe::METRICS_ADDR
            ),
        )
        .expect("write the Prometheus configuration");
        let mut command = Command::new("prometheus");
        command
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={PROMETHEUS_ADDR}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        enter_netns_on_exec(&mut command, &host.host.path());
        let child = command
            .spawn()
            .expect("start prometheus (Debian's prometheus package)");
        Self {
            child,
            host_netns: host.host.path(),
        }
    }

    /// The value of the first series `query` returns, through the HTTP query API.
    fn query(&self, query: &str) -> Option<f64> {
        let encoded: String = query
            .bytes()
            .map(|byte| match byte {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' => (byte as char).to_string(),
                other => format!("%{other:02X}"),
            })
            .collect();
        let netns = cnibpf_tests::Netns::at(&self.host_netns);
        let (status, body) = cnibpf_tests::observe::http_get_path(
            &netns,
            PROMETHEUS_ADDR.parse().expect("an address"),
            &format!("/api/v1/query?query={encoded}"),
        )
        .ok()?;
        if status != 200 {
            return None;
        }
        let answer: Value = serde_json::from_str(&body).ok()?;
        answer["data"]["result"][0]["value"][1]
            .as_str()?
            .parse()
            .ok()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn alert_rules() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("deploy")
        .join("prometheus-alerts.yaml")
}

/// The exposition passes `promtool check metrics`, the example alerts `promtool check rules`,
/// and a real Prometheus server scrapes the endpoint: the attachments, a drop counter and the
/// plugin's calls read back through its query API.
#[test]
fn prometheus_scrapes_the_endpoint() {
    let host = SimHost::on(Backend::Ebpf, "ob-prom", filter_keys());
    host.route_outside_to_containers();
    let container = host.container("a", Value::Null);
    unanswered_from_outside(&host, SocketAddr::new(IpAddr::V4(container.address), 8081));
    assert_eq!(
        host.inspect()["callStatsFile"]
            .as_str()
            .map(std::path::PathBuf::from),
        Some(cnibpf_tests::topology::call_stats_file(&host.pin_path)),
        "where the host's calls are counted"
    );
    let endpoint = Endpoint::metrics(&host, &[]);
    let text = endpoint.scrape();
    promtool_check_metrics(&text).unwrap_or_else(|complaints| {
        panic!("promtool check metrics refused the exposition:\n{complaints}\n{text}")
    });
    assert_eq!(
        sample(
            &text,
            "cnibpf_plugin_operations_total",
            &[("verb", "ADD"), ("result", "ok")]
        ),
        Some(1.0),
        "the ADD is counted: {text}"
    );
    assert_eq!(
        sample(
            &text,
            "cnibpf_plugin_operation_duration_seconds_count",
            &[("verb", "ADD")]
        ),
        Some(1.0),
        "{text}"
    );
    let checked = Command::new("promtool")
        .args(["check", "rules"])
        .arg(alert_rules())
        .output()
        .expect("run promtool check rules");
    assert!(
        checked.status.success(),
        "promtool check rules: {checked:?}"
    );

    let prometheus = Prometheus::start(&host);
    assert!(
        eventually(Duration::from_secs(60), || prometheus
            .query("cnibpf_attachments{backend=\"ebpf\"}")
            == Some(1.0)),
        "Prometheus reads cnibpf_attachments"
    );
    assert!(
        eventually(Duration::from_secs(30), || prometheus
            .query("cnibpf_packets_dropped_total{reason=\"filter_rule\"}")
            .is_some_and(|dropped| dropped >= 1.0)),
        "Prometheus reads the filter_rule drops"
    );
    assert_eq!(
        prometheus.query("sum(cnibpf_plugin_operations_total{verb=\"ADD\",result=\"ok\"})"),
        Some(1.0),
        "Prometheus reads the plugin's calls"
    );
    drop(container);
}
