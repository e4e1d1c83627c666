//! Changes while flows run: a new uplink address, a new exclusion, `ipMasq` turned off and
//! on by a re-ADD.

use super::*;

fn a_changed_uplink_address_takes_effect_at_the_next_packet(backend: Backend) {
    let host = masquerading(backend, "mq-addr");
    let container = host.container("c1", Value::Null);
    let new_addresses = [
        (Family::V4, "203.0.113.9", "24", "203.0.113.2"),
        (Family::V6, "2001:db8:1::9", "64", "2001:db8:1::2"),
    ];
    host.host
        .sysctl("net.ipv4.conf.all.promote_secondaries", "1");
    host.host
        .sysctl("net.ipv4.conf.up0.promote_secondaries", "1");
    // A running flow, from a fixed port: its next datagram after the change leaves from the
    // new address (eBPF: the FIB's answer no longer matches its translation; nftables: the
    // kernel drops masquerade bindings of a removed address).
    let udp_servers: Vec<UdpServer> = Family::BOTH
        .iter()
        .map(|family| UdpServer::start(&host.outside, family.any(5300 + *family as u16), "hi"))
        .collect();
    let udp_target = |family: Family| SocketAddr::new(family.outside(), 5300 + family as u16);
    let running_flow = |family: Family| {
        let target = udp_target(family);
        container
            .netns
            .run(move || udp_exchange_from(41_000, target, CLIENT_TIMEOUT))
            .map(|(answer, _)| answer)
    };
    for family in Family::BOTH {
        assert_eq!(
            running_flow(family).as_deref(),
            Ok("hi"),
            "{family:?}: the running flow before the change"
        );
    }
    for (family, new, prefix, gateway) in new_addresses {
        let old = uplink_address(family);
        let version = if family == Family::V4 { "-4" } else { "-6" };
        host.host.exec(&[
            "ip",
            version,
            "addr",
            "add",
            &format!("{new}/{prefix}"),
            "dev",
            "up0",
            "nodad",
        ]);
        host.host.exec(&[
            "ip",
            version,
            "addr",
            "del",
            &format!("{old}/{prefix}"),
            "dev",
            "up0",
        ]);
        host.host
            .exec(&["ip", version, "route", "replace", "default", "via", gateway]);
    }
    for ((family, new, _, _), server) in new_addresses.iter().zip(&udp_servers) {
        assert_eq!(
            running_flow(*family).as_deref(),
            Ok("hi"),
            "{family:?}: the running flow after the change"
        );
        let seen: Vec<(String, u16)> = server
            .peers()
            .iter()
            .map(|peer| (peer.ip().to_string(), peer.port()))
            .collect();
        let old = uplink_address(*family).to_string();
        assert_eq!(seen.len(), 2, "{family:?}: {seen:?}");
        assert_eq!(seen[0].0, old, "{family:?}: before, from the old address");
        assert_eq!(
            seen[1].0,
            new.to_string(),
            "{family:?}: then from the new one"
        );
    }
    let servers: Vec<TcpServer> = Family::BOTH
        .iter()
        .map(|family| TcpServer::start(&host.outside, family.any(8080 + *family as u16), "hello"))
        .collect();
    let target = |family: Family| SocketAddr::new(family.outside(), 8080 + family as u16);
    // No plugin run: the next connection leaves from the new address (eBPF: the FIB chooses
    // it per packet; nftables: the kernel's masquerade).
    for ((family, new, _, _), server) in new_addresses.iter().zip(&servers) {
        assert_eq!(
            tcp_request(&container.netns, target(*family)).as_deref(),
            Ok("hello"),
            "{family:?}: at once"
        );
        let seen: Vec<String> = server
            .peers()
            .iter()
            .map(|peer| peer.ip().to_string())
            .collect();
        assert_eq!(seen, [new.to_string()], "{family:?}: from the new address");
    }
    host.check(&container)
        .unwrap_or_else(|error| panic!("CHECK: {error}"));
    let inspect = host.inspect();
    let uplink = &inspect["uplinks"][0];
    assert_eq!(
        (
            uplink["ifname"].as_str(),
            uplink["masqueradeV4"].as_str(),
            uplink["masqueradeV6"].as_str()
        ),
        (Some("up0"), Some("203.0.113.9"), Some("2001:db8:1::9")),
        "inspect shows the addresses CHECK recorded: {inspect}"
    );
    for ((family, new, _, _), server) in new_addresses.iter().zip(&servers) {
        assert_eq!(
            tcp_request(&container.netns, target(*family)).as_deref(),
            Ok("hello"),
            "{family:?} after CHECK"
        );
        let seen: Vec<String> = server
            .peers()
            .iter()
            .map(|peer| peer.ip().to_string())
            .collect();
        assert!(
            !seen.is_empty() && seen.iter().all(|peer| peer == new),
            "{family:?}: {seen:?}"
        );
    }
}

/// As with conntrack's NAT binding: a connection running when an exclusion is added keeps its
/// translation to its end; connections opened after it are not masqueraded. Also where the
/// container's traffic crosses the host stack (`hostFirewall`: masqueraded at the uplink).
fn an_exclusion_added_later_applies_to_new_connections_and_spares_running_ones(backend: Backend) {
    for host_firewall in [false, true] {
        exclusion_added_later(backend, host_firewall);
    }
}

fn exclusion_added_later(backend: Backend, host_firewall: bool) {
    let keys = json!({ "ipMasq": true, "hostFirewall": host_firewall });
    let host = SimHost::on(
        backend,
        &format!("mq-excl{}", u8::from(host_firewall)),
        keys,
    );
    let container = host.container("c1", Value::Null);
    host.route_outside_to_containers();
    let _echo: Vec<StreamEchoServer> = Family::BOTH
        .iter()
        .map(|family| StreamEchoServer::start(&host.outside, family.any(7100 + *family as u16)))
        .collect();
    let servers: Vec<TcpServer> = Family::BOTH
        .iter()
        .map(|family| TcpServer::start(&host.outside, family.any(8100 + *family as u16), "hi"))
        .collect();
    let mut running: Vec<Conversation> = Family::BOTH
        .iter()
        .map(|family| {
            let target = SocketAddr::new(family.outside(), 7100 + *family as u16);
            let mut conversation = Conversation::open(&container.netns, target)
                .unwrap_or_else(|error| panic!("{family:?}: open: {error}"));
            conversation
                .exchange(b"before", CLIENT_TIMEOUT)
                .unwrap_or_else(|error| panic!("{family:?}: before the exclusion: {error}"));
            conversation
        })
        .collect();
    let excluded: Vec<String> = Family::BOTH
        .iter()
        .map(|family| match family.outside() {
            IpAddr::V4(addr) => format!("{addr}/32"),
            IpAddr::V6(addr) => format!("{addr}/128"),
        })
        .collect();
    host.readd_with(
        &container,
        json!({ "ipMasq": true, "hostFirewall": host_firewall, "ipMasqExclude": excluded }),
    )
    .unwrap_or_else(|error| panic!("ADD with the exclusion: {error}"));
    for (family, conversation) in Family::BOTH.iter().zip(&mut running) {
        conversation
            .exchange(b"after", CLIENT_TIMEOUT)
            .unwrap_or_else(|error| {
                panic!("{family:?} (hostFirewall {host_firewall}): the running connection broke: {error}")
            });
    }
    for (family, server) in Family::BOTH.iter().zip(&servers) {
        let target = SocketAddr::new(family.outside(), 8100 + *family as u16);
        assert_eq!(
            tcp_request(&container.netns, target).as_deref(),
            Ok("hi"),
            "{family:?}: a new connection"
        );
        let seen: Vec<IpAddr> = server.peers().iter().map(SocketAddr::ip).collect();
        assert_eq!(
            seen,
            [container.at(*family, 0).ip()],
            "{family:?} (hostFirewall {host_firewall}): a new connection is not masqueraded"
        );
    }
}

fn ip_masq_turned_off_and_on_by_a_new_add_applies_to_the_next_connection(backend: Backend) {
    let host = masquerading(backend, "mq-toggle");
    // Without masquerade the outside answers the container's own address.
    host.route_outside_to_containers();
    let container = host.container("c1", Value::Null);
    let servers: Vec<TcpServer> = Family::BOTH
        .iter()
        .map(|family| TcpServer::start(&host.outside, family.any(8090 + *family as u16), "hi"))
        .collect();
    for (round, ip_masq) in [true, false, true].into_iter().enumerate() {
        if round > 0 {
            host.readd_with(&container, json!({ "ipMasq": ip_masq }))
                .unwrap_or_else(|error| panic!("ADD with ipMasq {ip_masq}: {error}"));
        }
        for (family, server) in Family::BOTH.iter().zip(&servers) {
            let target = SocketAddr::new(family.outside(), 8090 + *family as u16);
            assert_eq!(
                tcp_request(&container.netns, target).as_deref(),
                Ok("hi"),
                "{family:?}, ipMasq {ip_masq}"
            );
            let expected = if ip_masq {
                uplink_address(*family)
            } else {
                container.at(*family, 0).ip()
            };
            assert_eq!(
                server.peers().last().map(SocketAddr::ip),
                Some(expected),
                "{family:?}: a new connection with ipMasq {ip_masq} (round {round})"
            );
        }
    }
}

for_both_backends!(
    ip_masq_turned_off_and_on_by_a_new_add_applies_to_the_next_connection,
    an_exclusion_added_later_applies_to_new_connections_and_spares_running_ones,
    a_changed_uplink_address_takes_effect_at_the_next_packet,
);
