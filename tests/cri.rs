//! containerd's CRI, driven the way kubelet drives it (the path of every Kubernetes node that
//! runs containerd): RunPodSandbox with hostPorts, containers serving them, traffic from
//! outside, from host processes and from a neighbour pod, masquerade, a filter rule, a Service
//! of kube-proxy's reached by its ClusterIP, the
//! teardown kubelet does (StopPodSandbox twice, RemovePodSandbox) and a pod restart. The
//! conflist is the simulated host's bridge + cnibpf; containerd sends the capability keys as
//! Go field names and names the pod in CNI_ARGS.

use std::{
    net::{IpAddr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use cnibpf_tests::{
    SimHost,
    assertions::assert_uninstalled,
    cri::{Containerd, Cri, Pod, host_port},
    eventually, for_both_backends,
    image::PAGE,
    kube_proxy::{self, Mode, Service},
    observe::call_log,
    topology::{Backend, HOST_UPLINK_ADDR, OUTSIDE_ADDR, SUBNET, SUBNET6},
    traffic::{TcpServer, UdpServer, http_get, udp_request},
};
use k8s_cri::v1::Protocol;
use serde_json::json;

const OUTSIDE_WEB: u16 = 9000;
/// An outside port the pod's filter keeps it from reaching.
const OUTSIDE_FORBIDDEN: u16 = 9001;

fn cnibpf_keys() -> serde_json::Value {
    json!({
        "ipMasq": true,
        "filter": [{
            "index": 10, "dst": format!("{OUTSIDE_ADDR}/32"), "proto": "tcp",
            "dport": OUTSIDE_FORBIDDEN, "direction": "egress", "target": "DROP",
        }],
    })
}

/// busybox httpd serving the test page on port 80 of `pod`; its container.
fn start_httpd(cri: &mut Cri, pod: &Pod) -> String {
    cri.start_container(
        pod,
        "httpd",
        &["/bin/httpd", "-f", "-p", "80", "-h", "/www"],
    )
}

/// Pod `shop/<name>` with busybox httpd serving port 80 on TCP hostPort `port`.
fn serving_pod(cri: &mut Cri, containerd: &Containerd, name: &str, port: u16) -> Pod {
    let pod = cri
        .run_pod(cri.pod_config(
            "shop",
            name,
            0,
            vec![host_port(Protocol::Tcp, 80, i32::from(port), "")],
        ))
        .unwrap_or_else(|status| panic!("RunPodSandbox: {status}\n{}", containerd.log()));
    start_httpd(cri, &pod);
    pod
}

/// Whether the outside gets the test page through hostPort `port` (within 5 s).
fn outside_gets_the_page(sim: &SimHost, port: u16) -> bool {
    eventually(Duration::from_secs(5), || {
        http_get(&sim.outside, sim.uplink_target(port)).is_ok_and(|body| body == PAGE)
    })
}

fn pods_of(sim: &SimHost) -> Vec<String> {
    sim.inspect()["attachments"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|attachment| attachment["pod"].as_str().map(str::to_owned))
        .collect()
}

/// The call log holds exactly the pod's lifecycle as containerd ran it: its ADD (naming the
/// pod and the hostPorts it holds), the DEL of the first StopPodSandbox (releasing them), and
/// the DELs of the second StopPodSandbox and of RemovePodSandbox (releasing nothing).
fn assert_pod_logged(sim: &SimHost, backend: Backend, sandbox: &str) {
    let lines: Vec<serde_json::Value> = call_log(&sim.call_log())
        .into_iter()
        .filter(|line| line["container_id"] == sandbox)
        .collect();
    let verbs: Vec<&str> = lines
        .iter()
        .filter_map(|line| line["verb"].as_str())
        .collect();
    assert_eq!(verbs, ["ADD", "DEL", "DEL", "DEL"], "{lines:#?}");
    for line in &lines {
        assert_eq!(line["result"], "ok", "{line}");
        assert_eq!(line["pod"], "shop/web", "{line}");
        assert_eq!(line["network"], sim.network(), "{line}");
        assert_eq!(line["ifname"], "eth0", "{line}");
        assert_eq!(line["backend"], backend.name(), "{line}");
        assert!(
            line["duration_ms"].as_f64().is_some_and(|ms| ms > 0.0),
            "{line}"
        );
    }
    let held = lines[0]["host_ports"].as_str().unwrap_or_default();
    for port in [
        "tcp 0.0.0.0:18080 ",
        "tcp 203.0.113.1:18081 ",
        "udp 0.0.0.0:15353 ",
    ] {
        assert!(held.contains(port), "the ADD holds {port}: {held}");
    }
    assert_eq!(
        lines[1]["host_ports_released"], lines[0]["host_ports"],
        "{lines:#?}"
    );
    assert!(
        lines[2..]
            .iter()
            .all(|line| line.get("host_ports_released").is_none()),
        "the later DELs release nothing: {lines:#?}"
    );
}

fn a_pod_with_host_ports_through_containerd(backend: Backend) {
    let sim = SimHost::on(backend, "cri", cnibpf_keys());
    let containerd = Containerd::start(&sim);
    let mut cri = containerd.client();
    let uplink = HOST_UPLINK_ADDR.to_string();
    let config = cri.pod_config(
        "shop",
        "web",
        0,
        vec![
            host_port(Protocol::Tcp, 80, 18080, ""),
            host_port(Protocol::Tcp, 80, 18081, &uplink),
            host_port(Protocol::Udp, 5353, 15353, ""),
        ],
    );
    let web = cri
        .run_pod(config.clone())
        .unwrap_or_else(|status| panic!("RunPodSandbox: {status}\n{}", containerd.log()));
    let httpd = start_httpd(&mut cri, &web);
    let _dns = UdpServer::start(&web.netns, "0.0.0.0:5353".parse().expect("literal"), "dns");
    assert_eq!(pods_of(&sim), ["shop/web"], "inspect names the pod");

    // From outside: TCP on any address, TCP on the hostIP, UDP.
    assert!(
        outside_gets_the_page(&sim, 18080),
        "the outside reaches httpd through hostPort 18080"
    );
    assert_eq!(
        http_get(&sim.outside, sim.uplink_target(18081)).as_deref(),
        Ok(PAGE),
        "hostPort 18081 on hostIP {uplink}"
    );
    let (answer, _) = udp_request(&sim.outside, sim.uplink_target(15353))
        .unwrap_or_else(|error| panic!("UDP hostPort 15353: {error}"));
    assert_eq!(answer, "dns");

    // From host processes.
    let local = [
        SocketAddr::new(IpAddr::V4(HOST_UPLINK_ADDR), 18080),
        SocketAddr::new(IpAddr::V4([127, 0, 0, 1].into()), 18080),
        SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), 18080),
    ];
    for target in local {
        let outcome = sim.host_client("http", target);
        // nftables translates 127.0.0.1 (as the reference portmap), never [::1] (see docs/datapath.md:
        // backend differences).
        if backend == Backend::Nftables && target.ip().is_ipv6() && target.ip().is_loopback() {
            assert!(outcome.is_err(), "nftables: {target}: {outcome:?}");
            continue;
        }
        let (answer, _) =
            outcome.unwrap_or_else(|error| panic!("host process -> {target}: {error}"));
        assert_eq!(answer, PAGE.trim_end(), "host process -> {target}");
    }

    // A neighbour pod through the hostPort (hairpin), and the pod's own traffic out.
    let neighbour = cri
        .run_pod(cri.pod_config("shop", "client", 0, Vec::new()))
        .unwrap_or_else(|status| panic!("RunPodSandbox client: {status}"));
    let shell = cri.start_container(&neighbour, "shell", &["/bin/sleep", "3600"]);
    let (code, body) = cri.exec(
        &shell,
        &["/bin/wget", "-q", "-O-", &format!("http://{uplink}:18080/")],
    );
    assert_eq!(
        (code, body.as_str()),
        (0, PAGE),
        "hairpin from a neighbour pod"
    );
    let outside_web = TcpServer::start(
        &sim.outside,
        SocketAddr::new(OUTSIDE_ADDR.into(), OUTSIDE_WEB),
        "HTTP/1.0 200 OK\r\n\r\nfrom outside\n",
    );
    let _forbidden = TcpServer::start(
        &sim.outside,
        SocketAddr::new(OUTSIDE_ADDR.into(), OUTSIDE_FORBIDDEN),
        "HTTP/1.0 200 OK\r\n\r\nforbidden\n",
    );
    let fetch = |cri: &mut Cri, port: u16| {
        cri.exec(
            &httpd,
            // (busybox 1.35's own `wget -T` crashes.)
            &[
                "/bin/timeout",
                "3",
                "/bin/wget",
                "-q",
                "-O-",
                &format!("http://{OUTSIDE_ADDR}:{port}/"),
            ],
        )
    };
    // (The greeting server closes without reading the request: wget may still say 1.)
    let (_, body) = fetch(&mut cri, OUTSIDE_WEB);
    assert_eq!(body, "from outside\n", "masquerade");
    assert_eq!(
        outside_web.peers()[0].ip(),
        IpAddr::V4(HOST_UPLINK_ADDR),
        "the outside server saw the uplink's address"
    );
    let (_, body) = fetch(&mut cri, OUTSIDE_FORBIDDEN);
    assert_eq!(
        body, "",
        "filter rule 10 keeps the pod from {OUTSIDE_ADDR}:{OUTSIDE_FORBIDDEN}"
    );
    // A Service of kube-proxy's (its iptables mode's saved chains, br_netfilter on as it
    // requires) whose endpoint is that outside server: the pod reaches it by its ClusterIP.
    sim.set_bridge_netfilter(true);
    let cluster_ip: SocketAddr = "10.96.0.10:80".parse().expect("literal");
    let service = Service {
        address: cluster_ip,
        protocol: "tcp",
        endpoint: SocketAddr::new(OUTSIDE_ADDR.into(), OUTSIDE_WEB),
    };
    kube_proxy::install(
        &sim.host,
        Mode::Iptables,
        [SUBNET, SUBNET6],
        &[service],
        &[],
    );
    let (_, body) = cri.exec(
        &httpd,
        &[
            "/bin/timeout",
            "3",
            "/bin/wget",
            "-q",
            "-O-",
            &format!("http://{cluster_ip}/"),
        ],
    );
    assert_eq!(
        body, "from outside\n",
        "a Service of kube-proxy's, by its ClusterIP"
    );
    kube_proxy::uninstall(&sim.host);
    sim.set_bridge_netfilter(false);

    // kubelet's teardown: StopPodSandbox, again (its retry), RemovePodSandbox.
    cri.stop_pod(&web.id)
        .unwrap_or_else(|status| panic!("StopPodSandbox: {status}"));
    cri.stop_pod(&web.id)
        .unwrap_or_else(|status| panic!("second StopPodSandbox: {status}"));
    cri.remove_pod(&web.id)
        .unwrap_or_else(|status| panic!("RemovePodSandbox: {status}"));
    assert!(
        http_get(&sim.outside, sim.uplink_target(18080)).is_err(),
        "hostPort 18080 refused after the pod is gone"
    );
    assert_eq!(pods_of(&sim), ["shop/client"], "nothing of the pod is left");
    assert_pod_logged(&sim, backend, &web.id);

    // The pod again, as kubelet restarts it: same name, a new sandbox; its hostPort at once.
    let again = cri
        .run_pod(cri.pod_config("shop", "web", 1, config.port_mappings.clone()))
        .unwrap_or_else(|status| panic!("RunPodSandbox of the restarted pod: {status}"));
    start_httpd(&mut cri, &again);
    assert!(
        outside_gets_the_page(&sim, 18080),
        "the restarted pod has its hostPort"
    );

    for pod in [&again.id, &neighbour.id] {
        cri.stop_pod(pod)
            .unwrap_or_else(|status| panic!("StopPodSandbox: {status}"));
        cri.remove_pod(pod)
            .unwrap_or_else(|status| panic!("RemovePodSandbox: {status}"));
    }
    assert!(
        sim.holds_no_state(),
        "the last pod's teardown leaves no cnibpf state"
    );
}

for_both_backends!(a_pod_with_host_ports_through_containerd);

/// containerd over a bridge + portmap network (containerd's own example configuration has
/// that shape) into which `cnibpf install --replace-portmap` chained cnibpf with `sim`'s keys,
/// in a file of its own beside the primary's: containerd, its conf and bin dirs, the primary
/// network as written, and the name of cnibpf's file.
struct Installed {
    containerd: Containerd,
    conf_dir: std::path::PathBuf,
    bin_dir: std::path::PathBuf,
    primary: serde_json::Value,
    primary_file: String,
    own_file: String,
}

impl Installed {
    fn start(sim: &SimHost) -> Self {
        let primary_file = format!("10-{}.conflist", sim.network());
        let dirs = std::sync::Mutex::new(None);
        let containerd = Containerd::start_with(sim, |conf_dir, bin_dir| {
            let primary = sim.install_over_portmap(conf_dir, bin_dir);
            *dirs.lock().expect("dirs") = Some((conf_dir.to_owned(), bin_dir.to_owned(), primary));
        });
        let (conf_dir, bin_dir, primary) = dirs
            .into_inner()
            .expect("dirs")
            .expect("containerd configured");
        Self {
            containerd,
            conf_dir,
            bin_dir,
            primary,
            primary_file,
            own_file: format!("10-{}.cnibpf.conflist", sim.network()),
        }
    }

    fn read(&self, file: &str) -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(self.conf_dir.join(file)).expect("read the file"))
            .expect("it parses")
    }
}

fn types(conflist: &serde_json::Value) -> Vec<&str> {
    conflist["plugins"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|plugin| plugin["type"].as_str())
        .collect()
}

/// The conflist `cnibpf install` makes of a bridge + portmap network, a file of its own beside
/// the primary's, is the one containerd runs: a pod's hostPort is cnibpf's.
#[test]
fn a_pod_with_a_host_port_through_the_conflist_cnibpf_install_wrote() {
    let sim = SimHost::on(Backend::Ebpf, "crii", json!({ "ipMasq": true }));
    let installed = Installed::start(&sim);
    assert_eq!(
        installed.read(&installed.primary_file),
        installed.primary,
        "the primary's file is left as it was"
    );
    let chained = installed.read(&installed.own_file);
    assert_eq!(types(&chained), ["bridge", "cnibpf"], "{chained:#}");
    eprintln!(
        "before install:\n{:#}\nafter install:\n{chained:#}",
        installed.primary
    );
    let containerd = &installed.containerd;
    let mut cri = containerd.client();
    let web = serving_pod(&mut cri, containerd, "web", 18080);
    assert_eq!(pods_of(&sim), ["shop/web"], "cnibpf serves the pod");
    assert!(
        outside_gets_the_page(&sim, 18080),
        "the outside reaches httpd through hostPort 18080"
    );
    cri.stop_pod(&web.id)
        .unwrap_or_else(|status| panic!("StopPodSandbox: {status}"));
    cri.remove_pod(&web.id)
        .unwrap_or_else(|status| panic!("RemovePodSandbox: {status}"));
    assert!(sim.holds_no_state(), "the pod's teardown leaves nothing");
}

/// Backing out through containerd's CRI with a pod running: `cnibpf install` over a bridge +
/// portmap network, a pod with a hostPort served by cnibpf, `cnibpf uninstall` (cnibpf's
/// conflist turns release-only), a new pod made by the restored network (portmap's iptables),
/// the first pod still served; its removal through cnibpf's entry leaves nothing of cnibpf on
/// the node — no pin, program on the uplink, socket hook, lock or statistics file, conflist or
/// binary — and the runtime reads the primary's file again for the second pod's removal.
#[test]
fn uninstall_with_a_pod_running_leaves_nothing_once_it_is_removed() {
    let sim = SimHost::on(Backend::Ebpf, "criu", json!({ "ipMasq": true }));
    let installed = Installed::start(&sim);
    let (containerd, conf_dir, bin_dir, own_file) = (
        &installed.containerd,
        &installed.conf_dir,
        &installed.bin_dir,
        &installed.own_file,
    );
    let mut cri = containerd.client();
    let web = serving_pod(&mut cri, containerd, "web", 18080);
    assert_eq!(pods_of(&sim), ["shop/web"], "cnibpf serves the pod");

    sim.uninstall_with_pods_running(conf_dir, bin_dir);
    let released = installed.read(own_file);
    assert_eq!(
        types(&released),
        ["bridge", "portmap", "cnibpf"],
        "{released:#}"
    );
    assert!(
        bin_dir.join("cnibpf").exists(),
        "the binary stays for the DEL"
    );

    let late = serving_pod(&mut cri, containerd, "late", 18081);
    assert_eq!(pods_of(&sim), ["shop/web"], "the new pod is not cnibpf's");
    assert!(
        sim.host
            .exec(&["iptables-save", "-t", "nat"])
            .contains(&late.id),
        "the restored portmap maps the new pod's hostPort"
    );
    assert!(
        outside_gets_the_page(&sim, 18081),
        "the outside reaches the new pod through portmap's hostPort 18081"
    );
    assert!(
        outside_gets_the_page(&sim, 18080),
        "the first pod keeps its hostPort, served by cnibpf"
    );

    cri.stop_pod(&web.id)
        .unwrap_or_else(|status| panic!("StopPodSandbox: {status}"));
    cri.remove_pod(&web.id)
        .unwrap_or_else(|status| panic!("RemovePodSandbox: {status}"));
    assert_uninstalled(&sim, &conf_dir.join(own_file), &bin_dir.join("cnibpf"));

    cri.stop_pod(&late.id)
        .unwrap_or_else(|status| panic!("StopPodSandbox: {status}\n{}", containerd.log()));
    cri.remove_pod(&late.id)
        .unwrap_or_else(|status| panic!("RemovePodSandbox: {status}"));
    let nat = sim.host.exec(&["iptables-save", "-t", "nat"]);
    assert!(
        !nat.contains(&late.id),
        "the restored network's portmap removed the new pod's rules:\n{nat}"
    );
    assert!(sim.holds_no_state(), "nothing of cnibpf");
}
