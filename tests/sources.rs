//! Source address verification (`sourceCheck`, on unless set to false): what a container sends
//! leaves only from its own addresses. A container that takes its neighbour's address can
//! neither send from it — outside or to the neighbours — nor announce it by ARP or neighbour
//! advertisement; what it tried is counted in inspect and, on eBPF, reported by `cnibpf
//! monitor` with their reasons. The same attempts with the check off succeed: the tests can fail.

use std::{
    net::{IpAddr, Ipv6Addr, SocketAddr, UdpSocket},
    time::Duration,
};

use cnibpf_tests::{
    Container, SimHost, eventually, for_both_backends,
    monitor::{first_line_matching, interrupt, monitor_lines, start_monitor},
    packet::{arp_announcement, neighbour_advertisement},
    topology::{Backend, Family, GATEWAY, GATEWAY6, OUTSIDE_ADDR, OUTSIDE_ADDR6, port_mappings},
    traffic::{TcpServer, UdpCounter, send_frame, tcp_request},
};
use serde_json::{Value, json};

const OUTSIDE_PORT: u16 = 9000;

/// What reached the outside and the neighbour when `spoofer` sent in `victim`'s name.
#[derive(Debug, PartialEq, Eq)]
struct Reached {
    /// Datagrams from the victim's IPv4 and IPv6 address at the outside's counter.
    outside: (bool, bool),
    /// The victim took the spoofer's MAC address for its IPv4 and IPv6 gateway.
    gateway_poisoned: (bool, bool),
}

/// `spoofer` takes `victim`'s addresses, sends datagrams from them to the outside, and
/// announces the gateway's addresses as its own (ARP and neighbour advertisement).
fn spoof(sim: &SimHost, spoofer: &Container, victim: &Container) -> Reached {
    let outside4 = UdpCounter::start(
        &sim.outside,
        SocketAddr::new(OUTSIDE_ADDR.into(), OUTSIDE_PORT),
    );
    let outside6 = UdpCounter::start(
        &sim.outside,
        SocketAddr::new(OUTSIDE_ADDR6.into(), OUTSIDE_PORT),
    );
    // The victim knows its gateways (and the paths out work at all).
    for (address, counter) in [
        (IpAddr::from(victim.address), &outside4),
        (IpAddr::from(victim.address6), &outside6),
    ] {
        send_datagrams(victim, address);
        assert!(
            eventually(Duration::from_secs(3), || counter.received() > 0),
            "{address} reaches the outside from its own container"
        );
    }
    let baseline = (outside4.received(), outside6.received());
    // Both know their gateways: the spoofer's datagrams leave at once, not its neighbour
    // solicitations from the borrowed address.
    for container in [victim, spoofer] {
        for gateway in [GATEWAY.to_string(), GATEWAY6.to_string()] {
            container
                .netns
                .exec(&["ping", "-c", "1", "-W", "2", &gateway]);
        }
    }
    let gateway_macs_before = gateway_macs(victim);
    spoofer.netns.exec(&[
        "ip",
        "addr",
        "add",
        &format!("{}/32", victim.address),
        "dev",
        "eth0",
    ]);
    spoofer.netns.exec(&[
        "ip",
        "-6",
        "addr",
        "add",
        &format!("{}/128", victim.address6),
        "dev",
        "eth0",
        "nodad",
    ]);
    send_datagrams(spoofer, victim.address.into());
    send_datagrams(spoofer, victim.address6.into());
    let mac = interface_mac(spoofer);
    send_frame(&spoofer.netns, "eth0", arp_announcement(mac, GATEWAY));
    // Plain, and behind a destination options header (the victim's kernel walks past it).
    for behind_options in [false, true] {
        send_frame(
            &spoofer.netns,
            "eth0",
            neighbour_advertisement(mac, link_local(spoofer), GATEWAY6, behind_options),
        );
    }
    std::thread::sleep(Duration::from_millis(500));
    let after = gateway_macs(victim);
    let mac_text = format_mac(mac);
    assert_ne!(
        gateway_macs_before.0, mac_text,
        "the gateway is not the spoofer"
    );
    Reached {
        outside: (
            outside4.received() > baseline.0,
            outside6.received() > baseline.1,
        ),
        gateway_poisoned: (after.0 == mac_text, after.1 == mac_text),
    }
}

/// A few datagrams from `source` (one of `container`'s addresses) to the outside's counter.
fn send_datagrams(container: &Container, source: IpAddr) {
    let target = SocketAddr::new(
        if source.is_ipv4() {
            OUTSIDE_ADDR.into()
        } else {
            OUTSIDE_ADDR6.into()
        },
        OUTSIDE_PORT,
    );
    container.netns.run(move || {
        let socket =
            UdpSocket::bind((source, 0)).unwrap_or_else(|error| panic!("bind {source}: {error}"));
        for _ in 0..5 {
            socket
                .send_to(b"in someone's name", target)
                .unwrap_or_else(|error| panic!("send from {source}: {error}"));
            std::thread::sleep(Duration::from_millis(20));
        }
    });
}

/// The MAC addresses `container` holds for its IPv4 and IPv6 gateway.
fn gateway_macs(container: &Container) -> (String, String) {
    let lladdr = |family: &str, gateway: String| {
        let shown = container
            .netns
            .exec(&["ip", family, "neigh", "show", &gateway, "dev", "eth0"]);
        shown
            .split_whitespace()
            .skip_while(|word| *word != "lladdr")
            .nth(1)
            .map(str::to_owned)
            .unwrap_or_else(|| panic!("no neighbour entry for {gateway}: {shown:?}"))
    };
    (
        lladdr("-4", GATEWAY.to_string()),
        lladdr("-6", GATEWAY6.to_string()),
    )
}

fn interface_mac(container: &Container) -> [u8; 6] {
    let shown = container
        .netns
        .exec(&["cat", "/sys/class/net/eth0/address"]);
    let bytes: Vec<u8> = shown
        .trim()
        .split(':')
        .map(|byte| u8::from_str_radix(byte, 16).expect("hex"))
        .collect();
    bytes.try_into().expect("six bytes")
}

fn format_mac(mac: [u8; 6]) -> String {
    mac.map(|byte| format!("{byte:02x}")).join(":")
}

fn link_local(container: &Container) -> Ipv6Addr {
    let shown = container.netns.exec(&[
        "ip", "-6", "-o", "addr", "show", "dev", "eth0", "scope", "link",
    ]);
    shown
        .split_whitespace()
        .skip_while(|word| *word != "inet6")
        .nth(1)
        .and_then(|address| address.split('/').next())
        .and_then(|address| address.parse().ok())
        .unwrap_or_else(|| panic!("no link-local address: {shown:?}"))
}

/// `container`'s entry in `cnibpf inspect --json`.
fn inspected(sim: &SimHost, container: &Container) -> Value {
    sim.inspect()["attachments"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|entry| entry["containerID"] == container.attachment.container_id)
        .cloned()
        .unwrap_or_else(|| panic!("{} not in inspect", container.attachment.container_id))
}

fn a_container_cannot_send_or_announce_in_its_neighbours_name(backend: Backend) {
    let sim = SimHost::on(
        backend,
        &format!("src-{}", backend.name()),
        json!({ "ipMasq": true }),
    );
    let spoofer = sim.container("a", Value::Null);
    let victim = sim.container("b", Value::Null);
    let monitor = (backend == Backend::Ebpf).then(|| {
        let mut monitor = start_monitor(&sim, true);
        let lines = monitor_lines(&mut monitor);
        assert!(
            eventually(Duration::from_secs(5), || sim.monitor_following()),
            "the monitor took its lock"
        );
        (monitor, lines)
    });
    let reached = spoof(&sim, &spoofer, &victim);
    assert_eq!(
        reached,
        Reached {
            outside: (false, false),
            gateway_poisoned: (false, false),
        },
        "nothing sent in the neighbour's name gets through"
    );
    let entry = inspected(&sim, &spoofer);
    let check = &entry["sourceCheck"];
    let addresses: Vec<&str> = check["addresses"]
        .as_array()
        .unwrap_or_else(|| panic!("no checked addresses: {entry}"))
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for own in [
        spoofer.address.to_string(),
        spoofer.address6.to_string(),
        link_local(&spoofer).to_string(),
    ] {
        assert!(addresses.contains(&own.as_str()), "{own} in {check}");
    }
    // Five datagrams of each family, an ARP packet and an advertisement at least.
    assert!(
        check["droppedPackets"]
            .as_u64()
            .is_some_and(|dropped| dropped >= 12),
        "the spoofed packets are counted: {check}"
    );
    assert_eq!(
        inspected(&sim, &victim)["sourceCheck"]["droppedPackets"],
        0,
        "the victim sent nothing in another's name"
    );
    sim.check(&spoofer)
        .unwrap_or_else(|error| panic!("CHECK of a source-checked attachment: {error}"));
    if let Some((monitor, lines)) = monitor {
        for claimed in [victim.address.to_string(), victim.address6.to_string()] {
            let Some(line) = first_line_matching(&lines, |line| line.contains(&claimed)) else {
                panic!("no event for a packet from {claimed}");
            };
            let event: Value = serde_json::from_str(&line).expect("JSON event");
            assert_eq!(event["reason"], "source_check_address", "{event}");
            assert_eq!(event["src"], claimed, "{event}");
            assert_eq!(event["direction"], "egress", "{event}");
            assert_eq!(
                event["containerID"], spoofer.attachment.container_id,
                "{event}"
            );
        }
        let Some(line) = first_line_matching(&lines, |line| line.contains("\"arp\"")) else {
            panic!("no event for the ARP announcement");
        };
        assert!(line.contains(&GATEWAY.to_string()), "{line}");
        let event: Value = serde_json::from_str(&line).expect("JSON event");
        assert_eq!(event["reason"], "source_check_arp", "{event}");
        interrupt(monitor);
    }
    for container in [&spoofer, &victim] {
        sim.del(container)
            .unwrap_or_else(|error| panic!("DEL: {error}"));
    }
    assert!(sim.holds_no_state(), "DEL took the source checks with it");
}

fn with_the_check_off_a_container_sends_in_any_name(backend: Backend) {
    let sim = SimHost::on(
        backend,
        &format!("srx-{}", backend.name()),
        json!({ "ipMasq": true, "sourceCheck": false }),
    );
    let spoofer = sim.container("a", Value::Null);
    let victim = sim.container("b", Value::Null);
    assert_eq!(
        inspected(&sim, &spoofer)["sourceCheck"],
        Value::Null,
        "not checked"
    );
    let reached = spoof(&sim, &spoofer, &victim);
    assert_eq!(
        reached,
        Reached {
            outside: (true, true),
            gateway_poisoned: (true, true),
        },
        "without the check the spoofer's packets get through"
    );
    // Switched on by the next ADD, as any other key.
    sim.readd_with(&spoofer, json!({ "sourceCheck": true }))
        .unwrap_or_else(|error| panic!("re-ADD with the check on: {error}"));
    assert!(
        inspected(&sim, &spoofer)["sourceCheck"]["addresses"]
            .as_array()
            .is_some_and(|addresses| !addresses.is_empty()),
        "checked after the re-ADD"
    );
}

/// A container attached twice to one network (eth0 and eth1, one subnet): its replies leave by
/// the interface its routes pick, whatever address they carry, so each interface admits the
/// addresses of both — and still no neighbour's. Both hostPorts answer, before and after the
/// DEL of one attachment; the address of the one gone is refused from then on.
fn a_container_attached_twice_sends_from_the_addresses_of_both(backend: Backend) {
    let sim = SimHost::on(backend, "sc-twice", json!({}));
    let neighbour = sim.container("n1", Value::Null);
    let container = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    // Each interface answers ARP for its own address only, as a host with two interfaces in
    // one subnet is set up (else the host may take one's address for the other's MAC, and
    // keep it after the other is gone).
    container.netns.sysctl("net.ipv4.conf.all.arp_ignore", "1");
    container
        .netns
        .sysctl("net.ipv4.conf.all.arp_announce", "2");
    let second = sim
        .add_interface(&container, "eth1", port_mappings(&[(8081, 81, "tcp")]))
        .unwrap_or_else(|error| panic!("{backend:?}: ADD of eth1: {error}"));
    let _servers = Family::BOTH.map(|family| {
        [
            TcpServer::start(&container.netns, container.at(family, 80), "eth0"),
            TcpServer::start(&container.netns, second.at(family, 81), "eth1"),
        ]
    });
    let answers =
        |port: u16| Family::BOTH.map(|family| tcp_request(&sim.outside, sim.uplink(family, port)));
    let eth0 = Ok("eth0".to_owned());
    let eth1 = Ok("eth1".to_owned());
    assert_eq!(answers(8080), [eth0.clone(), eth0.clone()], "{backend:?}");
    assert_eq!(
        answers(8081),
        [eth1.clone(), eth1.clone()],
        "{backend:?}: eth1's hostPort, its replies leaving by eth0"
    );
    for attachment in [&container, &second] {
        sim.check(attachment)
            .unwrap_or_else(|error| panic!("{backend:?}: CHECK: {error}"));
    }
    sim.del(&second)
        .unwrap_or_else(|error| panic!("{backend:?}: DEL of eth1: {error}"));
    assert_eq!(
        answers(8080),
        [eth0.clone(), eth0],
        "{backend:?}: after the DEL"
    );
    sim.check(&container)
        .unwrap_or_else(|error| panic!("{backend:?}: CHECK after the DEL: {error}"));
    // eth1's address is no longer the container's: taken on eth0, it is refused.
    let outside = UdpCounter::start(
        &sim.outside,
        SocketAddr::new(OUTSIDE_ADDR.into(), OUTSIDE_PORT),
    );
    container.netns.exec(&[
        "ip",
        "addr",
        "add",
        &format!("{}/32", second.address),
        "dev",
        "eth0",
    ]);
    send_datagrams(&container, IpAddr::from(container.address));
    assert!(
        eventually(Duration::from_secs(3), || outside.received() > 0),
        "{backend:?}: its own address reaches the outside"
    );
    let before = outside.received();
    send_datagrams(&container, IpAddr::from(second.address));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        outside.received(),
        before,
        "{backend:?}: the address of the attachment gone is refused"
    );
    drop(outside);
    assert_eq!(
        spoof(&sim, &container, &neighbour),
        Reached {
            outside: (false, false),
            gateway_poisoned: (false, false),
        },
        "{backend:?}: a neighbour's address is still refused"
    );
}

for_both_backends!(
    a_container_attached_twice_sends_from_the_addresses_of_both,
    a_container_cannot_send_or_announce_in_its_neighbours_name,
    with_the_check_off_a_container_sends_in_any_name,
);
