//! nftables tables of older layouts: one no build migrates, drained pod by pod; the window's,
//! migrated in place with its pods' traffic flowing.

use std::path::Path;

use cnibpf_tests::{
    SimHost,
    live::{LivePod, pod_keys},
    topology::port_mappings,
    traffic::{Conversation, TcpServer, tcp_request},
};
use serde_json::json;

use super::{Installed, WAIT, inspected_rule_packets};

/// What marks a table of this build's layout: a set named after the state it was made from.
pub const LAYOUT_4_MARKER: &str = "set layout_4_instance_";

/// An nftables table of a layout no build migrates (layout 1) is not migrated: the new cnibpf
/// adds nothing to it, but DEL removes its pods one by one while the others keep working, and
/// the last DEL leaves the node to the new layout.
pub fn nftables_table_of_an_older_layout_drains(installed: &Installed, old: &Path, new: &Path) {
    installed.put(old);
    let keys = json!({ "backend": "nftables", "ipMasq": true, "filter": [
        { "index": 1, "direction": "ingress", "proto": "tcp", "dport": 81, "target": "DROP" },
    ]});
    let sim = SimHost::new("upn", keys);
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let c2 = sim.container("c2", port_mappings(&[(8081, 80, "tcp")]));
    let _servers = [&c1, &c2].map(|container| {
        TcpServer::start(
            &container.netns,
            container.socket(80),
            &container.attachment.container_id,
        )
    });
    let ruleset = sim.nft_ruleset();
    assert!(
        ruleset.contains("table inet cnibpf {") && !ruleset.contains("cnibpf layout"),
        "the older cnibpf made an uncommented table:\n{ruleset}"
    );

    installed.put(new);
    let refused = sim
        .add_container("c3", port_mappings(&[(8082, 80, "tcp")]))
        .expect_err("ADD into a table of another layout is refused");
    assert_eq!(refused.0.error_code(), Some(106), "{refused}");
    let message = refused.0.error_msg();
    assert!(message.contains("DEL and GC remove"), "{message}");
    assert!(
        !message.contains("delete every"),
        "no advice to delete state: {message}"
    );
    sim.del(&c1)
        .unwrap_or_else(|error| panic!("DEL in a table of an older layout: {error}"));
    let ruleset = sim.nft_ruleset();
    assert!(
        !ruleset.contains(&c1.attachment.container_id),
        "c1 left nothing behind:\n{ruleset}"
    );
    assert!(
        tcp_request(&sim.outside, sim.uplink_target(8080)).is_err(),
        "c1's hostPort went with it"
    );
    assert_eq!(
        tcp_request(&sim.outside, sim.uplink_target(8081)).as_deref(),
        Ok(c2.attachment.container_id.as_str()),
        "c2 is served on"
    );
    sim.del(&c2)
        .unwrap_or_else(|error| panic!("DEL of the last pod of an older table: {error}"));
    assert!(sim.holds_no_state(), "the last DEL removed the older table");
    let c4 = sim.container("c4", port_mappings(&[(8080, 80, "tcp")]));
    assert!(
        sim.nft_ruleset().contains(LAYOUT_4_MARKER),
        "a table of the new layout"
    );
    let _c4_server = TcpServer::start(&c4.netns, c4.socket(80), "c4");
    assert_eq!(
        tcp_request(&sim.outside, sim.uplink_target(8080)).as_deref(),
        Ok("c4")
    );
}

/// A table of nftables layout 3 (the window's) is migrated by the new cnibpf's first ADD,
/// with the pod's traffic flowing: its records read into the state file, the table replaced by one made from
/// them in one transaction; connections and datagram flows keep their translation, the filter
/// and its counters stay, hairpin traffic to the older pod's hostPort is masqueraded by what
/// the migration built from its record.
pub fn nftables_table_of_the_previous_layout_migrates(
    installed: &Installed,
    old: &Path,
    new: &Path,
) {
    installed.put(old);
    let sim = SimHost::new("upm", pod_keys("nftables"));
    let pod = LivePod::start(&sim);
    let ruleset = sim.nft_ruleset();
    assert!(
        ruleset.contains("comment \"cnibpf layout 3\"") && ruleset.contains("chain a_"),
        "the older cnibpf made a table of layout 3:\n{ruleset}"
    );
    let hits = inspected_rule_packets(&sim, &pod.container);
    assert!(hits > 0, "the DROP rule counted its drops");

    installed.put(new);
    let c2 = sim.container("c2", port_mappings(&[(8090, 80, "tcp")]));
    let ruleset = sim.nft_ruleset();
    assert!(
        ruleset.contains(LAYOUT_4_MARKER) && !ruleset.contains("chain a_"),
        "migrated:\n{ruleset}"
    );
    assert_eq!(
        inspected_rule_packets(&sim, &pod.container),
        hits,
        "the counters were kept"
    );
    pod.assert_translations(&sim, "after the nftables migration");
    assert!(
        inspected_rule_packets(&sim, &pod.container) > hits,
        "the filter counts on"
    );
    sim.check(&pod.container)
        .unwrap_or_else(|error| panic!("CHECK of the older ADD's pod: {error}"));
    let mut hairpin = Conversation::open(&c2.netns, sim.uplink_target(8080))
        .unwrap_or_else(|error| panic!("hairpin connect to the older pod's hostPort: {error}"));
    hairpin
        .exchange(b"hairpin", WAIT)
        .unwrap_or_else(|error| panic!("hairpin exchange with the older pod: {error}"));
    let _c2_server = TcpServer::start(&c2.netns, c2.socket(80), "c2");
    assert_eq!(
        tcp_request(&sim.outside, sim.uplink_target(8090)).as_deref(),
        Ok("c2")
    );
    let c1 = pod.assert_carried_on("across the nftables migration");
    for container in [&c1, &c2] {
        sim.del(container)
            .unwrap_or_else(|error| panic!("DEL after the nftables migration: {error}"));
    }
    assert!(sim.holds_no_state(), "the last DEL removed the table");
}
