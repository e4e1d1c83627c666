//! Networks as filter rules name them (`srcNetwork`, `dstNetwork`): for each network, one set a
//! family (`net4_<network>`, `net6_<network>`) of the addresses of its attachments under this
//! instance, each element's comment its owner. Every rule that names the network looks the set
//! up, so the transaction that adds or removes an attachment changes what all of them match, and
//! no rule is written again. A network's sets are there while it has an attachment or a rule
//! names it.

use std::{collections::BTreeSet, net::IpAddr};

use nftables::{
    batch::Batch,
    schema::{NfListObject, Set, SetType, SetTypeValue},
};

use super::{
    NftablesError, host, listing::Listing, member_set, nft, parse_owner, record::Record,
    store::State,
};

/// The networks whose sets `state` needs: those of its attachments, and those its rules name.
pub fn needed(state: &State) -> BTreeSet<String> {
    let mut networks = BTreeSet::new();
    for record in state.attachments.values() {
        if let Some(attachment) = parse_owner(&record.owner) {
            networks.insert(attachment.network);
        }
        let rules = record.filter.iter().flat_map(|filter| &filter.rules);
        let named = rules.flat_map(|rule| [&rule.src_network, &rule.dst_network]);
        for network in named.flatten() {
            networks.insert(network.to_string());
        }
    }
    networks
}

/// Adds the sets of `networks` (a no-op for those there): before any rule that looks them up.
pub fn add_sets<'n>(batch: &mut Batch<'static>, networks: impl IntoIterator<Item = &'n String>) {
    for network in networks {
        for ipv4 in [true, false] {
            batch.add(set(network, ipv4));
        }
    }
}

/// Deletes the sets of the networks `before` needed and `next` does not — of those `listing`
/// holds, when the table may differ from its records: after every rule that looked them up.
pub fn delete_unneeded(
    batch: &mut Batch<'static>,
    before: &State,
    next: &State,
    listing: Option<&Listing>,
) {
    let kept = needed(next);
    for network in needed(before).difference(&kept) {
        for ipv4 in [true, false] {
            let name = member_set(network, ipv4);
            if listing.is_none_or(|listing| listing.has_set(&name)) {
                batch.delete(set(network, ipv4));
            }
        }
    }
}

/// The attachment's member elements: its addresses in its network's sets.
pub fn of(record: &Record) -> Vec<(String, IpAddr)> {
    let Some(attachment) = parse_owner(&record.owner) else {
        return Vec::new();
    };
    record
        .networks
        .iter()
        .map(|net| {
            (
                member_set(&attachment.network, net.addr().is_ipv4()),
                net.addr(),
            )
        })
        .collect()
}

/// Adds the member elements of every attachment of `state` in a network whose sets the table
/// did not have (`present`: the networks whose sets it has): a table an earlier release made,
/// whose attachments joined no set, so that the rules naming their network see them at once.
pub fn backfill(batch: &mut Batch<'static>, state: &State, present: &BTreeSet<String>) {
    for record in state.attachments.values() {
        let joined = parse_owner(&record.owner)
            .is_some_and(|attachment| present.contains(&attachment.network));
        if joined {
            continue;
        }
        for (set, addr) in of(record) {
            batch.add(nft::elements(
                &set,
                vec![nft::owned(nft::text(addr), &record.owner)],
            ));
        }
    }
}

/// The networks whose IPv4 member set the table has (the IPv6 one comes with it): one netlink
/// dump of the table's sets.
pub fn present() -> Result<BTreeSet<String>, NftablesError> {
    let prefix = member_set("", true);
    Ok(host::sets_named(&prefix)?
        .into_iter()
        .map(|name| name[prefix.len()..].to_owned())
        .collect())
}

/// Every member element of `state`'s attachments: what a leaving attachment's removal must not
/// take when another (one whose interface went without a DEL, its address given again) holds it.
pub fn all(state: &State) -> BTreeSet<(String, IpAddr)> {
    state.attachments.values().flat_map(of).collect()
}

fn set(network: &str, ipv4: bool) -> NfListObject<'static> {
    NfListObject::Set(Box::new(Set {
        family: nft::FAMILY,
        table: nft::TABLE.into(),
        name: member_set(network, ipv4).into(),
        handle: None,
        set_type: SetTypeValue::Single(if ipv4 {
            SetType::Ipv4Addr
        } else {
            SetType::Ipv6Addr
        }),
        policy: None,
        flags: None,
        elem: None,
        timeout: None,
        gc_interval: None,
        size: None,
        comment: None,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        backend::nftables::store::OwnerId,
        model::{Direction, Filter, FilterRule, NetworkName, Target},
    };

    fn record(owner: &str, addresses: &[&str], named: Option<&str>) -> Record {
        let rule = named.map(|network| FilterRule {
            src_network: Some(NetworkName::new(network).expect("valid")),
            ..FilterRule::matching_all(1, Target::Allow, Direction::Ingress)
        });
        Record {
            owner: owner.to_owned(),
            networks: addresses
                .iter()
                .map(|addr| addr.parse().expect("literal"))
                .collect(),
            filter: rule.map(|rule| Filter {
                rules: vec![rule],
                default: Target::Drop,
            }),
            ..Record::default()
        }
    }

    #[test]
    fn a_network_is_needed_while_it_has_an_attachment_or_a_rule_names_it() {
        let mut state = State::default();
        state.attachments.insert(
            OwnerId(1),
            record("protected/eth0/a", &["10.31.0.2/24"], Some("dmz")),
        );
        assert_eq!(
            needed(&state).into_iter().collect::<Vec<_>>(),
            ["dmz", "protected"]
        );
        state.attachments.insert(
            OwnerId(2),
            record("dmz/eth0/b", &["10.32.0.2/24", "fd00:32::2/64"], None),
        );
        assert_eq!(
            of(&state.attachments[&OwnerId(2)]),
            [
                ("net4_dmz".to_owned(), "10.32.0.2".parse().expect("literal")),
                (
                    "net6_dmz".to_owned(),
                    "fd00:32::2".parse().expect("literal")
                ),
            ]
        );
        let before = state.clone();
        state.attachments.remove(&OwnerId(1));
        let mut batch = Batch::new();
        delete_unneeded(&mut batch, &before, &state, None);
        let commands = serde_json::to_value(batch.to_nftables()).expect("encodes");
        let deleted: Vec<&str> = commands["nftables"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|command| command["delete"]["set"]["name"].as_str())
            .collect();
        assert_eq!(deleted, ["net4_protected", "net6_protected"]);
    }
}
