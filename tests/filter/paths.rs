//! Every path into a container is filtered on the container's side of a translation:
//! hostPort DNAT, hairpin, neighbours on one bridge.

use super::*;

fn host_port_traffic_is_filtered_by_the_container_side_addresses(backend: Backend) {
    // The rules name containerPort 80; clients use hostPort 8080.
    let host = SimHost::on(
        backend,
        "fl-hostport",
        json!({ "capabilities": { "portMappings": true }, "filter": [
            { "index": 1, "src": format!("{OUTSIDE_ADDR}/32"), "proto": "tcp", "dport": 80,
              "target": "DROP" },
            { "index": 2, "src": format!("{OUTSIDE_ADDR6}/128"), "proto": "tcp", "dport": 80,
              "target": "DROP" },
        ]}),
    );
    let container = host.container("c1", port_mappings(&[(8080, 80, "tcp"), (8081, 81, "tcp")]));
    for family in Family::BOTH {
        let _guarded = TcpServer::start(&container.netns, family.any(80), "80");
        let _open = TcpServer::start(&container.netns, family.any(81), "81");
        assert_eq!(
            tcp_request(&host.outside, host.uplink(family, 8081)).as_deref(),
            Ok("81"),
            "{family:?}: hostPort 8081 (container port 81) is not filtered"
        );
        assert!(
            tcp_dropped(&host.outside, host.uplink(family, 8080)),
            "{family:?}: hostPort 8080 arrives as container port 80 from the outside: dropped"
        );
        let (answer, _) = host
            .host_client("tcp", host.uplink(family, 8080))
            .unwrap_or_else(|error| panic!("{family:?}: a host process, same hostPort: {error}"));
        assert_eq!(
            answer, "80",
            "{family:?}: the rules' src is the outside only"
        );
    }
    // Hairpin: a neighbour reaching the hostPort arrives with its own address as the source.
    let neighbour = host.container("c2", Value::Null);
    let _open = TcpServer::start(&container.netns, Family::V4.any(81), "81");
    assert_eq!(
        tcp_request(&neighbour.netns, host.uplink(Family::V4, 8081)).as_deref(),
        Ok("81"),
        "hairpin from the neighbour"
    );
    let mut rules = inspected_filter(&host, &container)["rules"].clone();
    if let Some(rules) = rules.as_array_mut() {
        for rule in rules.iter_mut().filter_map(Value::as_object_mut) {
            rule.retain(|_, value| !value.is_null());
            for counter in ["packets", "bytes", "connstate", "direction"] {
                rule.remove(counter);
            }
        }
        rules.push(
            json!({ "index": 3, "src": format!("{}/32", neighbour.address),
                           "target": "DROP" }),
        );
    }
    host.readd_with(&container, json!({ "filter": rules }))
        .unwrap_or_else(|error| panic!("re-ADD: {error}"));
    assert!(
        tcp_dropped(&neighbour.netns, host.uplink(Family::V4, 8081)),
        "hairpin traffic is filtered with the neighbour's address as its source"
    );
}

/// Filtered containers reach their own hostPorts and their neighbours' (hairpin), through the
/// uplink's address and the gateway's, both families, TCP and UDP; the filter still judges that
/// traffic (a hostPort leading to a dropped port stays closed) and the bridged traffic between
/// neighbours. On nftables the bridge then hands its frames to the IP hooks: the ports' hairpin
/// mode is what lets a container's DNATed frame back to itself.
fn hairpin_reaches_itself_and_its_neighbour_with_filters_on(backend: Backend) {
    let host = SimHost::on(
        backend,
        "fl-hairpin",
        json!({ "filter": [
            { "index": 1, "direction": "ingress", "proto": "tcp", "dport": 81, "target": "DROP" },
        ]}),
    );
    let c1 = host.container(
        "c1",
        port_mappings(&[(8080, 80, "tcp"), (8082, 81, "tcp"), (5353, 53, "udp")]),
    );
    let c2 = host.container("c2", port_mappings(&[(8081, 80, "tcp")]));
    for family in Family::BOTH {
        let _servers = [
            TcpServer::start(&c1.netns, c1.at(family, 80), "c1"),
            TcpServer::start(&c1.netns, c1.at(family, 81), "c1 81"),
            TcpServer::start(&c2.netns, c2.at(family, 80), "c2"),
            TcpServer::start(&c2.netns, c2.at(family, 81), "c2 81"),
        ];
        let _dns = UdpServer::start(&c1.netns, c1.at(family, 53), "dns c1");
        let gateway = match family {
            Family::V4 => SocketAddr::from((GATEWAY, 0)),
            Family::V6 => SocketAddr::from((GATEWAY6, 0)),
        };
        for host_address in [host.uplink(family, 0), gateway] {
            let at = |port| SocketAddr::new(host_address.ip(), port);
            let what =
                |path: &str| format!("{backend:?} {family:?} {path} via {}", host_address.ip());
            assert_eq!(
                tcp_request(&c1.netns, at(8080)).as_deref(),
                Ok("c1"),
                "{}",
                what("c1 to itself")
            );
            assert_eq!(
                tcp_request(&c1.netns, at(8081)).as_deref(),
                Ok("c2"),
                "{}",
                what("c1 to its neighbour")
            );
            assert_eq!(
                tcp_request(&c2.netns, at(8080)).as_deref(),
                Ok("c1"),
                "{}",
                what("c2 to its neighbour")
            );
            let answer = udp_request(&c1.netns, at(5353)).map(|(answer, _)| answer);
            assert_eq!(
                answer.as_deref(),
                Ok("dns c1"),
                "{}",
                what("UDP c1 to itself")
            );
            assert!(
                tcp_dropped(&c1.netns, at(8082)),
                "{}",
                what("c1 to itself, to a port its filter drops")
            );
        }
        assert!(
            tcp_dropped(&c2.netns, c1.at(family, 81)),
            "{backend:?} {family:?}: bridged traffic between neighbours is filtered"
        );
    }
}

/// Containers on one bridge reach each other without the IP stack: the eBPF backend judges at
/// the veth, the nftables backend has the bridge hand its frames to the IP hooks. A DROP a
/// neighbour walks past is the hole this catches.
fn neighbours_on_one_bridge_are_filtered(backend: Backend) {
    let host = SimHost::on(
        backend,
        "fl-bridge",
        json!({ "filter": [
            { "index": 1, "direction": "ingress", "proto": "tcp", "dport": 8080, "target": "DROP" },
            { "index": 2, "direction": "ingress", "proto": "udp", "dport": 5353, "target": "DROP" },
        ]}),
    );
    let guarded = host.container("c1", Value::Null);
    let neighbour = host.container("c2", Value::Null);
    for family in Family::BOTH {
        let _server = TcpServer::start(&guarded.netns, family.any(8080), "bridged");
        let _open = TcpServer::start(&guarded.netns, family.any(8081), "open");
        let _dns = UdpServer::start(&guarded.netns, family.any(5353), "dns");
        let _dns_open = UdpServer::start(&guarded.netns, family.any(5354), "dns open");
        assert_eq!(
            tcp_request(&neighbour.netns, guarded.at(family, 8081)).as_deref(),
            Ok("open"),
            "{family:?}: the neighbour reaches what no rule drops"
        );
        assert!(
            tcp_dropped(&neighbour.netns, guarded.at(family, 8080)),
            "{family:?}: a DROP holds between neighbours on one bridge"
        );
        assert!(
            udp_dropped(&neighbour.netns, guarded.at(family, 5353)),
            "{family:?}: UDP too"
        );
        assert_eq!(
            udp_from(&neighbour.netns, 0, guarded.at(family, 5354)).as_deref(),
            Ok("dns open"),
            "{family:?}: replies of allowed UDP come back"
        );
    }
    // The rule's counter saw the neighbour's packets.
    let inspect = host.inspect();
    let packets = inspect["attachments"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|attachment| attachment["containerID"] == guarded.attachment.container_id)
        .and_then(|attachment| attachment["filter"]["rules"][0]["packets"].as_u64())
        .unwrap_or_default();
    assert!(packets >= 2, "rule 1 counted the dropped SYNs: {inspect}");
}

for_both_backends!(
    neighbours_on_one_bridge_are_filtered,
    host_port_traffic_is_filtered_by_the_container_side_addresses,
    hairpin_reaches_itself_and_its_neighbour_with_filters_on,
);
