//! What the simulated host's network offers tests: routes to the containers, a far network
//! behind the outside, clients in the host and in namespaces, addresses of the uplink.

use super::*;

impl SimHost {
    /// The pod's network namespace goes without a DEL, and its veth pair with it (how a lost
    /// DEL or a crashed runtime leaves an attachment).
    pub fn vanish(&self, container: &Container) {
        let host_interface = self.host_interface(container);
        container
            .netns
            .exec(&["ip", "link", "del", &container.attachment.ifname]);
        assert!(
            crate::eventually(std::time::Duration::from_secs(5), || !self
                .host
                .exec(&["ip", "-o", "link", "show"])
                .contains(&format!(" {host_interface}@"))),
            "{host_interface} is still there"
        );
    }

    /// The uplink deleted under whatever runs and made again, with its addresses and routes:
    /// at the interface index it had (as a new namespace numbers its first interfaces), or at
    /// the next one the kernel gives. Its index now.
    pub fn remake_uplink(&self, same_index: bool) -> u32 {
        let index = self.uplink_index();
        self.host.exec(&["ip", "link", "del", UPLINK]);
        wire_uplink(&self.host, &self.outside, same_index.then_some(index));
        let remade = self.uplink_index();
        assert_eq!(
            remade == index,
            same_index,
            "{UPLINK} was {index}, is {remade}"
        );
        remade
    }

    /// The uplink's interface index in the host namespace.
    pub fn uplink_index(&self) -> u32 {
        let shown = self.host.exec(&["ip", "-o", "link", "show", UPLINK]);
        shown
            .split(':')
            .next()
            .and_then(|index| index.trim().parse().ok())
            .unwrap_or_else(|| panic!("no index in {shown:?}"))
    }

    /// Gives the outside namespace a route to the container subnets via the uplink, for
    /// traffic that reaches containers by their own address (routed, no NAT).
    pub fn route_outside_to_containers(&self) {
        self.outside.exec(&[
            "ip",
            "route",
            "add",
            SUBNET,
            "via",
            &HOST_UPLINK_ADDR.to_string(),
        ]);
        self.outside.exec(&[
            "ip",
            "-6",
            "route",
            "add",
            SUBNET6,
            "via",
            &HOST_UPLINK_ADDR6.to_string(),
        ]);
    }

    /// A "far" namespace one router hop away: the outside namespace forwards between the uplink
    /// and a link to it whose outside end has `mtu` (so the outside namespace is the router that
    /// sends "fragmentation needed" / "packet too big" when a packet does not fit).
    ///
    /// ```text
    ///   host up0 <-> eth0 outside fr0 (mtu) <-> eth0 far 198.18.0.2/24, 2001:db8:3::2/64
    /// ```
    pub fn far_network(&self, mtu: u32) -> Netns {
        let far = Netns::create(&format!("cbt-{}-far", self.id));
        crate::netns::run_checked(std::process::Command::new("ip").args([
            "link",
            "add",
            "fr0",
            "netns",
            self.outside.name(),
            "mtu",
            &mtu.to_string(),
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            far.name(),
        ]));
        self.outside
            .exec(&["ip", "addr", "add", "198.18.0.1/24", "dev", "fr0"]);
        self.outside.exec(&[
            "ip",
            "-6",
            "addr",
            "add",
            "2001:db8:3::1/64",
            "dev",
            "fr0",
            "nodad",
        ]);
        self.outside.exec(&["ip", "link", "set", "fr0", "up"]);
        self.outside.sysctl("net.ipv4.ip_forward", "1");
        self.outside.sysctl("net.ipv6.conf.all.forwarding", "1");
        far.exec(&[
            "ip",
            "addr",
            "add",
            &format!("{FAR_ADDR}/24"),
            "dev",
            "eth0",
        ]);
        far.exec(&[
            "ip",
            "-6",
            "addr",
            "add",
            &format!("{FAR_ADDR6}/64"),
            "dev",
            "eth0",
            "nodad",
        ]);
        far.exec(&["ip", "link", "set", "eth0", "up"]);
        far.exec(&["ip", "route", "add", "default", "via", "198.18.0.1"]);
        far.exec(&[
            "ip",
            "-6",
            "route",
            "add",
            "default",
            "via",
            "2001:db8:3::1",
        ]);
        far
    }

    /// One request by a "host process": a client in the host namespace and in this host's
    /// cgroup. Returns what it was answered and the peer address it saw.
    pub fn host_client(
        &self,
        protocol: &str,
        target: SocketAddr,
    ) -> Result<(String, SocketAddr), String> {
        self.client_in(&self.host, protocol, target)
    }

    /// [`Self::host_client`] from another namespace (still in this host's cgroup).
    pub fn client_in(
        &self,
        netns: &Netns,
        protocol: &str,
        target: SocketAddr,
    ) -> Result<(String, SocketAddr), String> {
        let mut process = std::process::Command::new(test_client());
        process
            .arg(&self.cgroup)
            .arg(protocol)
            .arg(target.to_string());
        chain::enter_netns_on_exec(&mut process, &netns.path());
        let output = process.output().expect("run cnibpf-test-client");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let field = |name: &str| {
            stdout
                .lines()
                .find_map(|line| line.strip_prefix(&format!("{name}=")).map(str::to_owned))
        };
        if !output.status.success() {
            return Err(field("error").unwrap_or(stdout));
        }
        let answer = field("answer").unwrap_or_default();
        let peer = field("peer")
            .and_then(|peer| peer.parse().ok())
            .ok_or_else(|| format!("no peer in {stdout}"))?;
        Ok((answer, peer))
    }

    /// A UDP socket of a "host process": made and bound to `bind` in the host namespace by a
    /// process in this host's cgroup (a socket belongs to its maker's cgroup, whose socket
    /// hooks see what it sends), then handed to the test, which uses it as its own.
    pub fn host_udp_socket(&self, bind: SocketAddr) -> std::net::UdpSocket {
        use std::os::{fd::OwnedFd, unix::net::UnixStream};
        let (ours, theirs) = UnixStream::pair().expect("socket pair");
        let mut process = std::process::Command::new(test_client());
        process
            .arg(&self.cgroup)
            .arg("udp-socket")
            .arg(bind.to_string())
            .stdin(std::process::Stdio::from(OwnedFd::from(theirs)));
        chain::enter_netns_on_exec(&mut process, &self.host.path());
        let output = process.output().expect("run cnibpf-test-client");
        assert!(
            output.status.success(),
            "a host process's UDP socket on {bind}: {}",
            String::from_utf8_lossy(&output.stdout)
        );
        let socket = std::net::UdpSocket::from(crate::traffic::receive_descriptor(&ours));
        socket
            .set_read_timeout(Some(crate::traffic::CLIENT_TIMEOUT))
            .expect("timeout");
        socket
    }

    pub fn uplink_target(&self, port: u16) -> SocketAddr {
        SocketAddr::new(IpAddr::V4(HOST_UPLINK_ADDR), port)
    }

    /// The uplink address of `family` (`Family::V4` or `V6`) with `port`.
    pub fn uplink(&self, family: Family, port: u16) -> SocketAddr {
        match family {
            Family::V4 => SocketAddr::new(IpAddr::V4(HOST_UPLINK_ADDR), port),
            Family::V6 => SocketAddr::new(IpAddr::V6(HOST_UPLINK_ADDR6), port),
        }
    }
}

/// The test client binary (`tests/src/bin/cnibpf-test-client.rs`), built next to the tests.
fn test_client() -> PathBuf {
    // Integration tests run from target/<profile>/deps, xtask from target/<profile>.
    let executable = std::env::current_exe().expect("current executable");
    executable
        .ancestors()
        .skip(1)
        .take(2)
        .map(|dir| dir.join("cnibpf-test-client"))
        .find(|path| path.exists())
        .expect("cnibpf-test-client is built next to the tests (cargo build -p cnibpf-tests)")
}

/// The uplink veth between `host` and `outside`, addressed, up, with the host's default routes
/// through it; at interface index `index` in the host when given.
pub(crate) fn wire_uplink(host: &Netns, outside: &Netns, index: Option<u32>) {
    let index = index.map(|index| index.to_string());
    let mut add = vec!["link", "add", UPLINK];
    if let Some(index) = &index {
        add.extend(["index", index]);
    }
    add.extend([
        "netns",
        host.name(),
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        outside.name(),
    ]);
    crate::netns::run_checked(std::process::Command::new("ip").args(add));
    host.exec(&[
        "ip",
        "addr",
        "add",
        &format!("{HOST_UPLINK_ADDR}/24"),
        "dev",
        UPLINK,
    ]);
    host.exec(&["ip", "link", "set", UPLINK, "up"]);
    host.exec(&[
        "ip",
        "route",
        "add",
        "default",
        "via",
        &OUTSIDE_ADDR.to_string(),
    ]);
    outside.exec(&[
        "ip",
        "addr",
        "add",
        &format!("{OUTSIDE_ADDR}/24"),
        "dev",
        "eth0",
    ]);
    outside.exec(&[
        "ip",
        "-6",
        "addr",
        "add",
        &format!("{OUTSIDE_ADDR6}/64"),
        "dev",
        "eth0",
        "nodad",
    ]);
    outside.exec(&["ip", "link", "set", "eth0", "up"]);
    host.exec(&[
        "ip",
        "-6",
        "addr",
        "add",
        &format!("{HOST_UPLINK_ADDR6}/64"),
        "dev",
        UPLINK,
        "nodad",
    ]);
    host.exec(&[
        "ip",
        "-6",
        "route",
        "add",
        "default",
        "via",
        &OUTSIDE_ADDR6.to_string(),
    ]);
}
