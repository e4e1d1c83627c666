//! Random frames: none leaves with a broken checksum.

use super::*;

/// xorshift64*: the random run must be reproducible from its seed.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, bound: usize) -> usize {
        usize::try_from(self.next() % bound as u64).unwrap_or(0)
    }
}

/// A TCP option of `kind` with random contents: MSS, window scale, SACK permitted, timestamps,
/// or a NOP.
fn tcp_option(random: &mut Random) -> Vec<u8> {
    let mut bytes = |count: usize| -> Vec<u8> {
        (0..count)
            .map(|_| u8::try_from(random.next() & 0xff).unwrap_or(0))
            .collect()
    };
    match bytes(1)[0] % 5 {
        0 => [vec![2, 4], bytes(2)].concat(),
        1 => [vec![3, 3], bytes(1)].concat(),
        2 => vec![4, 2],
        3 => [vec![8, 10], bytes(8)].concat(),
        _ => vec![1],
    }
}

/// A well-formed frame with random fields, and whether the container sends it (else it comes
/// from outside to the uplink): family, protocol, ports (mostly the mapped ones inward), TCP
/// flags and options, payload length, IPv4 options, IPv6 extension headers; every checksum
/// valid.
fn random_frame(bench: &Bench, random: &mut Random) -> (Vec<u8>, bool) {
    let outward = random.below(3) == 0;
    let v6 = random.below(2) == 0;
    let far4 = Ipv4Addr::new(198, 51, 100, 9);
    let far6: Ipv6Addr = "2001:db8:9::9".parse().expect("literal");
    let hairpin = random.below(4) == 0;
    let (src, dst): (IpAddr, IpAddr) = match (outward, v6, hairpin) {
        (false, false, _) => (OUTSIDE_ADDR.into(), HOST_UPLINK_ADDR.into()),
        (false, true, _) => (OUTSIDE_ADDR6.into(), HOST_UPLINK_ADDR6.into()),
        (true, false, true) => (bench.container.address.into(), HOST_UPLINK_ADDR.into()),
        (true, false, false) => (bench.container.address.into(), far4.into()),
        (true, true, true) => (bench.container.address6.into(), HOST_UPLINK_ADDR6.into()),
        (true, true, false) => (bench.container.address6.into(), far6.into()),
    };
    let protocol = [TCP, TCP, UDP, UDP, SCTP, if v6 { ICMPV6 } else { ICMP }][random.below(6)];
    let random_port = |random: &mut Random| u16::try_from(1 + random.below(65_535)).unwrap_or(1);
    let sport = random_port(random);
    // Mostly a port that protocol has a hostPort on (or a service, for the container).
    let dport = match (random.below(5), protocol) {
        (0, _) => random_port(random),
        (1, _) => [443, 53][random.below(2)],
        (_, TCP) => 8080,
        (_, UDP) => 5353,
        (_, SCTP) => [9999, 9132][random.below(2)],
        _ => random_port(random),
    };
    let payload: Vec<u8> = (0..random.below(200))
        .map(|_| u8::try_from(random.next() & 0xff).unwrap_or(0))
        .collect();
    let l4 = match protocol {
        TCP => {
            let options: Vec<u8> = (0..random.below(5))
                .flat_map(|_| tcp_option(random))
                .take(40)
                .collect();
            let flags = u8::try_from(random.next() & 0x3f).unwrap_or(SYN);
            tcp_with_options(src, dst, sport, dport, flags, &options, &payload)
        }
        UDP => udp(src, dst, sport, dport, &payload, v6 || random.below(4) != 0),
        SCTP => sctp(sport, dport, &payload),
        _ => {
            let [id_high, id_low] = sport.to_be_bytes();
            let rest = [id_high, id_low, 0, 1];
            match (src, dst) {
                (IpAddr::V6(src), IpAddr::V6(dst)) => icmpv6(src, dst, 128, 0, rest, &payload),
                _ => icmp(8, 0, rest, &payload),
            }
        }
    };
    let packet = match (src, dst) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => {
            let options = vec![1u8; 4 * random.below(3) * random.below(4)];
            ipv4(src, dst, protocol, &options, (false, 0), &l4)
        }
        (IpAddr::V6(src), IpAddr::V6(dst)) => {
            let kinds: Vec<u8> = (0..random.below(4))
                .map(|_| [0u8, 43, 60][random.below(3)])
                .collect();
            // Hop-by-hop only first, as a sender puts it.
            let kinds: Vec<u8> = kinds
                .iter()
                .enumerate()
                .filter(|(position, kind)| **kind != 0 || *position == 0)
                .map(|(_, kind)| *kind)
                .collect();
            let mut payload = Vec::new();
            for (position, kind) in kinds.iter().enumerate() {
                let next = kinds.get(position + 1).copied().unwrap_or(protocol);
                let words = u8::try_from(1 + random.below(2)).unwrap_or(1);
                payload.extend(extension_header(*kind, next, words));
            }
            payload.extend(&l4);
            ipv6(
                src,
                dst,
                kinds.first().copied().unwrap_or(protocol),
                &payload,
            )
        }
        _ => unreachable!("addresses of one family"),
    };
    let frame = if outward {
        ethernet(
            [0x02, 0xbb, 0, 0, 0, 1],
            bench.container_mac,
            if v6 { ETH_P_IPV6 } else { ETH_P_IP },
            &packet,
        )
    } else {
        ethernet(
            [0x02, 0xaa, 0, 0, 0, 1],
            OUTSIDE_MAC,
            if v6 { ETH_P_IPV6 } else { ETH_P_IP },
            &packet,
        )
    };
    (frame, outward)
}

/// The container port a hostPort maps `protocol`/`port` to (the bench's mappings).
fn mapped(protocol: u8, port: u16) -> Option<u16> {
    match (protocol, port) {
        (TCP, 8080) => Some(80),
        (UDP, 5353) => Some(53),
        (SCTP, 9999) => Some(9999),
        (SCTP, 9132) => Some(132),
        _ => None,
    }
}

/// Well-formed frames with random fields, and a tenth of them damaged: the kernel runs every
/// one, the verdict is one of cnibpf's, and whatever leaves from a well-formed frame carries
/// valid checksums (or is the frame itself); one from outside to a mapped hostPort goes to the
/// container's port. Prints the share of frames whose output was compared.
#[test]
fn random_frames_never_leave_with_broken_checksums() {
    let bench = bench("pk-random");
    let seed = std::env::var("CNIBPF_PACKET_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or(0x5eed_c0de_u64);
    let count: usize = std::env::var("CNIBPF_PACKETS")
        .ok()
        .and_then(|count| count.parse().ok())
        .unwrap_or(2_000);
    let mut random = Random(seed | 1);
    let (mut well_formed, mut compared, mut translated) = (0, 0, 0);
    for round in 0..count {
        let (mut frame, outward) = random_frame(&bench, &mut random);
        let damaged = random.below(10) == 0;
        if damaged {
            for _ in 0..1 + random.below(4) {
                let at = 14 + random.below(frame.len() - 14);
                frame[at] = u8::try_from(random.next() & 0xff).unwrap_or(0);
            }
            match random.below(3) {
                0 => frame.truncate(14 + random.below(frame.len() - 13)),
                1 => frame.extend(std::iter::repeat_n(0xa5, random.below(64))),
                _ => {}
            }
        }
        let parsed_in = verify(&frame).ok();
        let ran = if outward {
            bench.run_from_container(&frame)
        } else {
            bench.run(&frame)
        };
        let context = format!("round {round} (seed {seed:#x}): {frame:02x?}");
        let Some((verdict, out)) = ran else {
            assert!(refusable(&frame), "{context}: the kernel refused the run");
            continue;
        };
        assert!(
            [NEXT, DROP, REDIRECT].contains(&verdict),
            "{context}: verdict {verdict}"
        );
        let Some(parsed_in) = parsed_in else {
            continue;
        };
        well_formed += 1;
        if verdict == DROP {
            continue;
        }
        compared += 1;
        // Only an undamaged frame is known to be for the hostPort: a damaged one that still
        // verifies may have lost that (SCTP's checksum covers no IP header).
        let to_host_port = !outward && !damaged;
        let mapped_port = mapped(
            parsed_in.protocol,
            parsed_in.ports.map_or(0, |(_, dport)| dport),
        )
        .filter(|_| to_host_port);
        if out != frame {
            let parsed_out =
                verify(&out).unwrap_or_else(|error| panic!("{context}: {error} -> {out:02x?}"));
            if let Some(port) = mapped_port {
                assert_eq!(verdict, REDIRECT, "{context}: handed to the container");
                let family = if parsed_out.dst.is_ipv4() {
                    cnibpf_tests::topology::Family::V4
                } else {
                    cnibpf_tests::topology::Family::V6
                };
                assert_eq!(
                    (parsed_out.dst, parsed_out.ports.map(|(_, dport)| dport)),
                    (bench.container.at(family, 0).ip(), Some(port)),
                    "{context}: to the container's port"
                );
                translated += 1;
            }
        } else if let Some(port) = mapped_port {
            panic!("{context}: a frame to a hostPort (container port {port}) left untranslated");
        }
    }
    let share = |part: usize| part * 100 / count.max(1);
    eprintln!(
        "random frames (seed {seed:#x}): {count} run, {well_formed} well-formed ({}%), {compared} outputs compared ({}%), {translated} translated to a container and checked",
        share(well_formed),
        share(compared)
    );
    assert!(
        share(compared) >= 75,
        "only {compared} of {count} outputs were compared"
    );
    assert!(
        translated > count / 5,
        "only {translated} frames reached a hostPort"
    );
}
