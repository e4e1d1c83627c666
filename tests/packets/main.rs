//! The datapath packet by packet: the pinned programs of a live attachment run on crafted
//! frames with `BPF_PROG_TEST_RUN`, no traffic, no topology between them. For each frame: the
//! verdict; where a translation applies, the bytes that leave, their checksums verified here
//! independently of the datapath; and no state for a frame that must not make any. Then a
//! seeded random run (`CNIBPF_PACKET_SEED`, `CNIBPF_PACKETS`; 2,000 frames by default).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use cnibpf_tests::{
    Container, SimHost,
    packet::{
        ACK, ETH_P_IP, ETH_P_IPV6, ICMP, ICMPV6, RST, SCTP, SYN, TCP, UDP, ethernet, icmp, icmpv6,
        ipv4, ipv6, sctp, tcp, tcp_with_options, udp, verify,
    },
    topology::{
        HOST_UPLINK_ADDR, HOST_UPLINK_ADDR6, OUTSIDE_ADDR, OUTSIDE_ADDR6, UPLINK, port_mappings,
    },
};
use serde_json::json;

mod headers;
mod random;
mod scenarios;
mod translation;

/// `TCX_NEXT` (`TC_ACT_UNSPEC`): on to whatever comes after cnibpf.
const NEXT: i32 = -1;

const DROP: i32 = 2;

/// `bpf_redirect_peer` / `bpf_redirect`: straight to the container (or out of the uplink).
const REDIRECT: i32 = 7;

const OUTSIDE_MAC: [u8; 6] = [0x02, 0xee, 0, 0, 0, 2];

const UPLINK_PROGRAM: &str = "uplink_ingress";

struct Bench {
    sim: SimHost,
    container: Container,
    uplink: u32,
    /// The container's host-side veth.
    veth: u32,
    container_mac: [u8; 6],
}

fn bench(id: &str) -> Bench {
    bench_with(id, json!({ "ipMasq": true }))
}

/// [`bench`] with cnibpf's entry holding `keys`.
fn bench_with(id: &str, keys: serde_json::Value) -> Bench {
    let sim = SimHost::new(id, keys);
    let mut mappings = port_mappings(&[(8080, 80, "tcp"), (5353, 53, "udp")]);
    mappings["portMappings"]
        .as_array_mut()
        .expect("a list")
        .extend([
            json!({ "hostPort": 9999, "containerPort": 9999, "protocol": "sctp" }),
            json!({ "hostPort": 9132, "containerPort": 132, "protocol": "sctp" }),
        ]);
    let container = sim.container("c1", mappings);
    let uplink = interface_index(&sim, UPLINK);
    let veth = interface_index(&sim, &sim.host_interface(&container));
    let container_mac = container_mac(&container);
    Bench {
        sim,
        container,
        uplink,
        veth,
        container_mac,
    }
}

/// The MAC address of the container's interface, from its result.
fn container_mac(container: &Container) -> [u8; 6] {
    container.result["interfaces"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|interface| interface.get("sandbox").is_some())
        .and_then(|interface| interface["mac"].as_str())
        .map(mac)
        .expect("the container's MAC in its result")
}

fn interface_index(sim: &SimHost, name: &str) -> u32 {
    let line = sim.host.exec(&["ip", "-o", "link", "show", "dev", name]);
    line.split(':')
        .next()
        .and_then(|index| index.trim().parse().ok())
        .unwrap_or_else(|| panic!("no index for {name} in {line:?}"))
}

fn mac(text: &str) -> [u8; 6] {
    let bytes: Vec<u8> = text
        .split(':')
        .map(|part| u8::from_str_radix(part, 16).expect("hex"))
        .collect();
    bytes.try_into().expect("six bytes")
}

fn outside_v4(protocol: u8, l4: &[u8]) -> Vec<u8> {
    ethernet(
        [0x02, 0xaa, 0, 0, 0, 1],
        OUTSIDE_MAC,
        ETH_P_IP,
        &ipv4(
            OUTSIDE_ADDR,
            HOST_UPLINK_ADDR,
            protocol,
            &[],
            (false, 0),
            l4,
        ),
    )
}

fn outside_v6(next_header: u8, payload: &[u8]) -> Vec<u8> {
    ethernet(
        [0x02, 0xaa, 0, 0, 0, 1],
        OUTSIDE_MAC,
        ETH_P_IPV6,
        &ipv6(OUTSIDE_ADDR6, HOST_UPLINK_ADDR6, next_header, payload),
    )
}

fn syn_v4(flags: u8) -> Vec<u8> {
    outside_v4(
        TCP,
        &tcp(
            OUTSIDE_ADDR.into(),
            HOST_UPLINK_ADDR.into(),
            40_000,
            8080,
            flags,
            b"",
        ),
    )
}

impl Bench {
    fn run(&self, frame: &[u8]) -> Option<(i32, Vec<u8>)> {
        self.sim.test_run(UPLINK_PROGRAM, self.uplink, frame)
    }

    /// Runs `frame` as the container sends it (its veth's tcx ingress).
    fn run_from_container(&self, frame: &[u8]) -> Option<(i32, Vec<u8>)> {
        self.sim.test_run("from_container", self.veth, frame)
    }

    /// Runs a frame the container sends as a connection's first packet goes: on to the host
    /// stack from its veth, untouched, then through the uplink's egress as the stack forwarded
    /// it (the stack's own hop, and its routing, are not run here): the egress's verdict and
    /// frame.
    fn run_first_out(&self, frame: &[u8]) -> Option<(i32, Vec<u8>)> {
        let (verdict, out) = self.run_from_container(frame)?;
        assert_eq!(
            (verdict, &out[..]),
            (NEXT, frame),
            "a connection's first packet goes on to the host stack untouched"
        );
        self.sim.test_run("uplink_egress", self.uplink, frame)
    }

    /// A frame the container sends to `dst` (IPv4).
    fn sent_by_container(&self, protocol: u8, dst: Ipv4Addr, l4: &[u8]) -> Vec<u8> {
        ethernet(
            [0x02, 0xbb, 0, 0, 0, 1],
            self.container_mac,
            ETH_P_IP,
            &ipv4(self.container.address, dst, protocol, &[], (false, 0), l4),
        )
    }

    /// A frame the container sends to `dst` (IPv6), `payload` starting with `next_header`'s.
    fn sent_by_container_v6(&self, next_header: u8, dst: Ipv6Addr, payload: &[u8]) -> Vec<u8> {
        ethernet(
            [0x02, 0xbb, 0, 0, 0, 1],
            self.container_mac,
            ETH_P_IPV6,
            &ipv6(self.container.address6, dst, next_header, payload),
        )
    }

    /// Runs `frame` through the uplink's ingress, expecting it translated to the container's
    /// `port`: the verdict, the address, the port, the MAC, and every checksum.
    fn expect_translated(&self, frame: &[u8], port: u16, what: &str) {
        let (verdict, out) = self
            .run(frame)
            .unwrap_or_else(|| panic!("{what}: the kernel refused the run"));
        assert_eq!(verdict, REDIRECT, "{what}: handed to the container");
        let parsed = verify(&out).unwrap_or_else(|error| panic!("{what}: {error}: {out:02x?}"));
        let family = if parsed.dst.is_ipv4() {
            cnibpf_tests::topology::Family::V4
        } else {
            cnibpf_tests::topology::Family::V6
        };
        assert_eq!(
            parsed.dst,
            self.container.at(family, 0).ip(),
            "{what}: to the container"
        );
        assert_eq!(
            parsed.ports.map(|(_, dport)| dport),
            Some(port),
            "{what}: its port"
        );
        assert_eq!(parsed.dst_mac, self.container_mac, "{what}: its MAC");
    }

    /// Runs `frame` expecting it passed on untouched, and no flow state made for it.
    fn expect_untouched(&self, frame: &[u8], what: &str) {
        let before = self.sim.flow_counts();
        match self.run(frame) {
            None => assert!(refusable(frame), "{what}: the kernel refused a run"),
            Some((verdict, out)) => {
                assert!(
                    verdict == NEXT || verdict == DROP,
                    "{what}: verdict {verdict} for a frame that is no one's"
                );
                if verdict == NEXT {
                    assert_eq!(out, frame, "{what}: passed on changed");
                }
            }
        }
        assert_eq!(self.sim.flow_counts(), before, "{what}: made state");
    }
}

/// Whether the kernel refuses to run a program on `frame`: it builds an skb of an Ethernet
/// header and a whole IP header at least.
fn refusable(frame: &[u8]) -> bool {
    let network = match frame.get(12..14) {
        Some([0x86, 0xdd]) => 40,
        _ => 20,
    };
    frame.len() < 14 + network
}

/// An IPv6 extension header of `kind` (hop-by-hop, routing with no segments left, destination
/// options), `words` times 8 bytes, leading to `next`.
fn extension_header(kind: u8, next: u8, words: u8) -> Vec<u8> {
    let length = usize::from(words) * 8;
    let mut header = vec![0u8; length];
    header[0] = next;
    header[1] = words - 1;
    if kind == 43 {
        // Type 0, no segments left: the destination is the final one.
        return header;
    }
    // One PadN option filling the rest.
    header[2] = 1;
    header[3] = u8::try_from(length - 4).expect("short");
    header
}
