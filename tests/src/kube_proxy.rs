//! kube-proxy's rules in a simulated host, as its iptables mode (`iptables-restore` of the
//! chains it saves: `KUBE-SERVICES`, `KUBE-SVC-…`, `KUBE-SEP-…`, `KUBE-NODEPORTS`,
//! `KUBE-MARK-MASQ`, `KUBE-POSTROUTING`, `KUBE-FORWARD`) and its nftables mode (`table ip
//! kube-proxy`: the `service-ips` verdict map, `service-` and `endpoint-` chains, `masquerading`)
//! write them: a Service's ClusterIP `dnat`ed in prerouting and output to its endpoints, a
//! NodePort with `externalTrafficPolicy: Local` `dnat`ed into a pod with the client's address
//! kept, what kube-proxy marks masqueraded on the way out.

use std::{io::Write as _, net::SocketAddr, process::Stdio};

use crate::Netns;

/// Which of kube-proxy's modes writes the rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Iptables,
    Nftables,
}

impl Mode {
    pub const BOTH: [Self; 2] = [Self::Iptables, Self::Nftables];
}

/// A ClusterIP Service of one port and one endpoint.
#[derive(Clone, Debug)]
pub struct Service {
    /// The ClusterIP and port.
    pub address: SocketAddr,
    /// `tcp` or `udp`.
    pub protocol: &'static str,
    pub endpoint: SocketAddr,
}

/// A NodePort of a Service with `externalTrafficPolicy: Local`: the client's address is kept.
#[derive(Clone, Debug)]
pub struct NodePort {
    pub port: u16,
    pub protocol: &'static str,
    pub endpoint: SocketAddr,
}

/// Puts kube-proxy's rules for `services` and `node_ports` into `netns`, as `mode` writes them,
/// for pods in `cluster_cidrs` (IPv4, IPv6), whose traffic to a Service is not masqueraded by
/// kube-proxy (only what comes from outside the cluster, or from an endpoint to itself).
pub fn install(
    netns: &Netns,
    mode: Mode,
    cluster_cidrs: [&str; 2],
    services: &[Service],
    node_ports: &[NodePort],
) {
    for (ipv4, cluster_cidr) in [(true, cluster_cidrs[0]), (false, cluster_cidrs[1])] {
        let services: Vec<&Service> = services
            .iter()
            .filter(|service| service.address.is_ipv4() == ipv4)
            .collect();
        let node_ports: Vec<&NodePort> = node_ports
            .iter()
            .filter(|node_port| node_port.endpoint.is_ipv4() == ipv4)
            .collect();
        let (program, rules) = match mode {
            Mode::Iptables => (
                if ipv4 {
                    "iptables-restore"
                } else {
                    "ip6tables-restore"
                },
                iptables_rules(cluster_cidr, &services, &node_ports),
            ),
            Mode::Nftables => (
                "nft",
                nftables_rules(ipv4, cluster_cidr, &services, &node_ports),
            ),
        };
        let argv: &[&str] = match mode {
            Mode::Iptables => &[program, "--noflush"],
            Mode::Nftables => &[program, "-f", "-"],
        };
        restore(netns, argv, &rules);
    }
}

/// Removes what [`install`] put in, in either mode.
pub fn uninstall(netns: &Netns) {
    for program in ["iptables", "ip6tables"] {
        for (table, chain) in [
            ("nat", "PREROUTING"),
            ("nat", "OUTPUT"),
            ("nat", "POSTROUTING"),
            ("filter", "FORWARD"),
        ] {
            netns.exec(&[program, "-t", table, "-F", chain]);
        }
        for table in ["nat", "filter"] {
            netns.exec(&[program, "-t", table, "-F"]);
            netns.exec(&[program, "-t", table, "-X"]);
        }
    }
    for family in ["ip", "ip6"] {
        let _ = netns
            .command(&["nft", "delete", "table", family, "kube-proxy"])
            .output();
    }
}

fn restore(netns: &Netns, argv: &[&str], rules: &str) {
    let mut child = netns
        .command(argv)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| panic!("start {argv:?}: {error}"));
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(rules.as_bytes())
        .unwrap_or_else(|error| panic!("write to {argv:?}: {error}"));
    let output = child
        .wait_with_output()
        .unwrap_or_else(|error| panic!("wait for {argv:?}: {error}"));
    assert!(
        output.status.success(),
        "{argv:?} refused kube-proxy's rules: {}\n{rules}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A chain name's hash part, as kube-proxy derives one from the Service's name and port.
fn hash(text: &str) -> String {
    let hash = text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{hash:016X}")
}

/// An address as iptables and nft write a single host: IPv6 without brackets.
fn host(address: SocketAddr) -> String {
    address.ip().to_string()
}

/// `address:port`, IPv6 in brackets, as DNAT targets are written.
fn target(address: SocketAddr) -> String {
    address.to_string()
}

fn iptables_rules(cluster_cidr: &str, services: &[&Service], node_ports: &[&NodePort]) -> String {
    let mut chains = vec![
        "KUBE-SERVICES".to_owned(),
        "KUBE-NODEPORTS".to_owned(),
        "KUBE-POSTROUTING".to_owned(),
        "KUBE-MARK-MASQ".to_owned(),
    ];
    let mut nat = vec![
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES".to_owned(),
        "-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES".to_owned(),
        "-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING".to_owned(),
        "-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000".to_owned(),
        "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN".to_owned(),
        "-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0".to_owned(),
        "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully".to_owned(),
    ];
    for service in services {
        let id = hash(&format!("{service:?}"));
        let (svc, sep) = (format!("KUBE-SVC-{id}"), format!("KUBE-SEP-{id}"));
        let (vip, port, protocol) = (
            host(service.address),
            service.address.port(),
            service.protocol,
        );
        nat.extend([
            format!("-A KUBE-SERVICES -d {vip} -p {protocol} -m comment --comment \"default/svc cluster IP\" -m {protocol} --dport {port} -j {svc}"),
            format!("-A {svc} ! -s {cluster_cidr} -d {vip} -p {protocol} -m {protocol} --dport {port} -j KUBE-MARK-MASQ"),
            format!("-A {svc} -m comment --comment \"default/svc -> {}\" -j {sep}", target(service.endpoint)),
            format!("-A {sep} -s {} -j KUBE-MARK-MASQ", host(service.endpoint)),
            format!("-A {sep} -p {protocol} -m {protocol} -j DNAT --to-destination {}", target(service.endpoint)),
        ]);
        chains.extend([svc, sep]);
    }
    nat.push("-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS".to_owned());
    for node_port in node_ports {
        let id = hash(&format!("{node_port:?}"));
        let (ext, svl, sep) = (
            format!("KUBE-EXT-{id}"),
            format!("KUBE-SVL-{id}"),
            format!("KUBE-SEP-N{}", &id[1..]),
        );
        let (port, protocol) = (node_port.port, node_port.protocol);
        nat.extend([
            format!("-A KUBE-NODEPORTS -p {protocol} -m {protocol} --dport {port} -j {ext}"),
            format!("-A {ext} -j {svl}"),
            format!("-A {svl} -j {sep}"),
            format!(
                "-A {sep} -p {protocol} -m {protocol} -j DNAT --to-destination {}",
                target(node_port.endpoint)
            ),
        ]);
        chains.extend([ext, svl, sep]);
    }
    let declared: Vec<String> = chains
        .iter()
        .map(|chain| format!(":{chain} - [0:0]"))
        .collect();
    format!(
        "*nat\n{}\n{}\nCOMMIT\n*filter\n:KUBE-FORWARD - [0:0]\n\
         -A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n\
         -A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n\
         -A KUBE-FORWARD -m mark --mark 0x4000/0x4000 -j ACCEPT\n\
         -A KUBE-FORWARD -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\nCOMMIT\n",
        declared.join("\n"),
        nat.join("\n")
    )
}

fn nftables_rules(
    ipv4: bool,
    cluster_cidr: &str,
    services: &[&Service],
    node_ports: &[&NodePort],
) -> String {
    let (family, ip, address) = if ipv4 {
        ("ip", "ip", "ipv4_addr")
    } else {
        ("ip6", "ip6", "ipv6_addr")
    };
    let mut chains = Vec::new();
    let mut service_ips = Vec::new();
    let mut service_nodeports = Vec::new();
    for service in services {
        let id = hash(&format!("{service:?}"));
        let (vip, port, protocol) = (
            host(service.address),
            service.address.port(),
            service.protocol,
        );
        service_ips.push(format!("{vip} . {protocol} . {port} : goto service-{id}"));
        chains.push(format!(
            "chain service-{id} {{\n\t{ip} daddr {vip} {protocol} dport {port} {ip} saddr != {cluster_cidr} jump mark-for-masquerade\n\tnumgen random mod 1 vmap {{ 0 : goto endpoint-{id} }}\n}}"
        ));
        chains.push(format!(
            "chain endpoint-{id} {{\n\t{ip} saddr {} jump mark-for-masquerade\n\tmeta l4proto {protocol} dnat to {}\n}}",
            host(service.endpoint),
            target(service.endpoint)
        ));
    }
    for node_port in node_ports {
        let id = hash(&format!("{node_port:?}"));
        let (port, protocol) = (node_port.port, node_port.protocol);
        service_nodeports.push(format!("{protocol} . {port} : goto external-{id}"));
        chains.push(format!(
            "chain external-{id} {{\n\tgoto endpoint-{id}\n}}\nchain endpoint-{id} {{\n\tmeta l4proto {protocol} dnat to {}\n}}",
            target(node_port.endpoint)
        ));
    }
    let elements = |entries: &[String]| {
        if entries.is_empty() {
            String::new()
        } else {
            format!("elements = {{ {} }}", entries.join(", "))
        }
    };
    format!(
        "table {family} kube-proxy {{\n\
         map service-ips {{ type {address} . inet_proto . inet_service : verdict; {} }}\n\
         map service-nodeports {{ type inet_proto . inet_service : verdict; {} }}\n\
         chain nat-prerouting {{\n\ttype nat hook prerouting priority dstnat; policy accept;\n\tjump services\n}}\n\
         chain nat-output {{\n\ttype nat hook output priority -100; policy accept;\n\tjump services\n}}\n\
         chain nat-postrouting {{\n\ttype nat hook postrouting priority srcnat; policy accept;\n\tjump masquerading\n}}\n\
         chain filter-forward {{\n\ttype filter hook forward priority -110; policy accept;\n\tct state invalid drop\n}}\n\
         chain services {{\n\t{ip} daddr . meta l4proto . th dport vmap @service-ips\n\tfib daddr type local meta l4proto . th dport vmap @service-nodeports\n}}\n\
         chain mark-for-masquerade {{\n\tmeta mark set meta mark | 0x4000\n}}\n\
         chain masquerading {{\n\tmeta mark & 0x4000 == 0 return\n\tmeta mark set meta mark ^ 0x4000\n\tmasquerade fully-random\n}}\n\
         {}\n}}\n",
        elements(&service_ips),
        elements(&service_nodeports),
        chains.join("\n")
    )
}
