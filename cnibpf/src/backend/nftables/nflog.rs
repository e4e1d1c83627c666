//! The NFLOG group of an instance's table: where its `log` rules send each new connection a
//! rule with `"log": true` decided (`log group <n> prefix "cnibpf <owner> <index> <target>
//! <direction>"`), for `cnibpf monitor --matches`. The group's number follows from the
//! instance id; the prefix names the rule, the packet the connection.

use std::{io, net::IpAddr};

use tokio::io::{Interest, unix::AsyncFd};

use crate::{
    model::{Direction, RuleMatch, Target},
    nfnetlink::{self, Connection, Request},
};

/// `NFNL_SUBSYS_ULOG` and its messages.
const SUBSYSTEM: u8 = 4;
const MESSAGE_PACKET: u8 = 0;
const MESSAGE_CONFIG: u8 = 1;
/// Configuration attributes: `NFULA_CFG_CMD`, `NFULA_CFG_MODE`, `NFULA_CFG_QTHRESH`.
const CONFIG_COMMAND: u16 = 1;
const CONFIG_MODE: u16 = 2;
const CONFIG_QUEUE_THRESHOLD: u16 = 5;
const COMMAND_BIND: u8 = 1;
/// `NFULNL_COPY_PACKET`, of this many bytes: the headers.
const COPY_PACKET: u8 = 2;
const COPY_RANGE: u32 = 128;
/// Packet attributes: `NFULA_PAYLOAD`, `NFULA_PREFIX`.
const PACKET_PAYLOAD: u16 = 9;
const PACKET_PREFIX: u16 = 10;

const PREFIX_START: &str = "cnibpf";

/// The group of the instance named `instance` (1 to 65,535; 0 is the kernel's default group).
pub fn group_of(instance: u64) -> u16 {
    // fail-closed: the remainder is below 65,535.
    u16::try_from(instance % 65_535).unwrap_or(0) + 1
}

/// The prefix of a `log` rule's events.
pub fn prefix(owner: u64, rule: u32, target: Target, direction: Direction) -> String {
    format!("{PREFIX_START} {owner:016x} {rule} {target} {direction}")
}

/// The NFLOG group, bound by this process.
pub struct Group {
    socket: AsyncFd<netlink_sys::Socket>,
    buffer: Vec<u8>,
}

impl Group {
    /// Binds group `group` (refused while another process holds it): each packet logged to it
    /// comes here, its first bytes copied, as soon as it is logged.
    pub fn bind(group: u16) -> io::Result<Self> {
        let mut connection = Connection::open()?;
        let config = |attribute: u16, value: &[u8]| {
            Request::new(SUBSYSTEM, MESSAGE_CONFIG, 0, false)
                .resource(group)
                .attribute(attribute, value)
        };
        connection.exchange(config(CONFIG_COMMAND, &[COMMAND_BIND]), |_, _| {
            std::ops::ControlFlow::Continue(())
        })?;
        let mut mode = COPY_RANGE.to_be_bytes().to_vec();
        mode.extend([COPY_PACKET, 0]);
        connection.exchange(config(CONFIG_MODE, &mode), |_, _| {
            std::ops::ControlFlow::Continue(())
        })?;
        connection.exchange(
            config(CONFIG_QUEUE_THRESHOLD, &1u32.to_be_bytes()),
            |_, _| std::ops::ControlFlow::Continue(()),
        )?;
        let socket = connection.into_socket();
        socket.set_non_blocking(true)?;
        // SAFETY: the socket owns its descriptor, which stays open and the same until it is
        // dropped with the `AsyncFd`.
        let socket = unsafe { AsyncFd::register_with_interest(socket, Interest::READABLE) }
            .map_err(|error| error.into_parts().1)?;
        Ok(Self {
            socket,
            buffer: Vec::with_capacity(64 * 1024),
        })
    }

    /// The events of the next datagram the kernel sends (those of cnibpf's rules).
    pub async fn next(&mut self) -> io::Result<Vec<RuleMatch>> {
        loop {
            let mut guard = self.socket.readable().await?;
            self.buffer.clear();
            match guard.try_io(|socket| socket.get_ref().recv(&mut self.buffer, 0)) {
                Ok(received) => {
                    received?;
                    return Ok(nfnetlink::messages(&self.buffer)
                        .filter(|(kind, _)| {
                            *kind == u16::from(SUBSYSTEM) << 8 | u16::from(MESSAGE_PACKET)
                        })
                        .filter_map(|(_, message)| logged(message.get(4..)?))
                        .collect());
                }
                Err(_would_block) => {}
            }
        }
    }
}

/// A packet message's event: its prefix one of cnibpf's, its payload the IP packet.
fn logged(attributes: &[u8]) -> Option<RuleMatch> {
    let prefix = nfnetlink::attribute(attributes, PACKET_PREFIX)?;
    let prefix = std::str::from_utf8(prefix)
        // fail-closed: decoding a message; one not of cnibpf's making is no event of ours.
        .ok()?
        .trim_end_matches('\0');
    let mut words = prefix.split(' ');
    if words.next()? != PREFIX_START {
        return None;
    }
    // fail-closed: decoding a message, as above.
    let owner = u64::from_str_radix(words.next()?, 16).ok()?;
    let rule = word(words.next())?;
    let target = word(words.next())?;
    let direction = word(words.next())?;
    let packet = nfnetlink::attribute(attributes, PACKET_PAYLOAD)?;
    let (protocol, source, destination, l4) = match packet.first()? >> 4 {
        4 => (
            *packet.get(9)?,
            IpAddr::from(octets::<4>(packet, 12)?),
            IpAddr::from(octets::<4>(packet, 16)?),
            packet.get(usize::from(packet.first()? & 0x0f) * 4..)?,
        ),
        6 => (
            *packet.get(6)?,
            IpAddr::from(octets::<16>(packet, 8)?),
            IpAddr::from(octets::<16>(packet, 24)?),
            packet.get(40..)?,
        ),
        _ => return None,
    };
    let port = |at: usize| octets::<2>(l4, at).map(u16::from_be_bytes);
    let ported = matches!(protocol, 6 | 17 | 132);
    Some(RuleMatch {
        owner,
        rule,
        target,
        direction,
        protocol,
        source,
        source_port: if ported { port(0)? } else { 0 },
        destination,
        destination_port: if ported { port(2)? } else { 0 },
    })
}

/// A word of a prefix, parsed.
fn word<T: std::str::FromStr>(word: Option<&str>) -> Option<T> {
    // fail-closed: decoding a message; a word that does not parse is no event of ours.
    word?.parse().ok()
}

/// `N` bytes of `bytes` from `at`, when it has them.
fn octets<const N: usize>(bytes: &[u8], at: usize) -> Option<[u8; N]> {
    // fail-closed: a slice of exactly N bytes always converts; a short packet has none.
    bytes.get(at..at + N)?.try_into().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attribute(kind: u16, value: &[u8]) -> Vec<u8> {
        let mut bytes = ((4 + value.len()) as u16).to_ne_bytes().to_vec();
        bytes.extend(kind.to_ne_bytes());
        bytes.extend(value);
        bytes.resize(bytes.len().next_multiple_of(4), 0);
        bytes
    }

    #[test]
    fn a_logged_packet_reads_back_as_its_rule_and_tuple() {
        let prefix = prefix(0xab, 10, Target::Allow, Direction::Ingress);
        assert_eq!(prefix, "cnibpf 00000000000000ab 10 ALLOW ingress");
        let mut packet = vec![0x45, 0, 0, 40, 0, 0, 0, 0, 64, 6, 0, 0];
        packet.extend([10, 23, 0, 7, 10, 22, 0, 5]);
        packet.extend(40_000u16.to_be_bytes());
        packet.extend(389u16.to_be_bytes());
        let mut prefix_bytes = prefix.into_bytes();
        prefix_bytes.push(0);
        let mut attributes = attribute(PACKET_PREFIX, &prefix_bytes);
        attributes.extend(attribute(PACKET_PAYLOAD, &packet));
        assert_eq!(
            logged(&attributes),
            Some(RuleMatch {
                owner: 0xab,
                rule: 10,
                target: Target::Allow,
                direction: Direction::Ingress,
                protocol: 6,
                source: "10.23.0.7".parse().expect("literal"),
                source_port: 40_000,
                destination: "10.22.0.5".parse().expect("literal"),
                destination_port: 389,
            })
        );
        let other = attribute(PACKET_PREFIX, b"kube 1 2\0");
        assert_eq!(logged(&other), None, "someone else's log rule");
        assert_eq!(group_of(0), 1);
        assert_eq!(group_of(65_534), 65_535);
        assert_eq!(group_of(65_535), 1);
    }
}
