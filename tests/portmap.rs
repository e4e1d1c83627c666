//! The first datapath slice: IPv4 TCP/UDP port mapping through the uplink, with real traffic.

use cnibpf_tests::{
    SimHost,
    topology::{OUTSIDE_ADDR, port_mappings},
    traffic::{TcpServer, UdpServer, tcp_request, udp_request},
};
use serde_json::json;

#[test]
fn outside_client_reaches_container_through_host_port() {
    let sim = SimHost::new("pm-basic", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let server = TcpServer::start(&c1.netns, c1.socket(80), "hello from c1");

    let answer = tcp_request(&sim.outside, sim.uplink_target(8080))
        .unwrap_or_else(|error| panic!("request through hostPort 8080 failed: {error}"));
    assert_eq!(answer, "hello from c1");
    let peers = server.peers();
    assert_eq!(peers.len(), 1, "the container saw {peers:?}");
    assert_eq!(
        peers[0].ip(),
        std::net::IpAddr::V4(OUTSIDE_ADDR),
        "the container must see the client's real address"
    );

    sim.del(&c1)
        .unwrap_or_else(|error| panic!("DEL failed: {error}"));
    let refused = tcp_request(&sim.outside, sim.uplink_target(8080));
    assert!(
        refused.is_err(),
        "after DEL the hostPort must be closed, got {refused:?}"
    );
}
