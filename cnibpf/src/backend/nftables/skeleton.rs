//! The table's skeleton — its sets, maps, chains and hook rules as this layout writes them — and
//! how a table names its layout and the state it was made from. Written as nft's JSON objects
//! (the `nftables` crate's schema has no verdict maps), so that a table is made in the same
//! transaction as its attachments: a table put back after a firewall reload, or made anew from
//! an older layout's, is never seen half made.

use serde_json::{Value, json};

use super::{NftablesError, host, nft};

/// The start of the name of the set that marks a table of this layout, followed by the
/// instance id of the state it was made from (nft 1.0.6 drops a table's comment given in
/// JSON, where layouts 2 and 3 named themselves; layout 1 had no comment either).
const MARKER: &str = "layout_4_instance_";

/// The name of the marker set of a table made from the state named `instance`.
pub(super) fn marker(instance: u64) -> String {
    format!("{MARKER}{instance:016x}")
}

/// The commands that add the table made from the state named `instance`, whole but for its
/// attachments. Chains: `hostports`, run from prerouting and from output (host processes), takes
/// the hostPorts of an exact hostIP; `hostports_any4`/`6` the wildcard ones, run from those hooks
/// for a destination that is the node's own address as the kernel has it now — on the interface the
/// packet came in by (prerouting: `fib daddr . iif type local`), or recorded in `node_addrs4`/`6`
/// and still local, never a Service's — and for 127.0.0.0/8 from host processes; each hands a
/// conditioned hostPort to its attachment's `c_` chain, which goes on to `hostports_dnat` once the
/// conditions hold; `postrouting` masquerades host processes reaching a hostPort through 127.0.0.1
/// and hands DNATed traffic (by destination) and traffic leaving by an uplink (by source) to the
/// container's `n_` chain, which masquerades hairpin traffic (a container reaching a container of
/// its own subnet through a hostPort) and its masqueraded traffic; with the hooks (`super::hooks`) its
/// attachments need: `localnet_guard` (while one has hostPorts or an interface has cnibpf's
/// `route_localnet`) drops what arrives from elsewhere for 127.0.0.0/8, as kube-proxy does against
/// CVE-2020-8558; `forward`, `input` and `local_out` (while one has a filter) let what passes
/// every filter through (replies, related errors, IPv6 neighbour and listener control,
/// `icmpv6_control`) and hand the rest of a container's traffic to its filter chains (the
/// masquerade guard is in table `netdev cnibpf`, `super::guard`). Sets `attachments`, `filtered_bridges` and
/// `localnet_interfaces` copy what the state file records, for builds that drain a table of a
/// layout they do not write.
pub(super) fn skeleton(instance: u64) -> Vec<Value> {
    let table = json!({ "table": { "family": "inet", "name": nft::TABLE } });
    let marker = json!({ "set": { "name": marker(instance), "type": "mark" } });
    let objects = std::iter::once(marker)
        .chain(sets())
        .chain(chains())
        .chain(rules())
        .map(in_table);
    std::iter::once(table)
        .chain(objects)
        .map(|object| json!({ "add": object }))
        .collect()
}

/// `object` (`{"<kind>": {...}}`) placed in table `inet cnibpf`.
pub(super) fn in_table(object: Value) -> Value {
    in_family(object, "inet")
}

/// `object` (`{"<kind>": {...}}`) placed in the table of `family` named as `inet cnibpf`.
pub(super) fn in_family(mut object: Value, family: &str) -> Value {
    if let Some(body) = object
        .as_object_mut()
        .and_then(|object| object.values_mut().next())
    {
        body["family"] = json!(family);
        body["table"] = json!(nft::TABLE);
    }
    object
}

fn sets() -> Vec<Value> {
    let set = |name: &str, kind: Value| json!({ "set": { "name": name, "type": kind } });
    let map = |name: &str, kind: Value, data: Value| json!({ "map": { "name": name, "type": kind, "map": data } });
    let mut sets = vec![
        set("attachments", json!("ifname")),
        set("uplinks", json!("ifname")),
        set("filtered_bridges", json!("ifname")),
        set("localnet_interfaces", json!("ifname")),
        set("node_addrs4", json!("ipv4_addr")),
        set("node_addrs6", json!("ipv6_addr")),
        set("specific_ports4", json!(["inet_proto", "inet_service"])),
        set("specific_ports6", json!(["inet_proto", "inet_service"])),
        json!({ "set": { "name": "icmpv6_control", "type": "icmpv6_type", "elem": [
            "nd-router-solicit", "nd-router-advert", "nd-neighbor-solicit", "nd-neighbor-advert",
            "nd-redirect", "mld-listener-query", "mld-listener-report", "mld-listener-done",
            "mld2-listener-report"
        ] } }),
    ];
    for (suffix, address) in [("4", "ipv4_addr"), ("6", "ipv6_addr")] {
        // A hostPort's container address and port in two maps of the same keys: nft 1.0.6
        // cannot read a DNAT from one map of both in JSON.
        for (name, key) in [
            (
                format!("hostports{suffix}"),
                json!([address, "inet_proto", "inet_service"]),
            ),
            (
                format!("hostports{suffix}_any"),
                json!(["inet_proto", "inet_service"]),
            ),
        ] {
            sets.push(map(
                &format!("{name}_port"),
                key.clone(),
                json!("inet_service"),
            ));
            sets.push(map(&name, key, json!(address)));
        }
        sets.push(map(
            &format!("conditions{suffix}"),
            json!([address, "inet_proto", "inet_service"]),
            json!("verdict"),
        ));
        sets.push(map(
            &format!("conditions{suffix}_any"),
            json!(["inet_proto", "inet_service"]),
            json!("verdict"),
        ));
        for name in ["filter_out", "filter_in", "nat"] {
            sets.push(map(
                &format!("{name}{suffix}"),
                json!(address),
                json!("verdict"),
            ));
        }
    }
    sets
}

fn chains() -> Vec<Value> {
    let regular = |name: &str| json!({ "chain": { "name": name } });
    let hooked = |name: &str, kind: &str, hook: &str, priority: i32| json!({ "chain": { "name": name, "type": kind, "hook": hook, "prio": priority, "policy": "accept" } });
    vec![
        regular("hostports"),
        regular("hostports_any4"),
        regular("hostports_any6"),
        regular("hostports_dnat"),
        hooked("prerouting", "nat", "prerouting", -100),
        hooked("output", "nat", "output", -100),
        hooked("postrouting", "nat", "postrouting", 100),
    ]
}

fn rules() -> Vec<Value> {
    [host_port_rules(), nat_rules()].concat()
}

pub(super) fn rule(chain: &str, expr: Vec<Value>) -> Value {
    json!({ "rule": { "chain": chain, "expr": expr } })
}

pub(super) fn loopback() -> Value {
    prefix("127.0.0.0", 8)
}

/// Chain `hostports`: the mappings of an exact hostIP, by (address, protocol, port): their
/// conditions, then the translation; chains `hostports_any4`/`6`: the wildcard mappings of a
/// destination the hook found to be the node's own ([`own_destinations`]), by (protocol,
/// port), alike; chain `hostports_dnat`, where a conditions chain goes once they hold: the
/// translation, exact before wildcard (the two never coexist for a port).
fn host_port_rules() -> Vec<Value> {
    let mut rules = Vec::new();
    let by_port = || concat([meta("l4proto"), payload("th", "dport")]);
    let translated_protocols = || {
        matches(
            "==",
            meta("l4proto"),
            json!({ "set": ["tcp", "udp", "sctp"] }),
        )
    };
    for (ip, suffix) in [("ip", "4"), ("ip6", "6")] {
        let any_chain = format!("hostports_any{suffix}");
        let (specific, any) = (
            format!("@hostports{suffix}"),
            format!("@hostports{suffix}_any"),
        );
        rules.extend([
            rule(
                "hostports",
                vec![vmap(exact_key(ip), &format!("@conditions{suffix}"))],
            ),
            rule(
                "hostports",
                vec![translated_protocols(), dnat(ip, exact_key(ip), &specific)],
            ),
            rule(
                &any_chain,
                vec![vmap(by_port(), &format!("@conditions{suffix}_any"))],
            ),
            rule(
                &any_chain,
                vec![translated_protocols(), dnat(ip, by_port(), &any)],
            ),
            rule(
                "hostports_dnat",
                vec![translated_protocols(), dnat(ip, exact_key(ip), &specific)],
            ),
            rule(
                "hostports_dnat",
                vec![
                    family_is(ip),
                    translated_protocols(),
                    dnat(ip, by_port(), &any),
                ],
            ),
        ]);
    }
    rules
}

/// The matches, one rule each, of a destination that is the node's own address in `hook`, by
/// family (`ip`): recorded in `node_addrs` and still local (an address removed is not served
/// from its next packet on); one of the interface the packet came in by, as the kernel has
/// them now, for a port a wildcard hostPort has (prerouting: an address added is served from
/// its first packet, with no call);
/// 127.0.0.0/8 (host processes). A Service address is none of these: kube-proxy's IPVS mode
/// binds it to a dummy interface no packet comes in by, and the records leave it out.
fn own_destinations(hook: &str, ip: &str) -> Vec<Vec<Value>> {
    let suffix = if ip == "ip" { "4" } else { "6" };
    let local = |flags: &[&str]| {
        matches(
            "==",
            json!({ "fib": { "result": "type", "flags": flags } }),
            json!("local"),
        )
    };
    let mut own = vec![vec![
        matches(
            "==",
            payload(ip, "daddr"),
            json!(format!("@node_addrs{suffix}")),
        ),
        local(&["daddr"]),
    ]];
    if hook == "prerouting" {
        // The port first: a connection to a port no wildcard hostPort has (nearly every one a
        // container opens) is spared the FIB lookup.
        own.push(vec![
            family_is(ip),
            matches(
                "==",
                concat([meta("l4proto"), payload("th", "dport")]),
                json!(format!("@hostports{suffix}_any")),
            ),
            local(&["daddr", "iif"]),
        ]);
    }
    if ip == "ip" {
        own.push(vec![matches("==", payload(ip, "daddr"), loopback())]);
    }
    own
}

/// The match of packets of family `ip` (`ip` or `ip6`).
fn family_is(ip: &str) -> Value {
    let family = if ip == "ip" { "ipv4" } else { "ipv6" };
    matches("==", meta("nfproto"), json!(family))
}

/// The NAT hooks: hostPorts from outside and from the host, the source of translated
/// loopback and hairpin traffic, masquerade out of the uplinks.
fn nat_rules() -> Vec<Value> {
    let jump = |target: &str| json!({ "jump": { "target": target } });
    let mut rules = Vec::new();
    for hook in ["prerouting", "output"] {
        rules.push(rule(hook, vec![jump("hostports")]));
        for (ip, suffix) in [("ip", "4"), ("ip6", "6")] {
            for mut destination in own_destinations(hook, ip) {
                destination.push(jump(&format!("hostports_any{suffix}")));
                rules.push(rule(hook, destination));
            }
        }
    }
    let dnatted = matches("in", ct("status"), json!("dnat"));
    rules.extend([rule(
        "postrouting",
        vec![
            matches("==", payload("ip", "saddr"), loopback()),
            dnatted.clone(),
            json!({ "masquerade": null }),
        ],
    )]);
    for (ip, suffix) in [("ip", "4"), ("ip6", "6")] {
        let nat = format!("@nat{suffix}");
        rules.push(rule(
            "postrouting",
            vec![dnatted.clone(), vmap(payload(ip, "daddr"), &nat)],
        ));
    }
    for (ip, suffix) in [("ip", "4"), ("ip6", "6")] {
        rules.push(rule(
            "postrouting",
            vec![
                uplinks(),
                vmap(payload(ip, "saddr"), &format!("@nat{suffix}")),
            ],
        ));
    }
    rules
}

fn uplinks() -> Value {
    matches("==", meta("oifname"), json!("@uplinks"))
}

pub(super) fn payload(protocol: &str, field: &str) -> Value {
    json!({ "payload": { "protocol": protocol, "field": field } })
}

pub(super) fn meta(key: &str) -> Value {
    json!({ "meta": { "key": key } })
}

pub(super) fn ct(key: &str) -> Value {
    json!({ "ct": { "key": key } })
}

fn prefix(addr: &str, len: u8) -> Value {
    json!({ "prefix": { "addr": addr, "len": len } })
}

fn concat<const N: usize>(parts: [Value; N]) -> Value {
    json!({ "concat": Vec::from(parts) })
}

/// The key of a hostPort mapped for one address: destination address, protocol, port.
fn exact_key(ip: &str) -> Value {
    concat([
        payload(ip, "daddr"),
        meta("l4proto"),
        payload("th", "dport"),
    ])
}

pub(super) fn matches(op: &str, left: Value, right: Value) -> Value {
    json!({ "match": { "op": op, "left": left, "right": right } })
}

pub(super) fn vmap(key: Value, map: &str) -> Value {
    json!({ "vmap": { "key": key, "data": map } })
}

/// `dnat <ip> to <key> map <map> : <key> map <map>_port`: the address from `map`, the port
/// from its companion.
fn dnat(family: &str, key: Value, map: &str) -> Value {
    json!({ "dnat": {
        "family": family,
        "addr": { "map": { "key": key.clone(), "data": map } },
        "port": { "map": { "key": key, "data": format!("{map}_port") } },
    } })
}

/// The comments of the tables of layout 3, which this build migrates from
/// (`compat`): a table made at layout 3, or one of layout 2 that a release of the
/// supported window migrated to 3 (marked by chain [`LAYOUT_3_MARKER`]).
pub(super) const LAYOUT_2: &str = "cnibpf layout 2";
pub(super) const LAYOUT_3: &str = "cnibpf layout 3";
/// The chain a `cnibpf layout 2` table migrated to layout 3 carries.
pub(super) const LAYOUT_3_MARKER: &str = "layout_3";

/// The chain of the localnet guard, whose counter is the drops of its reason.
pub(super) const LOCALNET_GUARD_CHAIN: &str = "localnet_guard";

/// What table `inet cnibpf` is to this build.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum TableLayout {
    Absent,
    /// This build's layout, made from the state named by the instance id.
    Current {
        instance: u64,
    },
    /// Layout 3, which this build migrates from (`compat`).
    Previous,
    /// Any other: its comment (empty for layout 1, which had none).
    Other(String),
}

/// The instance named by the first of `sets` that marks a table of this layout.
pub(super) fn marked_instance<'a>(mut sets: impl Iterator<Item = &'a str>) -> Option<u64> {
    // fail-closed: decoding a set name; one that names no instance marks nothing.
    sets.find_map(|name| u64::from_str_radix(name.strip_prefix(MARKER)?, 16).ok())
}

/// The layout of the table whose comment is `comment` (`None`: no table), whose marker sets
/// are `markers`, and which has chain [`LAYOUT_3_MARKER`] or not.
pub(super) fn layout_of(
    comment: Option<String>,
    markers: &[String],
    layout_3_marker: bool,
) -> TableLayout {
    let Some(comment) = comment else {
        return TableLayout::Absent;
    };
    if let Some(instance) = marked_instance(markers.iter().map(String::as_str)) {
        return TableLayout::Current { instance };
    }
    if comment == LAYOUT_3 || (comment == LAYOUT_2 && layout_3_marker) {
        return TableLayout::Previous;
    }
    TableLayout::Other(comment)
}

/// The layout of table `inet cnibpf` as the kernel has it: its comment, for a table without
/// one its marker set, for one of layout 2 whether it was migrated to 3 (one more netlink
/// question each).
pub(super) fn layout(comment: Option<String>) -> Result<TableLayout, NftablesError> {
    let markers = match &comment {
        Some(comment) if comment.is_empty() => host::sets_named(MARKER)?,
        _ => Vec::new(),
    };
    let layout_3_marker = match &comment {
        Some(comment) if comment == LAYOUT_2 => host::has_chain(LAYOUT_3_MARKER)?,
        _ => false,
    };
    Ok(layout_of(comment, &markers, layout_3_marker))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marker_set_names_the_layout_and_instance() {
        assert_eq!(
            layout_of(Some(String::new()), &[marker(0xc0ffee)], false),
            TableLayout::Current { instance: 0xc0ffee }
        );
        assert_eq!(layout_of(None, &[], false), TableLayout::Absent);
        assert_eq!(
            layout_of(Some("cnibpf layout 3".to_owned()), &[], false),
            TableLayout::Previous
        );
        assert_eq!(
            layout_of(Some("cnibpf layout 2".to_owned()), &[], true),
            TableLayout::Previous,
            "layout 2 migrated to 3 by a release of the window"
        );
        assert_eq!(
            layout_of(Some("cnibpf layout 2".to_owned()), &[], false),
            TableLayout::Other("cnibpf layout 2".to_owned()),
            "layout 2 is older than the window"
        );
        assert_eq!(
            layout_of(Some(String::new()), &[], false),
            TableLayout::Other(String::new())
        );
        assert_eq!(
            layout_of(Some("cnibpf layout 9".to_owned()), &[], false),
            TableLayout::Other("cnibpf layout 9".to_owned())
        );
    }

    #[test]
    fn every_object_of_the_skeleton_is_an_add_of_the_table() {
        let objects = skeleton(1);
        assert_eq!(objects[0]["add"]["table"]["name"], "cnibpf");
        for object in &objects[1..] {
            let body = object["add"]
                .as_object()
                .and_then(|object| object.values().next())
                .expect("one object");
            assert_eq!(body["family"], "inet", "{object}");
            assert_eq!(body["table"], "cnibpf", "{object}");
        }
    }
}
