//! The CNI filter proposal's own example, end to end: an LDAP-like service on network
//! `protected` takes connections from network `dmz` alone (`srcNetwork`), whatever pods come
//! and go there; what else comes is refused at once (`REJECT`: a reset, an ICMP error, within
//! a rate limit); the allowed connections are reported (`log`).

use std::time::Instant;

use cnibpf_tests::{
    monitor::Monitor,
    packet::{ethernet, ipv4, tcp},
    topology::{Network, port_mappings as mappings},
    traffic::{Sniffer, send_frames},
};

use super::*;

const LDAP: u16 = 389;
/// Where the service sends what it must not (its egress REJECT rules).
const CLOSED: u16 = 5353;
const DMZ_BRIDGE: &str = "cnd0";

/// IPAM ranges of host-local: one per family, `first..=last` of the subnets' hosts.
fn ranges(v4: &str, v6: &str, first: u8, last: u8) -> Value {
    json!([
        [{ "subnet": format!("{v4}.0/24"), "rangeStart": format!("{v4}.{first}"), "rangeEnd": format!("{v4}.{last}") }],
        [{ "subnet": format!("{v6}::/64"), "rangeStart": format!("{v6}::{first:x}"), "rangeEnd": format!("{v6}::{last:x}") }]
    ])
}

/// The service's rules: LDAP from `dmz` (logged), everything else from `other` and from the
/// outside refused, its own connections to [`CLOSED`] refused, the rest of what it sends
/// allowed; default DROP.
fn protected_keys() -> Value {
    json!({
        "filter": [
            { "index": 10, "srcNetwork": "dmz", "proto": "tcp", "dport": LDAP, "direction": "ingress",
              "target": "ALLOW", "log": true },
            { "index": 20, "srcNetwork": "other", "direction": "ingress", "target": "reject" },
            { "index": 30, "src": format!("{OUTSIDE_ADDR}/32"), "direction": "ingress", "target": "REJECT" },
            { "index": 31, "src": format!("{OUTSIDE_ADDR6}/128"), "direction": "ingress", "target": "REJECT" },
            { "index": 40, "proto": "tcp", "dport": CLOSED, "direction": "egress", "target": "REJECT" },
            { "index": 41, "proto": "udp", "dport": CLOSED, "direction": "egress", "target": "REJECT" },
            { "index": 50, "direction": "egress", "target": "ALLOW" },
        ],
        "filterDefault": "DROP",
    })
}

/// A TCP connect from `netns` to `target` that must be refused at once (a reset).
fn refused_at_once(netns: &Netns, target: SocketAddr, what: &str) {
    let started = Instant::now();
    let outcome = netns.run(move || tcp_exchange(target, CLIENT_TIMEOUT));
    let took = started.elapsed();
    match outcome {
        Err(error) if error.contains("refused") => {}
        other => panic!("{what}: {target} is refused, not {other:?} (after {took:?})"),
    }
    assert!(
        took < Duration::from_secs(1),
        "{what}: refused within 1 s, took {took:?}"
    );
}

/// The ICMP error a blocked UDP query gets: "administratively prohibited", which Linux reports
/// as unreachable (IPv4) and as not permitted (IPv6).
fn prohibited(netns: &Netns, target: SocketAddr, what: &str) {
    let expected = if target.is_ipv4() {
        std::io::ErrorKind::HostUnreachable
    } else {
        std::io::ErrorKind::PermissionDenied
    };
    assert_eq!(
        udp_error(netns, target),
        expected,
        "{what}: UDP to {target}"
    );
}

fn the_dmz_reaches_the_protected_network_alone(backend: Backend) {
    let sim = SimHost::on(backend, "fl-dmz", json!({}));
    let protected = sim.add_network(
        "protected",
        "cnp0",
        ranges("10.31.0", "fd00:31", 2, 99),
        protected_keys(),
    );
    // `dmz` and `other` share a bridge and a subnet, apart in their ranges: an address one
    // gave up, the other may give again.
    let dmz = sim.add_network(
        "dmz",
        DMZ_BRIDGE,
        ranges("10.32.0", "fd00:32", 2, 99),
        json!({}),
    );
    let other = sim.add_network(
        "other",
        DMZ_BRIDGE,
        ranges("10.32.0", "fd00:32", 100, 199),
        json!({}),
    );
    let service = protected.container("ldap", mappings(&[(8389, LDAP, "tcp")]));
    let _servers = Family::BOTH
        .map(|family| TcpServer::start(&service.netns, service.at(family, LDAP), "ldap"));
    let mut monitor = Monitor::start(&sim, &["--matches", "--json"]);
    let events = monitor.lines();
    // The eBPF datapath's drops go to a ring of their own, which `monitor` follows too.
    let mut drops = (backend == Backend::Ebpf).then(|| Monitor::start(&sim, &["--json"]));
    let dropped = drops.as_mut().map(Monitor::lines);
    // The monitor follows from its start: give it the moment to open its events.
    std::thread::sleep(Duration::from_millis(300));
    let first = dmz.container("a", Value::Null);
    let outsider = other.container("o", Value::Null);
    for family in Family::BOTH {
        let ldap = service.at(family, LDAP);
        assert_eq!(
            tcp_request(&first.netns, ldap).as_deref(),
            Ok("ldap"),
            "{family:?}: a dmz pod reaches the service"
        );
        refused_at_once(&outsider.netns, ldap, "a pod of another network");
        prohibited(
            &outsider.netns,
            service.at(family, 53),
            "a pod of another network",
        );
        refused_at_once(
            &sim.outside,
            sim.uplink(family, 8389),
            "the outside, by the hostPort",
        );
        // Both directions: what the service sends to a closed port is refused too.
        let _dmz_server = TcpServer::start(&first.netns, first.at(family, CLOSED), "open");
        refused_at_once(
            &service.netns,
            first.at(family, CLOSED),
            "the service's own",
        );
        prohibited(
            &service.netns,
            first.at(family, CLOSED),
            "the service's own",
        );
    }
    let logged = first_line_matching(&events, |line| {
        let event: Value = serde_json::from_str(line).unwrap_or_default();
        event["rule"] == 10 && event["src"] == first.address.to_string()
    })
    .unwrap_or_else(|| panic!("the dmz pod's connection is reported by rule 10's log"));
    let event: Value = serde_json::from_str(&logged).expect("JSON");
    assert_eq!(
        (
            event["verdict"].as_str(),
            event["dport"].as_u64(),
            event["network"].as_str()
        ),
        (Some("ALLOW"), Some(u64::from(LDAP)), Some("protected")),
        "{event}"
    );

    // Membership is live: a dmz pod started later is a member at once, a DELed one no more.
    let second = dmz.container("b", Value::Null);
    assert_eq!(
        tcp_request(&second.netns, service.at(Family::V4, LDAP)).as_deref(),
        Ok("ldap")
    );
    dmz.del(&first).expect("DEL of the first dmz pod");
    let reusing = add_at(&sim, "other", first.address, first.address6);
    let reuser = reusing.container("r", Value::Null);
    assert_eq!(
        reuser.address, first.address,
        "the address is given again, to `other`"
    );
    refused_at_once(
        &reuser.netns,
        service.at(Family::V4, LDAP),
        "the address's new pod",
    );
    let members = &sim.inspect()["networks"];
    let dmz_members: Vec<&str> = members
        .as_array()
        .into_iter()
        .flatten()
        .filter(|network| network["network"] == "dmz")
        .flat_map(|network| network["members"].as_array().into_iter().flatten())
        .filter_map(|member| member["address"].as_str())
        .collect();
    assert!(
        dmz_members.contains(&second.address.to_string().as_str())
            && !dmz_members.contains(&first.address.to_string().as_str()),
        "inspect shows dmz's members as they are: {members:#}"
    );

    // A flood of refused SYNs gets its answers within the limit (20 at once and 20 a second
    // each CPU may send; two CPUs here, 1.5 s), the rest counted.
    let answered = syn_flood(&sim, &outsider, service.address, 500);
    let limit = 2 * (20 + 30);
    assert!(
        answered > 0 && answered <= limit,
        "{answered} resets to 500 SYNs sent within a second, at most {limit}"
    );
    let suppressed =
        sim.inspect()["counters"][backend.name()]["reject answers suppressed (rate limit)"]
            .as_u64()
            .unwrap_or_default();
    assert!(
        suppressed > 0,
        "the rate limit's suppressed answers are counted"
    );

    // Refused packets count as drops of their own reason, and the eBPF monitor shows them so.
    let rejected = sim.inspect()["drops"][backend.name()]["filter_reject"]["packets"]
        .as_u64()
        .unwrap_or_default();
    assert!(
        rejected >= 500,
        "{rejected} packets counted as filter_reject"
    );
    if let Some(dropped) = &dropped {
        let line = first_line_matching(dropped, |line| {
            line.contains("\"reason\":\"filter_reject\"")
        })
        .unwrap_or_else(|| panic!("the monitor shows a refused packet with reason filter_reject"));
        assert!(line.contains("\"verdict\":\"REJECT\""), "{line}");
    }
    // Only the logging rule reported: the refused connections (rule 20, no log) did not.
    let lines: Vec<String> = events.try_iter().collect();
    monitor.interrupt();
    assert!(
        lines.iter().all(|line| !line.contains("\"rule\":20")),
        "rules without log are not reported: {lines:?}"
    );
}

/// Network `name` again, whose IPAM gives `v4` and `v6` only (the addresses a pod of another
/// network gave up).
fn add_at<'a>(
    sim: &'a SimHost,
    name: &str,
    v4: std::net::Ipv4Addr,
    v6: std::net::Ipv6Addr,
) -> Network<'a> {
    let [a, b, c, last] = v4.octets();
    let prefix6: Vec<String> = v6.segments()[..2]
        .iter()
        .map(|segment| format!("{segment:x}"))
        .collect();
    let last6 = u8::try_from(v6.segments()[7]).expect("a small host part");
    assert_eq!(
        last, last6,
        "the families' host parts agree in these ranges"
    );
    sim.add_network(
        name,
        DMZ_BRIDGE,
        ranges(&format!("{a}.{b}.{c}"), &prefix6.join(":"), last, last),
        json!({}),
    )
}

/// SYNs from `from` to `target`'s LDAP port, `count` of them at once (other source ports,
/// sent as frames: no stack of the sender's waits for their answers); the resets that came
/// back.
fn syn_flood(sim: &SimHost, from: &Container, target: std::net::Ipv4Addr, count: u16) -> usize {
    let mac = from.netns.mac("eth0");
    let gateway = sim.host.mac(DMZ_BRIDGE);
    let frames = (0..count)
        .map(|port| {
            let segment = tcp(
                from.address.into(),
                target.into(),
                20_000 + port,
                LDAP,
                0x02,
                &[],
            );
            let packet = ipv4(from.address, target, 6, &[], (false, 0), &segment);
            ethernet(gateway, mac, 0x0800, &packet)
        })
        .collect();
    let sniffer = Sniffer::start(&from.netns, "eth0");
    let started = Instant::now();
    send_frames(&from.netns, "eth0", frames);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "the flood took {:?}: the limit's bound counts one second",
        started.elapsed()
    );
    std::thread::sleep(Duration::from_millis(500));
    sniffer
        .frames()
        .iter()
        .filter(|frame| {
            frame.len() >= 54
                && frame[12..14] == [0x08, 0x00]
                && frame[23] == 6
                && frame[34..36] == LDAP.to_be_bytes()
                && frame[47] & 0x04 != 0
        })
        .count()
}

for_both_backends!(the_dmz_reaches_the_protected_network_alone);
