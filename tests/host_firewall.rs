//! The host's own firewall and what cnibpf translates: the eBPF datapath hands hostPort
//! traffic past the host's forward chain, and a container's connections once their first
//! packet crossed it, unless `hostFirewall` keeps every packet in the stack; the nftables
//! backend always leaves it there. An operator's iptables FORWARD drops
//! show which. The INPUT chain never judges it (it is forwarded, not for the host), as with
//! the reference portmap: a host that locks its INPUT down keeps its pods reachable. A reload
//! of the firewall that flushes the ruleset takes nothing the next call of the instance, or
//! `install --watch`, does not put back.

use std::{net::SocketAddr, time::Duration};

use cnibpf_tests::{
    Container, SimHost,
    daemon::Daemon,
    eventually, for_both_backends,
    observe::call_log,
    topology::{Backend, OUTSIDE_ADDR, UPLINK, port_mappings},
    traffic::{TcpServer, tcp_request},
};
use serde_json::{Value, json};

const OUTSIDE_PORT: u16 = 9000;

/// Whether the outside reaches the container's hostPort, and the container the outside's
/// server (masqueraded): first as they are, then with an iptables FORWARD drop for each in the
/// host.
fn reach(backend: Backend, host_firewall: bool, id: &str) -> [(bool, bool); 2] {
    let outside_addr = OUTSIDE_ADDR.to_string();
    let port = OUTSIDE_PORT.to_string();
    let [(open, _), (after, _)] = reach_with(
        backend,
        host_firewall,
        id,
        "FORWARD",
        &[
            &["-s", &outside_addr, "-p", "tcp", "--dport", "80"],
            &["-d", &outside_addr, "-p", "tcp", "--dport", &port],
        ],
    );
    [open, after]
}

/// [`reach`] with `rules` (each dropping) in `chain` of the filter table, and whether the
/// outside reaches a service of the host itself (port 7777), before and after.
fn reach_with(
    backend: Backend,
    host_firewall: bool,
    id: &str,
    chain: &str,
    rules: &[&[&str]],
) -> [((bool, bool), bool); 2] {
    let sim = SimHost::on(
        backend,
        id,
        json!({ "ipMasq": true, "hostFirewall": host_firewall }),
    );
    let container = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let _server = TcpServer::start(&container.netns, container.socket(80), "c1");
    let outside = SocketAddr::new(OUTSIDE_ADDR.into(), OUTSIDE_PORT);
    let _outside_server = TcpServer::start(&sim.outside, outside, "outside");
    let _host_server = TcpServer::start(&sim.host, sim.uplink_target(7777), "host");
    let probe = || {
        (
            (
                tcp_request(&sim.outside, sim.uplink_target(8080)).as_deref() == Ok("c1"),
                tcp_request(&container.netns, outside).as_deref() == Ok("outside"),
            ),
            tcp_request(&sim.outside, sim.uplink_target(7777)).as_deref() == Ok("host"),
        )
    };
    let open = probe();
    for rule in rules {
        sim.host
            .exec(&[&["iptables", "-I", chain][..], rule, &["-j", "DROP"]].concat());
    }
    [open, probe()]
}

#[test]
fn the_ebpf_datapath_shows_the_host_firewall_new_connections_of_containers_only_unless_asked() {
    let [open, dropped] = reach(Backend::Ebpf, false, "fwb");
    assert_eq!(open, (true, true), "hostPort and masquerade work");
    assert_eq!(
        dropped,
        (true, false),
        "eBPF: hostPort traffic does not meet the host's FORWARD chain; a container's new connection does"
    );
    let [open, dropped] = reach(Backend::Ebpf, true, "fwk");
    assert_eq!(
        open,
        (true, true),
        "hostFirewall: hostPort and masquerade work"
    );
    assert_eq!(
        dropped,
        (false, false),
        "hostFirewall: the host's FORWARD drops judge hostPort and masqueraded traffic"
    );
}

#[test]
fn the_nftables_backend_leaves_translated_traffic_to_the_host_firewall() {
    let [open, dropped] = reach(Backend::Nftables, false, "fwn");
    assert_eq!(open, (true, true));
    assert_eq!(dropped, (false, false));
}

/// A drop in INPUT of everything the outside sends to the host judges none of a container's
/// translated traffic (hostPort connections in, replies to its masqueraded ones), whatever the
/// backend and `hostFirewall`: it is forwarded, not for the host.
#[test]
fn the_input_chain_never_judges_translated_traffic() {
    for (backend, host_firewall, id) in [
        (Backend::Ebpf, false, "fwi"),
        (Backend::Ebpf, true, "fwik"),
        (Backend::Nftables, false, "fwin"),
    ] {
        // Everything the outside sends to the host itself.
        let outside_addr = OUTSIDE_ADDR.to_string();
        let [(open, host_open), (after, host_after)] = reach_with(
            backend,
            host_firewall,
            id,
            "INPUT",
            &[&["-s", &outside_addr]],
        );
        let what = format!("{backend:?}, hostFirewall {host_firewall}");
        assert_eq!((open, host_open), ((true, true), true), "{what}");
        assert!(
            !host_after,
            "{what}: the drop holds for the host's own service"
        );
        assert_eq!(after, (true, true), "{what}: INPUT drops do not meet it");
    }
}

/// A host whose container c1 has hostPort 8080, masquerade, and a filter rule that drops what
/// comes to its port 81 (through hostPort 8081), with servers for each.
struct Reloaded {
    sim: SimHost,
    c1: Container,
    _servers: [TcpServer; 3],
}

impl Reloaded {
    fn new(backend: Backend, id: &str) -> Self {
        let filter = json!([{ "index": 10, "proto": "tcp", "dport": 81, "direction": "ingress", "target": "DROP" }]);
        let sim = SimHost::on(backend, id, json!({ "ipMasq": true, "filter": filter }));
        let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp"), (8081, 81, "tcp")]));
        let servers = [
            TcpServer::start(&c1.netns, c1.socket(80), "web"),
            TcpServer::start(&c1.netns, c1.socket(81), "filtered"),
            TcpServer::start(
                &sim.outside,
                SocketAddr::new(OUTSIDE_ADDR.into(), OUTSIDE_PORT),
                "outside",
            ),
        ];
        Self {
            sim,
            c1,
            _servers: servers,
        }
    }

    /// Whether c1 is served whole: its hostPort reached, its filter dropping, its traffic out
    /// masqueraded (the outside has no route back to it).
    fn served(&self) -> bool {
        let outside = SocketAddr::new(OUTSIDE_ADDR.into(), OUTSIDE_PORT);
        tcp_request(&self.sim.outside, self.sim.uplink_target(8080)).as_deref() == Ok("web")
            && tcp_request(&self.sim.outside, self.sim.uplink_target(8081)).is_err()
            && tcp_request(&self.c1.netns, outside).as_deref() == Ok("outside")
    }

    /// Flushes the ruleset: whether that took c1's hostPort.
    fn flush_ruleset(&self) -> bool {
        self.sim.host.exec(&["nft", "flush", "ruleset"]);
        tcp_request(&self.sim.outside, self.sim.uplink_target(8080)).is_err()
    }

    fn calls(&self) -> usize {
        call_log(&self.sim.call_log()).len()
    }
}

/// `nft flush ruleset` — a firewalld reload, an operator's `nft -f` file that starts with
/// `flush ruleset`, iptables-nft tooling — takes the nftables backend's tables (plugins#512,
/// cni#778, netavark#723). The records live in the instance's state file, so the next call of
/// the instance (an ADD of another pod) puts every live attachment back whole: hostPorts,
/// masquerade, the filter with its order, the source check; CHECK then passes, and DELs after
/// another flush leave nothing.
#[test]
fn a_flushed_ruleset_is_put_back_by_the_next_call() {
    let reloaded = Reloaded::new(Backend::Nftables, "fw-flush");
    assert!(reloaded.served(), "served before the reload");
    assert!(reloaded.flush_ruleset(), "the flush took the hostPort");
    let c2 = reloaded.sim.container("c2", Value::Null);
    assert!(reloaded.served(), "served again after the next ADD");
    let ruleset = reloaded.sim.nft_ruleset();
    assert!(
        ruleset.contains("table netdev cnibpf"),
        "the source checks are back too: {ruleset}"
    );
    reloaded
        .sim
        .check(&reloaded.c1)
        .unwrap_or_else(|error| panic!("CHECK after the restore: {error}"));
    assert!(reloaded.flush_ruleset(), "flushed again");
    for container in [&reloaded.c1, &c2] {
        reloaded
            .sim
            .del(container)
            .unwrap_or_else(|error| panic!("DEL after the restore: {error}"));
    }
    assert!(
        reloaded.sim.holds_no_state(),
        "nothing left: {}",
        reloaded.sim.nft_ruleset()
    );
}

/// With `install --watch` running (the DaemonSet's), a flushed ruleset is back within 5 s
/// without any CNI call (the eBPF datapath never noticed it), and an address added to the
/// uplink serves wildcard hostPorts as soon: the watcher follows the ruleset and the host's
/// addresses through netlink.
fn install_watch_puts_a_flushed_ruleset_back_and_follows_the_nodes_addresses(backend: Backend) {
    let reloaded = Reloaded::new(backend, "fw-watch");
    let watcher = watch(&reloaded.sim, backend);
    let calls = reloaded.calls();
    assert_eq!(
        reloaded.flush_ruleset(),
        backend == Backend::Nftables,
        "a flush takes only the nftables backend's hostPorts"
    );
    assert!(
        eventually(Duration::from_secs(5), || reloaded.served()),
        "served again within 5 s of the flush"
    );
    reloaded
        .sim
        .host
        .exec(&["ip", "addr", "add", "203.0.113.77/24", "dev", UPLINK]);
    let added = "203.0.113.77:8080".parse().expect("literal");
    assert!(
        eventually(Duration::from_secs(5), || {
            tcp_request(&reloaded.sim.outside, added).as_deref() == Ok("web")
        }),
        "a new address of the node serves the hostPort within 5 s"
    );
    assert_eq!(reloaded.calls(), calls, "no CNI call did it");
    watcher.terminate();
}

for_both_backends!(install_watch_puts_a_flushed_ruleset_back_and_follows_the_nodes_addresses);

/// `cnibpf install --watch` for `sim`'s instance, as the DaemonSet runs it.
fn watch(sim: &SimHost, backend: Backend) -> Daemon {
    let conf_dir = sim.work_dir.join("net.d");
    let bin_dir = sim.work_dir.join("bin");
    for dir in [&conf_dir, &bin_dir] {
        std::fs::create_dir_all(dir).expect("the watcher's directories");
    }
    let primary = json!({
        "cniVersion": "1.0.0",
        "name": "primary",
        "plugins": [{ "type": "bridge", "bridge": "cni9", "ipam": { "type": "host-local", "ranges": [[{ "subnet": "10.99.0.0/16" }]] } }],
    });
    std::fs::write(conf_dir.join("10-primary.conflist"), primary.to_string())
        .expect("the primary network");
    let entry = sim.work_dir.join("entry.json");
    let keys = json!({ "backend": backend.name(), "pinPath": sim.pin_path, "capabilities": { "portMappings": true } });
    std::fs::write(&entry, keys.to_string()).expect("the entry");
    let (entry, conf_dir, bin_dir) = (
        entry.display().to_string(),
        conf_dir.display().to_string(),
        bin_dir.display().to_string(),
    );
    let watcher = sim
        .cnibpf_command(&[
            "install",
            "--entry",
            &entry,
            "--watch",
            "--conf-dir",
            &conf_dir,
            "--bin-dir",
            &bin_dir,
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map(Daemon::from)
        .expect("start cnibpf install --watch");
    // The watcher is up once it has chained cnibpf into its own conflist.
    let own = sim.work_dir.join("net.d/10-primary.cnibpf.conflist");
    assert!(
        eventually(Duration::from_secs(10), || own.exists()),
        "install --watch wrote cnibpf's conflist"
    );
    watcher
}
