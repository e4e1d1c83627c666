//! A pod whose traffic flows while its node's datapath changes under it (an upgrade, a
//! resize): a hostPort TCP connection from outside, a masqueraded TCP connection and UDP flow
//! to outside, a stream of datagrams to a UDP hostPort, and a port its filter drops — and the
//! assertions that all of it carried on, its source check with it.

use std::{
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    time::Duration,
};

use serde_json::{Value, json};

use crate::{
    Container, SimHost, eventually,
    topology::{OUTSIDE_ADDR, port_mappings},
    traffic::{
        Conversation, StreamEchoServer, TcpServer, UdpCounter, UdpSender, UdpServer, tcp_request,
        udp_exchange_from,
    },
};

const WAIT: Duration = Duration::from_secs(3);

/// The pod and what it has going.
#[derive(Debug)]
pub struct LivePod {
    pub container: Container,
    inbound: Conversation,
    outbound: Conversation,
    stream: UdpSender,
    received: UdpCounter,
    outside_udp: UdpServer,
    _servers: (StreamEchoServer, StreamEchoServer, UdpServer, TcpServer),
}

/// cnibpf's keys for a [`LivePod`]'s network on `backend`.
pub fn pod_keys(backend: &str) -> Value {
    json!({ "backend": backend, "ipMasq": true, "filter": [
        { "index": 1, "direction": "ingress", "proto": "tcp", "dport": 81, "target": "DROP" },
    ]})
}
const OUTSIDE_TCP: u16 = 7000;
const OUTSIDE_UDP: u16 = 7001;
/// The source port of the pod's masqueraded UDP flow and of the outside's UDP hostPort client.
const UDP_SOURCE: u16 = 40_053;

impl LivePod {
    /// Starts the pod (container `c1` of `sim`) and its traffic.
    pub fn start(sim: &SimHost) -> Self {
        sim.route_outside_to_containers();
        let container = sim.container(
            "c1",
            port_mappings(&[(8080, 80, "tcp"), (5353, 53, "udp"), (5354, 54, "udp")]),
        );
        let outside = |port| SocketAddr::new(OUTSIDE_ADDR.into(), port);
        let servers = (
            StreamEchoServer::start(&container.netns, container.socket(80)),
            StreamEchoServer::start(&sim.outside, outside(OUTSIDE_TCP)),
            UdpServer::start(&container.netns, container.socket(53), "c1"),
            TcpServer::start(&container.netns, container.socket(81), "c1"),
        );
        let outside_udp = UdpServer::start(&sim.outside, outside(OUTSIDE_UDP), "outside");
        let received = UdpCounter::start(&container.netns, container.socket(54));
        let mut inbound = Conversation::open(&sim.outside, sim.uplink_target(8080))
            .unwrap_or_else(|error| panic!("connect to hostPort 8080: {error}"));
        inbound
            .exchange(b"before", WAIT)
            .unwrap_or_else(|error| panic!("hostPort exchange: {error}"));
        let mut outbound = Conversation::open(&container.netns, outside(OUTSIDE_TCP))
            .unwrap_or_else(|error| panic!("masqueraded connect: {error}"));
        outbound
            .exchange(b"before", WAIT)
            .unwrap_or_else(|error| panic!("masqueraded exchange: {error}"));
        let stream = UdpSender::start(
            &sim.outside,
            vec![sim.uplink_target(5354)],
            Duration::from_millis(2),
        );
        let pod = Self {
            container,
            inbound,
            outbound,
            stream,
            received,
            outside_udp,
            _servers: servers,
        };
        pod.assert_translations(sim, "before");
        pod
    }

    /// The UDP flows both ways keep their translation: replies from the hostPort, and the
    /// pod's datagrams leaving from the address and port they left from before.
    pub fn assert_translations(&self, sim: &SimHost, when: &str) {
        let hostport = sim.uplink_target(5353);
        let (answer, from) = sim
            .outside
            .run(move || udp_exchange_from(UDP_SOURCE, hostport, WAIT))
            .unwrap_or_else(|error| panic!("{when}: UDP hostPort exchange: {error}"));
        assert_eq!((answer.as_str(), from), ("c1", hostport), "{when}");
        let target = SocketAddr::new(OUTSIDE_ADDR.into(), OUTSIDE_UDP);
        let (answer, from) = self
            .container
            .netns
            .run(move || udp_exchange_from(UDP_SOURCE, target, WAIT))
            .unwrap_or_else(|error| panic!("{when}: masqueraded UDP exchange: {error}"));
        assert_eq!((answer.as_str(), from), ("outside", target), "{when}");
        let peers = self.outside_udp.peers();
        assert!(
            peers.iter().all(|peer| *peer == peers[0])
                && peers[0].ip() == sim.uplink_target(0).ip(),
            "{when}: the masqueraded flow keeps one translation: {peers:?}"
        );
        assert!(
            tcp_request(&sim.outside, self.container.socket(81)).is_err(),
            "{when}: the filter drops tcp/81"
        );
    }

    /// The pod sends datagrams from an address not its own: its source check drops and counts
    /// them.
    pub fn assert_source_checked(&self, sim: &SimHost, when: &str) {
        const FOREIGN: Ipv4Addr = Ipv4Addr::new(10, 22, 250, 250);
        let foreign = format!("{FOREIGN}/32");
        let before = self.source_drops(sim);
        let netns = &self.container.netns;
        netns.exec(&["ip", "addr", "add", &foreign, "dev", "eth0"]);
        let target = SocketAddr::new(OUTSIDE_ADDR.into(), 7002);
        netns.run(move || {
            let socket = UdpSocket::bind((FOREIGN, 0))
                .unwrap_or_else(|error| panic!("bind {FOREIGN}: {error}"));
            for _ in 0..5 {
                socket
                    .send_to(b"in someone's name", target)
                    .unwrap_or_else(|error| panic!("send from {FOREIGN}: {error}"));
            }
        });
        netns.exec(&["ip", "addr", "del", &foreign, "dev", "eth0"]);
        assert!(
            eventually(WAIT, || self.source_drops(sim) >= before + 5),
            "{when}: the source check dropped {} of 5 spoofed datagrams",
            self.source_drops(sim) - before
        );
    }

    /// The packets the pod's source check dropped, as inspect shows them.
    fn source_drops(&self, sim: &SimHost) -> u64 {
        let inspect = sim.inspect();
        inspect["attachments"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|attachment| attachment["containerID"] == self.container.attachment.container_id)
            .and_then(|attachment| attachment["sourceCheck"]["droppedPackets"].as_u64())
            .unwrap_or_else(|| panic!("no source check of the pod in {inspect:#}"))
    }

    /// Both TCP connections carry on, and not one datagram of the stream was lost; the pod,
    /// for what follows.
    pub fn assert_carried_on(mut self, when: &str) -> Container {
        self.inbound
            .exchange(b"after", WAIT)
            .unwrap_or_else(|error| panic!("{when}: the hostPort connection broke: {error}"));
        self.outbound
            .exchange(b"after", WAIT)
            .unwrap_or_else(|error| panic!("{when}: the masqueraded connection broke: {error}"));
        let sent = self.stream.stop();
        assert!(
            eventually(WAIT, || self.received.received() == sent),
            "{when}: {} of {sent} datagrams to the UDP hostPort arrived",
            self.received.received()
        );
        self.container
    }
}
