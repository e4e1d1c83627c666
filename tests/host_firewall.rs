//! The host's own firewall and what cnibpf translates: the eBPF datapath hands hostPort and
//! masqueraded traffic past the host's forward chain unless `hostFirewall` keeps it in the
//! stack; the nftables backend always leaves it there. An operator's iptables FORWARD drops
//! show which. The INPUT chain never judges it (it is forwarded, not for the host), as with
//! the reference portmap: a host that locks its INPUT down keeps its pods reachable.

use std::net::SocketAddr;

use cnibpf_tests::{
    SimHost,
    topology::{Backend, OUTSIDE_ADDR, port_mappings},
    traffic::{TcpServer, tcp_request},
};
use serde_json::json;

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
fn the_ebpf_datapath_passes_the_host_firewall_by_unless_asked_not_to() {
    let [open, dropped] = reach(Backend::Ebpf, false, "fwb");
    assert_eq!(open, (true, true), "hostPort and masquerade work");
    assert_eq!(
        dropped,
        (true, true),
        "eBPF: translated traffic does not meet the host's FORWARD chain"
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
