//! The table's hook chains that only some attachments need, registered while one of them is
//! there (see [`Hooks`]), with their rules.

use serde_json::{Value, json};

use super::{
    listing::Listing,
    skeleton::{
        self, LOCALNET_GUARD_CHAIN, ct, in_table, loopback, matches, meta, payload, rule, vmap,
    },
    store::State,
};

/// The hook chains only some attachments need, each registered while one of them is there:
/// every registered hook is a call on every packet of every flow through it, which the
/// node's other traffic should not pay for a feature no pod uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Hooks {
    /// `forward`, `input` and `local_out`: while an attachment has a filter.
    pub filter: bool,
    /// The localnet guard (`localnet_guard`, reached from `localnet_new` and `localnet_local`):
    /// while an attachment has hostPorts (the NAT hooks translate a packet to 127.0.0.0/8 on a
    /// wildcard one, whatever interface it came in by) or an interface has the
    /// `route_localnet` cnibpf switched on.
    pub localnet: bool,
}

/// The filter's hook chains.
const FILTER_HOOK_CHAINS: [&str; 3] = ["forward", "input", "local_out"];
/// The localnet guard's hook chains: the first packet of every connection before any
/// hostPort's DNAT, and whatever else the host's routing delivers locally.
const LOCALNET_HOOK_CHAINS: [&str; 2] = ["localnet_new", "localnet_local"];

impl Hooks {
    /// The hooks the attachments of `state` need.
    pub(super) fn of(state: &State) -> Self {
        let records = || state.attachments.values();
        Self {
            filter: records().any(|record| record.filter.is_some()),
            localnet: records().any(|record| !record.mappings.is_empty())
                || !state.localnet_interfaces.is_empty(),
        }
    }

    /// The hooks `listing`'s table has.
    pub(super) fn of_listing(listing: &Listing) -> Self {
        Self {
            filter: FILTER_HOOK_CHAINS
                .iter()
                .any(|chain| listing.has_chain(chain)),
            localnet: listing.has_chain(LOCALNET_GUARD_CHAIN)
                && LOCALNET_HOOK_CHAINS
                    .iter()
                    .all(|chain| listing.has_chain(chain)),
        }
    }
}

/// The commands that make the table from the state named `instance`, with `hooks`.
pub(super) fn table_with(instance: u64, hooks: Hooks) -> Vec<Value> {
    let mut commands = skeleton::skeleton(instance);
    commands.extend(hook_changes(Hooks::default(), hooks));
    commands
}

/// The commands that take the table's hooks from `before` to `after`: the chains (and their
/// rules) of a hook now needed added, those of a hook no longer needed deleted.
pub(super) fn hook_changes(before: Hooks, after: Hooks) -> Vec<Value> {
    let added = Hooks {
        filter: after.filter && !before.filter,
        localnet: after.localnet && !before.localnet,
    };
    let mut removed = Vec::new();
    if before.filter && !after.filter {
        removed.extend(FILTER_HOOK_CHAINS);
    }
    if before.localnet && !after.localnet {
        // The chains that jump to the guard go before it.
        removed.extend(LOCALNET_HOOK_CHAINS);
        removed.push(LOCALNET_GUARD_CHAIN);
    }
    let deletions = removed
        .into_iter()
        .map(|name| json!({ "delete": in_table(json!({ "chain": { "name": name } })) }));
    hook_objects(added)
        .into_iter()
        .map(|object| json!({ "add": in_table(object) }))
        .chain(deletions)
        .collect()
}

/// The chains of `hooks` with their rules.
fn hook_objects(hooks: Hooks) -> Vec<Value> {
    let typed = |name: &str, kind: &str, hook: &str, priority: i32| json!({ "chain": { "name": name, "type": kind, "hook": hook, "prio": priority, "policy": "accept" } });
    let hooked = |name: &str, hook: &str, priority: i32| typed(name, "filter", hook, priority);
    let mut objects = Vec::new();
    if hooks.localnet {
        objects.push(json!({ "chain": { "name": LOCALNET_GUARD_CHAIN } }));
        objects.extend(localnet_guard_rules());
        // A NAT chain is walked only by a connection's first packet, before the hostPorts'
        // DNAT (-100; the kernel takes no NAT chain at or before conntrack's -200): the
        // datagrams and segments of established flows pay nothing for the guard.
        objects.push(typed(LOCALNET_HOOK_CHAINS[0], "nat", "prerouting", -150));
        // What no NAT chain sees (no conntrack entry: invalid, untracked) and reaches a local
        // socket through an interface with `route_localnet` on.
        objects.push(hooked(LOCALNET_HOOK_CHAINS[1], "input", -300));
        for chain in LOCALNET_HOOK_CHAINS {
            objects.push(rule(
                chain,
                vec![json!({ "jump": { "target": LOCALNET_GUARD_CHAIN } })],
            ));
        }
    }
    if hooks.filter {
        objects.extend(
            FILTER_HOOK_CHAINS
                .into_iter()
                .zip(["forward", "input", "output"])
                .map(|(chain, hook)| hooked(chain, hook, 0)),
        );
        objects.extend(filter_hook_rules());
    }
    objects
}

/// What comes to 127.0.0.0/8 from elsewhere than the loopback is dropped (CVE-2020-8558),
/// by the destination it had on the wire: past prerouting (`localnet_local`) a translated
/// packet has its new one — the answer of a host process's connection to `127.0.0.1:hostPort`
/// (masqueraded, so its reply is translated back to the loopback), or a packet another NAT
/// rule of the host sent to a local service there — and passes.
fn localnet_guard_rules() -> Vec<Value> {
    let translated = |direction: &str, status: &str| {
        rule(
            LOCALNET_GUARD_CHAIN,
            vec![
                matches("==", ct("direction"), json!(direction)),
                matches("in", ct("status"), json!(status)),
                json!({ "return": null }),
            ],
        )
    };
    vec![
        translated("original", "dnat"),
        translated("reply", "snat"),
        json!({ "rule": { "chain": LOCALNET_GUARD_CHAIN, "expr": [
            matches("==", payload("ip", "daddr"), loopback()),
            matches("!=", meta("iifname"), json!("lo")),
            json!({ "counter": null }),
            json!({ "drop": null }),
        ], "comment": "drop reason localnet_guard" } }),
    ]
}

/// The filter hooks: replies, related errors and IPv6 control pass; then a container's
/// traffic by its address, each way — the host's input sees only what containers send it,
/// its output only what it sends them.
fn filter_hook_rules() -> Vec<Value> {
    let mut rules = Vec::new();
    let accept = |condition: Value| vec![condition, json!({ "accept": null })];
    for chain in FILTER_HOOK_CHAINS {
        rules.push(rule(
            chain,
            accept(matches("==", ct("direction"), json!("reply"))),
        ));
        rules.push(rule(
            chain,
            accept(matches("in", ct("state"), json!("related"))),
        ));
        rules.push(rule(
            chain,
            accept(matches(
                "==",
                payload("icmpv6", "type"),
                json!("@icmpv6_control"),
            )),
        ));
    }
    for (chain, directions) in [
        (
            "forward",
            &[("saddr", "filter_out"), ("daddr", "filter_in")][..],
        ),
        ("input", &[("saddr", "filter_out")][..]),
        ("local_out", &[("daddr", "filter_in")][..]),
    ] {
        for (ip, suffix) in [("ip", "4"), ("ip6", "6")] {
            for (field, map) in directions {
                rules.push(rule(
                    chain,
                    vec![vmap(payload(ip, field), &format!("@{map}{suffix}"))],
                ));
            }
        }
    }
    rules
}

/// The chains `commands` `verb` (add, flush or delete), in order.
#[cfg(test)]
pub(super) fn chains_in(commands: &[Value], verb: &str) -> Vec<String> {
    commands
        .iter()
        .filter_map(|command| command[verb]["chain"]["name"].as_str())
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{chains_in as chains, *};

    #[test]
    fn a_hook_is_added_when_first_needed_and_deleted_when_no_longer() {
        let none = Hooks::default();
        let filter = Hooks {
            filter: true,
            ..Hooks::default()
        };
        let both = Hooks {
            filter: true,
            localnet: true,
        };
        assert!(hook_changes(both, both).is_empty());
        let first_filter = hook_changes(none, filter);
        assert_eq!(
            chains(&first_filter, "add"),
            ["forward", "input", "local_out"]
        );
        assert!(
            first_filter
                .iter()
                .any(|command| command["add"]["rule"]["chain"] == "forward"),
            "the chains come with their rules"
        );
        let localnet_too = hook_changes(filter, both);
        assert_eq!(
            chains(&localnet_too, "add"),
            ["localnet_guard", "localnet_new", "localnet_local"]
        );
        assert!(chains(&localnet_too, "delete").is_empty());
        let last_filter_gone = hook_changes(
            both,
            Hooks {
                localnet: true,
                ..Hooks::default()
            },
        );
        assert!(chains(&last_filter_gone, "add").is_empty());
        assert_eq!(
            chains(&last_filter_gone, "delete"),
            ["forward", "input", "local_out"]
        );
    }

    #[test]
    fn the_localnet_guard_comes_before_the_chains_that_jump_to_it_and_goes_after_them() {
        let localnet = Hooks {
            localnet: true,
            ..Hooks::default()
        };
        let added = hook_changes(Hooks::default(), localnet);
        assert_eq!(
            chains(&added, "add"),
            ["localnet_guard", "localnet_new", "localnet_local"]
        );
        let first_new = |chain: &str| {
            added
                .iter()
                .find(|command| command["add"]["chain"]["name"] == chain)
                .map(|command| command["add"]["chain"].clone())
                .unwrap_or_else(|| panic!("no chain {chain} in {added:?}"))
        };
        assert_eq!(first_new("localnet_new")["type"], "nat");
        assert_eq!(first_new("localnet_new")["prio"], -150);
        assert_eq!(first_new("localnet_local")["hook"], "input");
        assert!(
            first_new("localnet_guard").get("hook").is_none(),
            "the guard itself is a regular chain, jumped to"
        );
        assert_eq!(
            chains(&hook_changes(localnet, Hooks::default()), "delete"),
            ["localnet_new", "localnet_local", "localnet_guard"]
        );
    }
}
