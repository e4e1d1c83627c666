//! What real runtimes and carried-over conflists send: containerd's spelling of capability
//! keys and its CNI_ARGS (the pod is named where an attachment is shown), and the reference
//! portmap's own keys — `conditionsV4` exposes a hostPort to exactly the clients the reference
//! exposes it to, `snat: false` is honoured.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use cnibpf_tests::{
    SimHost, for_both_backends,
    topology::{Backend, Chained, Container, HOST_UPLINK_ADDR, OUTSIDE_ADDR, port_mappings},
    traffic::{TcpServer, tcp_request, tcp_request_from},
};
use serde_json::{Value, json};

/// A second client address in the outside namespace (the first is `OUTSIDE_ADDR`).
const OTHER_OUTSIDE_ADDR: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 3);

/// containerd's CNI library sends Go field names as keys (no JSON tags) and CNI_ARGS with the
/// pod's names, in random order.
fn containerd_keys_and_pod_names(backend: Backend) {
    let sim = SimHost::on(backend, "ri-ctrd", json!({}));
    let args = |name: &str| {
        format!(
            "K8S_POD_INFRA_CONTAINER_ID=0123abcd;K8S_POD_NAME={name};IgnoreUnknown=1;K8S_POD_UID=5f1c;K8S_POD_NAMESPACE=shop"
        )
    };
    let mappings = json!({ "portMappings": [
        { "HostPort": 18080, "ContainerPort": 80, "Protocol": "tcp", "HostIP": "" },
    ] });
    let web = sim
        .add_container_with_args("web", mappings.clone(), &args("web-0"))
        .unwrap_or_else(|error| panic!("ADD with containerd's keys failed: {error}"));
    let _server = TcpServer::start(&web.netns, web.socket(80), "web-0");
    let answer = tcp_request(&sim.outside, sim.uplink_target(18080))
        .unwrap_or_else(|error| panic!("hostPort from containerd's mapping: {error}"));
    assert_eq!(answer, "web-0");

    let inspect = sim.inspect();
    let shown: Vec<&Value> = inspect["attachments"]
        .as_array()
        .expect("attachments")
        .iter()
        .map(|attachment| &attachment["pod"])
        .collect();
    assert_eq!(shown, [&json!("shop/web-0")], "inspect names the pod");
    let pin_path = sim.pin_path.display().to_string();
    let text = String::from_utf8_lossy(&sim.cnibpf(&["inspect", "--pin-path", &pin_path]).stdout)
        .into_owned();
    assert!(text.contains("pod shop/web-0"), "{text}");

    let error = sim
        .add_container_with_args("web2", mappings, &args("web-1"))
        .expect_err("the hostPort is held");
    assert_eq!(error.0.error_code(), Some(100), "{error}");
    assert!(
        error.0.error_msg().contains("(pod shop/web-0)"),
        "the conflict names the pod holding the port: {error}"
    );
}

/// Who reached the hostPort: the outside client from its two addresses, a host process, and a
/// neighbour container (hairpin through the uplink address).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Reach {
    outside: bool,
    other_outside: bool,
    host_process: bool,
    hairpin: bool,
}

fn reach(sim: &SimHost) -> Reach {
    sim.outside.exec(&[
        "ip",
        "addr",
        "add",
        &format!("{OTHER_OUTSIDE_ADDR}/24"),
        "dev",
        "eth0",
    ]);
    let web = sim.container("web", port_mappings(&[(8080, 80, "tcp")]));
    let client = sim.container("client", json!({}));
    let _server = TcpServer::start(&web.netns, web.socket(80), "web");
    let target = SocketAddr::new(IpAddr::V4(HOST_UPLINK_ADDR), 8080);
    let answered = |outcome: Result<String, String>| outcome.is_ok_and(|answer| answer == "web");
    Reach {
        outside: answered(tcp_request_from(&sim.outside, OUTSIDE_ADDR.into(), target)),
        other_outside: answered(tcp_request_from(
            &sim.outside,
            OTHER_OUTSIDE_ADDR.into(),
            target,
        )),
        host_process: answered(sim.host_client("tcp", target).map(|(answer, _)| answer)),
        hairpin: answered(tcp_request(&client.netns, target)),
    }
}

/// The same conditions under the reference portmap and under cnibpf (both backends, and nft
/// syntax where given) reach exactly the same clients.
fn same_reach_as_the_reference(id: &str, iptables: Value, nft: Option<Value>, expected: Reach) {
    let reference = reach(&SimHost::with_chain(
        &format!("{id}-r"),
        vec![Chained::ReferencePortmap(
            json!({ "conditionsV4": iptables }),
        )],
    ));
    assert_eq!(
        reference, expected,
        "the reference portmap with conditionsV4 {iptables}"
    );
    let mut variants = vec![
        (Backend::Ebpf, iptables.clone()),
        (Backend::Nftables, iptables),
    ];
    if let Some(nft) = nft {
        variants.push((Backend::Ebpf, nft.clone()));
        variants.push((Backend::Nftables, nft));
    }
    for (position, (backend, conditions)) in variants.into_iter().enumerate() {
        let sim = SimHost::on(
            backend,
            &format!("{id}{position}"),
            json!({ "conditionsV4": conditions }),
        );
        assert_eq!(
            reach(&sim),
            reference,
            "cnibpf ({}) with conditionsV4 {conditions} reaches other clients than the reference",
            backend.name()
        );
    }
}

#[test]
fn conditions_on_the_source_reach_what_the_reference_reaches() {
    same_reach_as_the_reference(
        "ri-src",
        json!(["-s", format!("{OTHER_OUTSIDE_ADDR}/32")]),
        Some(json!(["ip", "saddr", OTHER_OUTSIDE_ADDR.to_string()])),
        Reach {
            outside: false,
            other_outside: true,
            host_process: false,
            hairpin: false,
        },
    );
}

#[test]
fn negated_conditions_reach_what_the_reference_reaches() {
    same_reach_as_the_reference(
        "ri-nsrc",
        json!(["!", "-s", OTHER_OUTSIDE_ADDR.to_string()]),
        Some(json!([format!("ip saddr != {OTHER_OUTSIDE_ADDR}")])),
        Reach {
            outside: true,
            other_outside: false,
            host_process: true,
            hairpin: true,
        },
    );
}

#[test]
fn interface_conditions_reach_what_the_reference_reaches() {
    same_reach_as_the_reference(
        "ri-if",
        json!(["-i", "up0"]),
        Some(json!(["iifname", "\"up0\""])),
        Reach {
            outside: true,
            other_outside: true,
            host_process: false,
            hairpin: false,
        },
    );
    same_reach_as_the_reference(
        "ri-nif",
        json!(["!", "-i", "up0"]),
        None,
        Reach {
            outside: false,
            other_outside: false,
            host_process: true,
            hairpin: true,
        },
    );
}

/// `snat: false`: a container reaching its own hostPort keeps its own address as the source,
/// so its own stack drops the answer, as with the reference. (A neighbour keeps reaching it on
/// eBPF, whose datapath translates the replies itself; on nftables, as with the reference,
/// the replies go straight back over the bridge untranslated without the masquerade.)
fn snat_false_is_honoured(backend: Backend) {
    let reach_itself = |sim: &SimHost| {
        let web = sim.container("web", port_mappings(&[(8080, 80, "tcp")]));
        let neighbour = sim.container("nb", json!({}));
        let _server = TcpServer::start(&web.netns, web.socket(80), "web");
        let target = SocketAddr::new(IpAddr::V4(HOST_UPLINK_ADDR), 8080);
        (
            tcp_request(&web.netns, target).is_ok(),
            tcp_request(&neighbour.netns, target).is_ok(),
        )
    };
    let id = match backend {
        Backend::Ebpf => "ri-snat",
        Backend::Nftables => "ri-snat-n",
    };
    let reference = reach_itself(&SimHost::with_chain(
        &format!("{id}-r"),
        vec![Chained::ReferencePortmap(json!({ "snat": false }))],
    ));
    assert_eq!(reference, (false, false), "the reference with snat: false");
    let default = SimHost::on(backend, "ri-snat", json!({}));
    assert_eq!(reach_itself(&default), (true, true), "snat absent");
    let no_snat = SimHost::on(backend, "ri-nosnat", json!({ "snat": false }));
    let (itself, neighbour) = reach_itself(&no_snat);
    assert!(
        !itself,
        "snat: false: a container reaching itself is not answered"
    );
    assert_eq!(
        neighbour,
        backend == Backend::Ebpf,
        "snat: false: a neighbour"
    );
}

/// A container that named no pod is shown without one.
fn no_pod_without_cni_args(backend: Backend) {
    let sim = SimHost::on(backend, "ri-nopod", json!({}));
    let _c: Container = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    assert_eq!(sim.inspect()["attachments"][0]["pod"], Value::Null);
}

for_both_backends!(
    containerd_keys_and_pod_names,
    snat_false_is_honoured,
    no_pod_without_cni_args,
);
