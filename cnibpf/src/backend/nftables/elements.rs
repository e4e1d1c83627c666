//! What an attachment's record stands for in the table — its elements of the shared sets and
//! maps and its own chains — as the commands that remove what it held and add what it holds.

use std::{collections::BTreeSet, net::IpAddr};

use nftables::{
    batch::Batch,
    expr::Expression,
    schema::{Chain, NfCmd, NfListObject},
};

use super::{
    Change, conditions_chain, family_suffix,
    filter::write as filter_write,
    filter_chains, guard, guard_chain,
    listing::Listing,
    masquerade, members, nat_chain,
    nft::{self, concat, jump, mapping, number, owned, text},
    portmap,
    record::{Record, Sources},
    sources,
};
use crate::model::ResolvedMapping;

/// One element an attachment owns.
struct Owned {
    set: String,
    key: Expression<'static>,
    value: Option<Expression<'static>>,
    /// Added with `create`: refused if another holds the key (hostPorts).
    exclusive: bool,
}

/// The key of a hostPort in its map of container addresses: (`hostports4`/`6`, with `_any` for
/// a wildcard); its container port is under the same key in the map named with `_port`.
pub fn host_port_key(mapping: &ResolvedMapping) -> (String, Expression<'static>) {
    let suffix = family_suffix(mapping.is_ipv4());
    let protocol = text(mapping.protocol);
    let port = number(mapping.host_port);
    match mapping.host_addr {
        Some(addr) => (
            format!("hostports{suffix}"),
            concat(vec![text(addr), protocol, port]),
        ),
        None => (
            format!("hostports{suffix}_any"),
            concat(vec![protocol, port]),
        ),
    }
}

/// `proto . port` of a hostPort: the key of the wildcard map and of the address-specific
/// markers.
fn port_key(mapping: &ResolvedMapping) -> Expression<'static> {
    concat(vec![text(mapping.protocol), number(mapping.host_port)])
}

fn owned_elements(owner: u64, record: &Record) -> Vec<Owned> {
    let mut out = vec![Owned {
        set: "attachments".to_owned(),
        key: text(&record.host),
        value: None,
        exclusive: false,
    }];
    let element = |set: String, key, value| Owned {
        set,
        key,
        value,
        exclusive: false,
    };
    for net in record.networks.iter().filter(|_| record.filter.is_some()) {
        let suffix = family_suffix(net.addr().is_ipv4());
        let [out_chain, in_chain] = filter_chains(owner);
        out.push(element(
            format!("filter_out{suffix}"),
            text(net.addr()),
            Some(jump(&out_chain, false)),
        ));
        out.push(element(
            format!("filter_in{suffix}"),
            text(net.addr()),
            Some(jump(&in_chain, false)),
        ));
    }
    for addr in masquerade::nat_keys(record) {
        out.push(element(
            format!("nat{}", family_suffix(addr.is_ipv4())),
            text(addr),
            Some(jump(&nat_chain(owner), false)),
        ));
    }
    for host_port in &record.mappings {
        let (set, key) = host_port_key(host_port);
        if !record.conditions(host_port.is_ipv4()).is_empty() {
            out.push(element(
                set.replace("hostports", "conditions"),
                key.clone(),
                Some(jump(&conditions_chain(owner), true)),
            ));
        }
        out.push(element(
            format!("{set}_port"),
            key.clone(),
            Some(number(host_port.container_port)),
        ));
        out.push(Owned {
            set,
            key,
            value: Some(text(host_port.container_addr)),
            exclusive: true,
        });
    }
    out
}

/// Removes what `change.before` holds and is not carried over, then the chains that go; its
/// network's member elements but those in `kept_members` (the next state's).
pub fn remove(
    batch: &mut Batch<'static>,
    owner: u64,
    change: &Change,
    specific: Option<&Listing>,
    kept_members: &BTreeSet<(String, IpAddr)>,
) {
    let Some(before) = &change.before else {
        return;
    };
    for element in owned_elements(owner, before) {
        batch.delete(nft::elements(&element.set, vec![element.key]));
    }
    for member in members::of(before) {
        if !kept_members.contains(&member) {
            batch.delete(nft::elements(&member.0, vec![text(member.1)]));
        }
    }
    let kept_specific = |mapping: &ResolvedMapping| {
        change.after.as_ref().is_some_and(|after| {
            after.mappings.iter().any(|next| {
                next.host_addr.is_some()
                    && next.is_ipv4() == mapping.is_ipv4()
                    && next.protocol == mapping.protocol
                    && next.host_port == mapping.host_port
            })
        })
    };
    let mut markers: Vec<(String, Expression<'static>)> = Vec::new();
    for old in before.mappings.iter().filter(|old| old.host_addr.is_some()) {
        let held_by_others =
            specific.is_some_and(|listing| listing.specific_held_by_others(owner, old));
        let set = format!("specific_ports{}", family_suffix(old.is_ipv4()));
        let key = port_key(old);
        if !kept_specific(old) && !held_by_others && !markers.contains(&(set.clone(), key.clone()))
        {
            markers.push((set, key));
        }
    }
    for (set, key) in markers {
        batch.delete(nft::elements(&set, vec![key]));
    }
    let after = change.after.as_ref();
    let filtered = |record: &Record| record.filter.is_some();
    if let Some(filter) = &before.filter
        && !after.is_some_and(filtered)
    {
        for chain in filter_write::chains(owner, filter).iter().rev() {
            batch.delete(nft::chain(chain));
        }
    }
    if before.conditioned() && !after.is_some_and(Record::conditioned) {
        batch.delete(nft::chain(&conditions_chain(owner)));
    }
    let translated = |record: &Record| !masquerade::nat_keys(record).is_empty();
    if translated(before) && !after.is_some_and(translated) {
        batch.delete(nft::chain(&nat_chain(owner)));
    }
    for source in masqueraded_sources(before) {
        batch.delete(nft::in_netdev(nft::elements(
            &guard::map_of(*source),
            vec![text(source)],
        )));
    }
    let masqueraded = |record: &Record| record.masquerade.is_some();
    if masqueraded(before) && !after.is_some_and(masqueraded) {
        batch.delete(nft::in_netdev(nft::chain(&guard_chain(owner))));
    }
    // A chain hooked on another interface cannot be changed to this one: it goes, and `add`
    // makes it anew.
    let checked_on = |record: &Record| {
        matches!(record.sources, Sources::Checked(_)).then(|| record.host.clone())
    };
    if let Some(host) = checked_on(before)
        && after.and_then(checked_on) != Some(host)
    {
        sources::delete_chain(batch, owner);
    }
}

/// Removes what the tables hold of `owner` as listed (`listing`, of table `inet cnibpf`;
/// `netdev`, of table `netdev cnibpf`) — its elements by their comment, its chains by name —
/// for when its record no longer says so (someone changed the table).
pub fn remove_listed(
    batch: &mut Batch<'static>,
    owner: u64,
    owner_text: &str,
    listing: &Listing,
    netdev: &Listing,
) {
    for (set, element) in listing.owned_by(owner_text) {
        batch.delete(nft::elements(set, vec![element.key.clone()]));
    }
    for (map, element) in netdev.owned_by(owner_text) {
        batch.delete(nft::in_netdev(nft::elements(
            map,
            vec![element.key.clone()],
        )));
    }
    if netdev.has_chain(&guard_chain(owner)) {
        batch.delete(nft::in_netdev(nft::chain(&guard_chain(owner))));
    }
    let [out_chain, in_chain] = filter_chains(owner);
    let jumped_to = listing
        .chain_names()
        .filter(|chain| chain.starts_with(&format!("l_{owner:016x}_")))
        .map(str::to_owned)
        .chain([super::reject_chain(owner)]);
    let chains = [
        conditions_chain(owner),
        nat_chain(owner),
        out_chain,
        in_chain,
    ];
    for chain in chains.into_iter().chain(jumped_to.collect::<Vec<_>>()) {
        if listing.has_chain(&chain) {
            batch.delete(nft::chain(&chain));
        }
    }
    if netdev.has_chain(&sources::chain_name(owner)) {
        sources::delete_chain(batch, owner);
    }
}

/// Adds what `change.after` holds: its chains, rewritten whole, and its elements. A hostPort
/// another attachment holds makes the transaction fail (`create`); a wildcard one that an
/// address-specific one of another overlaps, or the reverse, as well. Its `log` rules log to
/// group `log_group`.
pub fn add(batch: &mut Batch<'static>, owner: u64, change: &Change, log_group: u16) {
    let Some(after) = &change.after else {
        return;
    };
    if let Some(filter) = &after.filter {
        write_filter(batch, owner, change, filter, log_group);
    }
    if after.conditioned() {
        let chain = conditions_chain(owner);
        rewrite_chain(batch, &chain);
        for rule in portmap::condition_rules(&chain, after) {
            batch.add(rule);
        }
    }
    write_nat_chain(batch, owner, after);
    if after.masquerade.is_some() {
        let chain = guard_chain(owner);
        rewrite(
            batch,
            Chain {
                family: nft::NETDEV,
                ..nft::chain_of(&chain)
            },
        );
        for rule in guard::rules(&chain, after) {
            batch.add(rule);
        }
        for source in masqueraded_sources(after) {
            let element = mapping(owned(text(source), &after.owner), jump(&chain, true));
            batch.add(nft::in_netdev(nft::elements(
                &guard::map_of(*source),
                vec![element],
            )));
        }
    }
    if let Sources::Checked(check) = &after.sources {
        // fail-closed: an Option of the plan: without siblings it admits its own addresses.
        let admitted = change.admitted.as_ref().unwrap_or(check);
        sources::add_chain(batch, owner, &after.host, admitted);
    }
    for element in owned_elements(owner, after) {
        add_element(batch, element, &after.owner);
    }
    for (set, addr) in members::of(after) {
        batch.add(nft::elements(&set, vec![owned(text(addr), &after.owner)]));
    }
    for host_port in &after.mappings {
        exclude_overlaps(batch, host_port);
    }
}

/// Writes the chains of `filter`, whole; then deletes those of the filter before that it no
/// longer has (the rules that jumped to them are gone with the rewrite).
fn write_filter(
    batch: &mut Batch<'static>,
    owner: u64,
    change: &Change,
    filter: &crate::model::Filter,
    log_group: u16,
) {
    let chains = filter_write::chains(owner, filter);
    for chain in &chains {
        rewrite_chain(batch, chain);
    }
    for rule in filter_write::rules(owner, filter, change.kept_counters.as_ref(), log_group) {
        batch.add(rule);
    }
    let before = change
        .before
        .as_ref()
        .and_then(|record| record.filter.as_ref());
    for stale in before
        .map(|before| filter_write::chains(owner, before))
        .into_iter()
        .flatten()
        .filter(|chain| !chains.contains(chain))
    {
        batch.delete(nft::chain(&stale));
    }
}

/// Makes sets `node_addrs4` and `node_addrs6` hold `addresses` (the loopback ones aside: the
/// skeleton's rules take 127.0.0.0/8 for host processes, and `[::1]` is the eBPF datapath's).
pub fn replace_node_addresses(batch: &mut Batch<'static>, addresses: &[IpAddr]) {
    for ipv4 in [true, false] {
        let set = format!("node_addrs{}", family_suffix(ipv4));
        batch.add_cmd(NfCmd::Flush(nftables::schema::FlushObject::Set(Box::new(
            nftables::schema::Set {
                family: nft::FAMILY,
                table: nft::TABLE.into(),
                name: set.clone().into(),
                ..nftables::schema::Set::default()
            },
        ))));
        let members: Vec<_> = addresses
            .iter()
            .filter(|addr| addr.is_ipv4() == ipv4 && !addr.is_loopback())
            .map(text)
            .collect();
        if !members.is_empty() {
            batch.add(nft::elements(&set, members));
        }
    }
}

/// Writes `record`'s NAT chain, whole, when it has one.
fn write_nat_chain(batch: &mut Batch<'static>, owner: u64, record: &Record) {
    if masquerade::nat_keys(record).is_empty() {
        return;
    }
    let chain = nat_chain(owner);
    rewrite_chain(batch, &chain);
    for rule in masquerade::nat_rules(&chain, record) {
        batch.add(rule);
    }
}

fn add_element(batch: &mut Batch<'static>, element: Owned, owner_text: &str) {
    let item = match element.value {
        Some(value) => mapping(owned(element.key, owner_text), value),
        None => owned(element.key, owner_text),
    };
    let object = nft::elements(&element.set, vec![item]);
    batch.add_cmd(if element.exclusive {
        NfCmd::Create(object)
    } else {
        NfCmd::Add(object)
    });
}

/// The commands that make the transaction fail if another attachment holds a hostPort that
/// overlaps `host_port` across the wildcard / address-specific divide (the same kind is
/// caught by `create` on its own map): creating an element that such a holder's presence
/// makes exist, and deleting it again.
fn exclude_overlaps(batch: &mut Batch<'static>, host_port: &ResolvedMapping) {
    let suffix = family_suffix(host_port.is_ipv4());
    let key = port_key(host_port);
    if host_port.host_addr.is_some() {
        // No wildcard of another on this port.
        let any = format!("hostports{suffix}_any");
        let placeholder = text(if host_port.is_ipv4() { "0.0.0.0" } else { "::" });
        batch.add_cmd(NfCmd::Create(nft::elements(
            &any,
            vec![mapping(key.clone(), placeholder)],
        )));
        batch.delete(nft::elements(&any, vec![key.clone()]));
        batch.add(nft::elements(&format!("specific_ports{suffix}"), vec![key]));
    } else {
        // No address-specific one of another on this port: its marker would be there.
        let markers = format!("specific_ports{suffix}");
        batch.add_cmd(NfCmd::Create(nft::elements(&markers, vec![key.clone()])));
        batch.delete(nft::elements(&markers, vec![key]));
    }
}

/// `add chain` (a no-op when it is there) and `flush chain`: chain `name` of table `inet
/// cnibpf` exists, empty.
fn rewrite_chain(batch: &mut Batch<'static>, name: &str) {
    rewrite(batch, nft::chain_of(name));
}

fn rewrite(batch: &mut Batch<'static>, chain: Chain<'static>) {
    batch.add(NfListObject::Chain(chain.clone()));
    batch.add_cmd(NfCmd::Flush(nftables::schema::FlushObject::Chain(chain)));
}

/// The addresses `record` masquerades, which enter its guard chain.
fn masqueraded_sources(record: &Record) -> impl Iterator<Item = &IpAddr> {
    record
        .masquerade
        .iter()
        .flat_map(|masquerade| &masquerade.sources)
}
