//! Filter rules (`filter`, `filterDefault`): ordered, stateful, on the container's side of
//! every translation, replaced atomically, observable (counters, `cnibpf monitor`).

use std::{net::SocketAddr, time::Duration};

use cnibpf_common::{connections::PART_FILTER, filter::FilterSet};
use cnibpf_tests::{
    Container, Netns, SimHost, eventually, for_both_backends,
    monitor::{first_line_matching, interrupt, monitor_lines, start_monitor},
    topology::{Backend, Family, GATEWAY, GATEWAY6, OUTSIDE_ADDR, OUTSIDE_ADDR6, port_mappings},
    traffic::{
        CLIENT_TIMEOUT, Conversation, StreamEchoServer, TcpServer, UdpCounter, UdpSender,
        UdpServer, kernel_has_sctp, ping, sctp_request, tcp_exchange, tcp_request, udp_error,
        udp_exchange_from, udp_exchange_with, udp_request, unanswered, uninterrupted,
    },
};
use serde_json::{Value, json};

mod connections;
mod live;
mod networks;
mod operations;
mod paths;
mod rules;

/// How long a client waits before a request counts as dropped: tests first show the same
/// path working, so neighbours are resolved and a drop is not a slow first packet.
const DROPPED_AFTER: Duration = Duration::from_millis(1200);

/// Whether a request was dropped: no answer within [`DROPPED_AFTER`]. An error that is an
/// answer (a reset, an ICMP error) is not a drop: the test fails on it, naming it.
fn dropped<T>(outcome: Result<T, String>, what: &str) -> bool {
    match outcome {
        Ok(_) => false,
        Err(error) if unanswered(&error) => true,
        Err(error) => panic!("{what}: answered with an error ({error}), which is not a drop"),
    }
}

fn tcp_dropped(netns: &Netns, target: SocketAddr) -> bool {
    dropped(
        netns.run(move || tcp_exchange(target, DROPPED_AFTER)),
        &format!("TCP to {target}"),
    )
}

fn udp_dropped(netns: &Netns, target: SocketAddr) -> bool {
    dropped(
        netns.run(move || udp_exchange_from(0, target, DROPPED_AFTER)),
        &format!("UDP to {target}"),
    )
}

fn udp_from(netns: &Netns, source_port: u16, target: SocketAddr) -> Result<String, String> {
    netns
        .run(move || udp_exchange_from(source_port, target, DROPPED_AFTER))
        .map(|(answer, _)| answer)
}

/// The attachment's filter as `cnibpf inspect --json` shows it.
fn inspected_filter(host: &SimHost, container: &Container) -> Value {
    let inspect = host.inspect();
    inspect["attachments"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|attachment| attachment["containerID"] == container.attachment.container_id)
        .map(|attachment| attachment["filter"].clone())
        .unwrap_or_else(|| {
            panic!(
                "{} not in inspect: {inspect:#}",
                container.attachment.container_id
            )
        })
}

/// Packets counted on the rule with `index` (`None`: the default verdict).
fn hits(filter: &Value, index: Option<u64>) -> u64 {
    match index {
        None => filter["defaultHits"]["packets"].as_u64(),
        Some(index) => filter["rules"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|rule| rule["index"] == index)
            .and_then(|rule| rule["packets"].as_u64()),
    }
    .unwrap_or_else(|| panic!("no counter for rule {index:?} in {filter:#}"))
}

/// `count` filler rules from `first_index` on that match nothing the test sends.
fn filler_rules(first_index: u64, count: u64) -> Vec<Value> {
    (0..count)
        .map(|offset| {
            json!({ "index": first_index + offset, "proto": "udp", "dport": 20_000 + offset,
                    "target": "DROP" })
        })
        .collect()
}

/// The owner id `cnibpf inspect` shows for `container`.
fn inspected_owner(host: &SimHost, container: &Container) -> String {
    host.inspect()["attachments"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|attachment| attachment["containerID"] == container.attachment.container_id)
        .and_then(|attachment| attachment["owner"].as_str().map(str::to_owned))
        .unwrap_or_else(|| panic!("{} not in inspect", container.attachment.container_id))
}
