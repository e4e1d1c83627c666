//! The masquerade guard, in table `netdev cnibpf` beside the source checks. NAT chains see a
//! connection's first packet only, and packets conntrack calls INVALID (an out-of-window
//! segment, a RST for a tuple never opened, an ICMP error about no connection) or leaves
//! untracked none at all: they would leave with the container's own address. While an
//! attachment masquerades, chain `guard_<uplink>` on the egress of every recorded uplink —
//! past every NAT of the node — hands what leaves it from a masqueraded container's own
//! address through maps `guard4`/`guard6` by source to the container's chain `g_<owner>`,
//! which lets on what goes towards an excluded destination and drops (and counts) the rest.
//!
//! On the uplinks' egress rather than at postrouting, what never leaves by an uplink — a
//! hostPort's traffic towards its container, a container's towards its neighbours — walks no
//! guard at all.

use cnibpf_common::drops::DropReason;
use nftables::{
    schema::NfListObject,
    stmt::{AnonymousCounter, Counter, Operator, Statement},
};
use serde_json::{Value, json};

use super::{
    family_suffix,
    listing::Listing,
    nft::{self, address_field, network},
    record::Record,
    skeleton,
    store::State,
};

/// The start of the name of an uplink's hook chain, followed by the uplink's name.
const HOOK_PREFIX: &str = "guard_";

/// The hook chain on `uplink`'s egress.
pub fn hook_chain(uplink: &str) -> String {
    format!("{HOOK_PREFIX}{uplink}")
}

/// The uplinks whose egress `state`'s attachments need guarded: every recorded one while an
/// attachment masquerades, none otherwise.
pub fn hooked(state: &State) -> Vec<String> {
    let masquerading = state
        .attachments
        .values()
        .any(|record| record.masquerade.is_some());
    if masquerading {
        state.uplinks.clone()
    } else {
        Vec::new()
    }
}

/// The uplinks `listing` (of table `netdev cnibpf`) has a hook chain on.
pub fn hooked_in(listing: &Listing) -> Vec<String> {
    listing
        .chain_names()
        .filter_map(|chain| chain.strip_prefix(HOOK_PREFIX))
        .map(str::to_owned)
        .collect()
}

/// The commands (nft's JSON: the `nftables` crate's schema has no verdict maps) that take
/// the guard's hooks from the uplinks `before` to `after`: with any, the table and the maps
/// (a no-op when they are there) and each guarded uplink's chain, rewritten whole (one taken
/// out by hand is back with the next operation, as an attachment's chains are); each no
/// longer guarded uplink's chain deleted.
pub fn hook_changes(before: &[String], after: &[String]) -> Vec<Value> {
    let object = |kind: &str, body: Value| skeleton::in_family(json!({ kind: body }), "netdev");
    let mut commands = Vec::new();
    if !after.is_empty() {
        commands.push(json!({ "add": { "table": { "family": "netdev", "name": nft::TABLE } } }));
        for (suffix, address) in [("4", "ipv4_addr"), ("6", "ipv6_addr")] {
            let map =
                json!({ "name": format!("guard{suffix}"), "type": address, "map": "verdict" });
            commands.push(json!({ "add": object("map", map) }));
        }
    }
    for uplink in after {
        let name = hook_chain(uplink);
        let chain = json!({ "name": name, "type": "filter", "hook": "egress", "dev": uplink, "prio": 0, "policy": "accept" });
        commands.push(json!({ "add": object("chain", chain) }));
        commands.push(json!({ "flush": object("chain", json!({ "name": name })) }));
        for (ip, suffix) in [("ip", "4"), ("ip6", "6")] {
            let lookup = json!({ "vmap": {
                "key": { "payload": { "protocol": ip, "field": "saddr" } },
                "data": format!("@guard{suffix}"),
            } });
            let rule = json!({ "chain": name, "expr": [lookup] });
            commands.push(json!({ "add": object("rule", rule) }));
        }
    }
    for uplink in before.iter().filter(|uplink| !after.contains(uplink)) {
        let chain = json!({ "name": hook_chain(uplink) });
        commands.push(json!({ "delete": object("chain", chain) }));
    }
    commands
}

/// The comment of a guard chain's dropping rule, whose counter is its reason's drops.
pub fn drop_comment() -> String {
    format!(
        "drop reason {}",
        DropReason::MasqueradeUntranslatable.name()
    )
}

/// The rules of an attachment's chain `chain`, entered by source with what leaves an uplink
/// from one of its masqueraded addresses: towards an excluded destination it goes on,
/// untranslated as it should be; anything else is what NAT could not translate, dropped and
/// counted.
pub fn rules(chain: &str, record: &Record) -> Vec<NfListObject<'static>> {
    let mut rules = Vec::new();
    for (net, _) in record
        .masquerade
        .iter()
        .flat_map(|masquerade| &masquerade.excludes)
    {
        rules.push(nft::rule(
            chain,
            vec![
                nft::matches(
                    address_field(net.addr().is_ipv4(), "daddr"),
                    Operator::EQ,
                    network(*net),
                ),
                Statement::Return(None),
            ],
            Some(format!("excluded {net}")),
        ));
    }
    rules.push(nft::rule(
        chain,
        vec![
            Statement::Counter(Counter::Anonymous(Some(AnonymousCounter::default()))),
            Statement::Drop(None),
        ],
        Some(drop_comment()),
    ));
    rules.into_iter().map(nft::in_netdev).collect()
}

/// The map of `source`'s family that enters the guard chains.
pub fn map_of(source: std::net::IpAddr) -> String {
    format!("guard{}", family_suffix(source.is_ipv4()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::nftables::hooks::chains_in as chains;

    fn uplinks(names: &[&str]) -> Vec<String> {
        names.iter().map(|name| (*name).to_owned()).collect()
    }

    #[test]
    fn each_uplink_is_hooked_when_first_guarded_and_unhooked_when_no_longer() {
        let first = hook_changes(&[], &uplinks(&["eth0"]));
        assert_eq!(chains(&first, "add"), ["guard_eth0"]);
        let hook = first
            .iter()
            .find(|command| command["add"]["chain"]["name"] == "guard_eth0")
            .map(|command| command["add"]["chain"].clone())
            .expect("the hook chain");
        assert_eq!(hook["hook"], "egress");
        assert_eq!(hook["dev"], "eth0");
        assert_eq!(hook["family"], "netdev");
        assert!(
            first
                .iter()
                .any(|command| command["add"]["map"]["name"] == "guard6"),
            "the maps come with the first hook: {first:?}"
        );
        assert_eq!(
            first
                .iter()
                .filter(|command| command["add"]["rule"]["chain"] == "guard_eth0")
                .count(),
            2,
            "one lookup per family"
        );
        let second = hook_changes(&uplinks(&["eth0"]), &uplinks(&["eth0", "bond0"]));
        assert_eq!(chains(&second, "add"), ["guard_eth0", "guard_bond0"]);
        assert_eq!(
            chains(&second, "flush"),
            ["guard_eth0", "guard_bond0"],
            "rewritten whole"
        );
        assert!(chains(&second, "delete").is_empty());
        let last = hook_changes(&uplinks(&["eth0", "bond0"]), &[]);
        assert!(last.iter().all(|command| command.get("add").is_none()));
        assert_eq!(chains(&last, "delete"), ["guard_eth0", "guard_bond0"]);
        assert!(hook_changes(&[], &[]).is_empty());
    }

    #[test]
    fn a_hook_chain_names_its_uplink() {
        let listing = Listing::from(
            &[
                hook_chain("eth0"),
                "g_0000000000000007".to_owned(),
                "s_0000000000000007".to_owned(),
            ]
            .map(nft::Listed::Chain),
        );
        assert_eq!(hooked_in(&listing), ["eth0"]);
    }
}
