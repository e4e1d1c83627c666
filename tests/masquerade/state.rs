//! Masquerade state: TCP state following the connection, expiry, a full table, and DEL,
//! GC and CHECK over the state.

use super::*;

#[test]
fn tcp_state_follows_the_connection_and_expired_state_goes_away() {
    let host = masquerading(Backend::Ebpf, "mq-state");
    let container = host.container("c1", Value::Null);
    for family in Family::BOTH {
        let family_code = if family == Family::V4 { 2 } else { 10 };
        let state_towards = |port: u16| {
            host.masqueraded()
                .into_iter()
                .find(|(key, _)| key.remote_port == port && key.family == family_code)
                .unwrap_or_else(|| panic!("{family:?}: no flow to port {port}"))
                .1
                .state
        };
        let target = move |port| SocketAddr::new(family.outside(), port);
        let _closing = TcpServer::start(&host.outside, family.any(8080), "bye");
        let _echo = EchoServer::start(&host.outside, family.any(7000), 2);
        let _udp = UdpServer::start(&host.outside, family.any(5353), "hello");

        // An open connection is established once the remote side answered ...
        let open = container
            .netns
            .run(move || std::net::TcpStream::connect_timeout(&target(7000), CLIENT_TIMEOUT))
            .unwrap_or_else(|error| panic!("{family:?} connect: {error}"));
        assert_eq!(state_towards(7000), STATE_ESTABLISHED, "{family:?}");
        // ... an RST shortens its life ...
        reset_on_close(&open);
        drop(open);
        assert!(
            eventually(Duration::from_secs(2), || state_towards(7000)
                == STATE_CLOSING),
            "{family:?}: a reset connection is closing"
        );
        // ... and so do FINs both ways.
        assert_eq!(
            tcp_request(&container.netns, target(8080)).as_deref(),
            Ok("bye")
        );
        assert!(
            eventually(Duration::from_secs(2), || state_towards(8080)
                == STATE_CLOSING),
            "{family:?}: a closed connection is closing"
        );
        // A UDP flow that was answered is established.
        container
            .netns
            .run(move || udp_exchange_from(41_000, target(5353), CLIENT_TIMEOUT))
            .unwrap_or_else(|error| panic!("{family:?} udp: {error}"));
        assert_eq!(state_towards(5353), STATE_ESTABLISHED, "{family:?}");

        // Age every entry past its timeout: the next packet replaces the state (lazy
        // expiry) ...
        age_flows(&host);
        let expired_before = host.masq_stats().expired;
        container
            .netns
            .run(move || udp_exchange_from(41_000, target(5353), CLIENT_TIMEOUT))
            .unwrap_or_else(|error| panic!("{family:?} udp after expiry: {error}"));
        assert_eq!(host.masq_stats().expired, expired_before + 1, "{family:?}");
        // ... and a GC sweeps every expired entry away, whoever it belongs to.
        age_flows(&host);
        host.chain
            .gc(&[(container.attachment.container_id.as_str(), "eth0")])
            .unwrap_or_else(|error| panic!("GC: {error}"));
        assert_eq!(
            host.connections().len(),
            0,
            "{family:?}: expired connections were swept"
        );
        assert_eq!(
            reply_count(&host),
            0,
            "{family:?}: their reverse entries too"
        );
    }
}

/// Moves every `connections` entry's last-seen time a second past its state's timeout (these
/// are the short timeouts of closed TCP and UDP: the clock started long enough ago).
fn age_flows(host: &SimHost) {
    let mut map = host.pinned_hash_map::<ConnectionKey, Connection>("connections");
    for (key, mut flow) in host.connections() {
        let age = timeout_ns(key.protocol, flow.state) + 1_000_000_000;
        assert!(
            flow.last_seen_ns > age,
            "the monotonic clock started too recently"
        );
        flow.last_seen_ns -= age;
        map.insert(&key, &flow, 0).expect("age flow");
    }
}

fn reply_count(host: &SimHost) -> usize {
    let map = host.pinned_hash_map::<ReplyKey, MasqReply>("masq_replies");
    map.keys().count()
}

#[test]
fn a_full_table_keeps_live_flows_lets_new_ones_through_and_shows_the_pressure() {
    let host = masquerading(Backend::Ebpf, "mq-full");
    let container = host.container("c1", Value::Null);
    let _tcp = TcpServer::start(&host.outside, Family::V4.any(8080), "hello");
    let _echo = EchoServer::start(&host.outside, Family::V4.any(7000), 1);
    // A connection that lives through the filling.
    let target = SocketAddr::new(Family::V4.outside(), 7000);
    let mut long_lived = container
        .netns
        .run(move || std::net::TcpStream::connect_timeout(&target, CLIENT_TIMEOUT))
        .expect("connect");
    // Fill the table with other flows, as a busy host would.
    let capacity = cnibpf_common::connections::CONNECTIONS.max_entries;
    host.fill_connections(capacity);
    let mut map = host.pinned_hash_map::<ConnectionKey, Connection>("connections");
    // The LRU keeps entries in use, so the live connection survived the filling; evict its
    // state as more pressure eventually would: its next packet rebuilds it (counted), and the
    // connection carries on.
    let live = host
        .masqueraded()
        .into_iter()
        .find(|(key, _)| key.remote_port == 7000)
        .expect("the live connection's state survived the filling")
        .0;
    map.remove(&live)
        .expect("evict the live connection's state");
    {
        use std::io::{Read as _, Write as _};
        let mut byte = [9u8];
        long_lived
            .set_read_timeout(Some(CLIENT_TIMEOUT))
            .expect("timeout");
        long_lived
            .write_all(&byte)
            .expect("write on the long-lived connection");
        long_lived
            .read_exact(&mut byte)
            .expect("answer on the long-lived connection");
        assert_eq!(byte, [9]);
    }
    assert!(host.masq_stats().state_lost >= 1, "state lost is counted");
    for attempt in 0..20 {
        assert_eq!(
            tcp_request(
                &container.netns,
                SocketAddr::new(Family::V4.outside(), 8080)
            )
            .as_deref(),
            Ok("hello"),
            "connection {attempt} through a full table"
        );
    }
    let inspect = host.inspect();
    let counters = &inspect["counters"]["ebpf"];
    let table = inspect["flowTables"]["ebpf"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|table| table["table"] == "connections")
        .unwrap_or_else(|| panic!("inspect shows no connections table: {inspect:#}"));
    // An LRU map keeps some free slots per CPU: "full" is within a percent of capacity.
    let entries = table["entries"].as_u64().unwrap_or(0);
    assert!(
        entries * 100 >= u64::from(capacity) * 99,
        "{entries} of {capacity}: {table}"
    );
    assert!(counters["flows created"].as_u64() >= Some(20), "{counters}");
}

fn del_gc_and_check_manage_the_masquerade_state(backend: Backend) {
    let host = masquerading(backend, "mq-life");
    let kept = host.container("c1", Value::Null);
    let gone = host.container("c2", Value::Null);
    let _tcp = TcpServer::start(&host.outside, Family::V4.any(8080), "hello");
    for container in [&kept, &gone] {
        assert!(
            tcp_request(
                &container.netns,
                SocketAddr::new(Family::V4.outside(), 8080)
            )
            .is_ok()
        );
    }
    host.check(&kept).expect("CHECK of a complete attachment");
    // CHECK fails when an entry is missing, and ADD repairs it.
    match backend {
        Backend::Ebpf => {
            let mut sources = host.pinned_hash_map::<MasqSourceKey, MasqSource>("masq_sources");
            let key = MasqSourceKey {
                addr: Address::ipv4(kept.address.octets()),
                family: 2,
                _pad: 0,
                _pad2: 0,
            };
            sources.remove(&key).expect("remove the entry");
        }
        Backend::Nftables => {
            let element = format!("{{ {} }}", kept.address);
            host.host.exec(&[
                "nft", "delete", "element", "inet", "cnibpf", "nat4", &element,
            ]);
        }
    }
    let error = host.check(&kept).expect_err("CHECK must notice");
    assert_eq!(error.0.error_code(), Some(105), "{error}");
    host.chain
        .add_again(&kept.attachment, "cnibpf")
        .expect("re-ADD");
    host.check(&kept).expect("CHECK after repair");
    if backend == Backend::Nftables {
        // The guard on the uplink's egress, taken out by hand: CHECK names it, ADD puts it back.
        let hook = format!("guard_{UPLINK}");
        host.host
            .exec(&["nft", "delete", "chain", "netdev", "cnibpf", &hook]);
        let error = host
            .check(&kept)
            .expect_err("CHECK must notice the missing guard");
        assert!(error.to_string().contains(&hook), "{error}");
        host.chain
            .add_again(&kept.attachment, "cnibpf")
            .expect("re-ADD");
        host.check(&kept).expect("CHECK after the guard is back");
    }

    let owners_with_flows = |host: &SimHost| {
        let mut owners: Vec<u64> = host
            .masqueraded()
            .iter()
            .map(|(_, flow)| flow.owner)
            .collect();
        owners.sort_unstable();
        owners.dedup();
        owners.len()
    };
    if backend == Backend::Ebpf {
        assert_eq!(owners_with_flows(&host), 2);
    }
    // GC with only c1 valid removes c2's masquerade and flows.
    host.chain
        .gc(&[(kept.attachment.container_id.as_str(), "eth0")])
        .expect("GC");
    let inspect = host.inspect();
    assert_eq!(inspect["attachments"].as_array().map(Vec::len), Some(1));
    let masqueraded: Vec<&Value> = inspect["attachments"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|attachment| !attachment["masquerade"].is_null())
        .collect();
    assert_eq!(masqueraded.len(), 1, "{inspect:#}");
    if backend == Backend::Ebpf {
        assert_eq!(owners_with_flows(&host), 1);
    }
    // DEL of the last attachment removes the rest: its entries (the eBPF datapath stays for
    // the next pod), the table.
    host.del(&kept).expect("DEL");
    assert!(host.holds_no_state());
    if backend == Backend::Ebpf {
        assert_eq!(owners_with_flows(&host), 0);
    }
    assert!(!host.nft_ruleset().contains("cnibpf"));
    let _ = gone;
}

for_both_backends!(del_gc_and_check_manage_the_masquerade_state,);
