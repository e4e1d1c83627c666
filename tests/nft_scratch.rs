use cnibpf_tests::{
    SimHost,
    topology::{Family, port_mappings},
    traffic::{TcpServer, UdpServer, tcp_request, udp_request},
};
use serde_json::{Value, json};

#[test]
fn scratch() {
    let host = SimHost::new(
        "nf-scr",
        json!({"backend": "nftables", "ipMasq": true, "capabilities": {"portMappings": true},
        "filter": [{"index": 1, "proto": "tcp", "dport": 81, "direction": "ingress", "target": "DROP"}]}),
    );
    let c = host.container("c1", port_mappings(&[(8080, 80, "tcp"), (8081, 81, "tcp")]));
    eprintln!(
        "{}",
        host.host.exec(&["nft", "list", "table", "inet", "cnibpf"])
    );
    for family in Family::BOTH {
        let _s = TcpServer::start(&c.netns, family.any(80), "80");
        let _s1 = TcpServer::start(&c.netns, family.any(81), "81");
        eprintln!(
            "{family:?} hostport: {:?}",
            tcp_request(&host.outside, host.uplink(family, 8080))
        );
        eprintln!(
            "{family:?} hostport filtered: {:?}",
            tcp_request(&host.outside, host.uplink(family, 8081))
        );
        let _o = TcpServer::start(&host.outside, family.any(9000), "out");
        let _u = UdpServer::start(&host.outside, family.any(9001), "uout");
        eprintln!(
            "{family:?} masq: {:?} peers {:?}",
            tcp_request(&c.netns, std::net::SocketAddr::new(family.outside(), 9000)),
            _o.peers()
        );
        eprintln!(
            "{family:?} masq udp: {:?}",
            udp_request(&c.netns, std::net::SocketAddr::new(family.outside(), 9001))
        );
        eprintln!(
            "{family:?} hairpin: {:?}",
            tcp_request(&c.netns, host.uplink(family, 8080))
        );
        eprintln!(
            "{family:?} host: {:?}",
            host.host_client("tcp", host.uplink(family, 8080))
        );
    }
    eprintln!("{:#}", host.inspect());
    eprintln!("check: {:?}", host.check(&c));
    host.del(&c).unwrap();
    eprintln!("after del: {}", host.host.exec(&["nft", "list", "tables"]));
    let _ = Value::Null;
}
