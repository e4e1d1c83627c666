//! Masquerade and hairpin: the attachment's NAT chain `n_<owner>`, entered from chain
//! `postrouting` through the verdict maps `nat4`/`nat6` keyed by the container's addresses —
//! by destination for hairpin traffic, by source for traffic leaving by an uplink — and set
//! `uplinks`. Hash maps and a chain of its own keep an ADD or DEL as cheap with a thousand
//! attachments as with one: interval sets keyed by (source, destination) took the kernel a
//! scan of every element for each change.
//!
//! NAT chains see a connection's first packet only, and packets conntrack calls INVALID (an
//! out-of-window segment, a RST for a tuple never opened, an ICMP error about no connection)
//! none at all: they would leave with the container's own address. Its guard chain `g_<owner>`,
//! entered from chain `masquerade_guard` after every NAT through `guard4`/`guard6` by source,
//! drops (and counts) what still leaves an uplink from a masqueraded address towards a
//! destination that is not excluded.

use std::{borrow::Cow, net::IpAddr};

use cnibpf_common::drops::DropReason;
use nftables::{
    expr::{Expression, MetaKey, NamedExpression},
    schema::NfListObject,
    stmt::{AnonymousCounter, Counter, Operator, Statement},
};

use super::{
    NftablesBackend, family_suffix,
    hooks::Hooks,
    nat_chain,
    nft::{self, address_field, matches, meta, network, text},
    owner_comment,
    record::Record,
};
use crate::{
    backend::{BackendError, Endpoint, Masquerading},
    model::Masquerade,
    netlink::Link,
};

impl Masquerading for NftablesBackend {
    fn setup_masquerade(
        &mut self,
        endpoint: &Endpoint,
        masquerade: Option<&Masquerade>,
    ) -> Result<(), BackendError> {
        if let Some(after) = self.attach(endpoint)?.after.as_mut() {
            after.masquerade = masquerade.cloned();
        }
        Ok(())
    }

    fn teardown_masquerade(&mut self, owner: u64) -> Result<(), BackendError> {
        if let Some(after) = self.change(owner).after.as_mut() {
            after.masquerade = None;
        }
        Ok(())
    }

    fn check_masquerade(
        &self,
        endpoint: &Endpoint,
        masquerade: Option<&Masquerade>,
    ) -> Result<(), BackendError> {
        let listing = self.listing()?;
        let owner = owner_comment(&endpoint.attachment)?;
        let chain = nat_chain(endpoint.attachment.owner_id());
        let dispatched = |source: IpAddr| {
            ["nat", "guard"].into_iter().all(|map| {
                listing
                    .elements(&format!("{map}{}", family_suffix(source.is_ipv4())))
                    .iter()
                    .any(|element| {
                        element.comment.as_deref() == Some(owner.as_str())
                            && nft::address_of(&element.key) == Some(source)
                    })
            })
        };
        let mut installed: Vec<IpAddr> = listing
            .rules(&chain)
            .iter()
            .filter_map(|rule| {
                rule.comment
                    .as_deref()?
                    .strip_prefix(MASQUERADE)?
                    .parse()
                    // fail-closed: a rule whose comment names no address is not a masquerade rule.
                    .ok()
            })
            .filter(|source| dispatched(*source))
            .collect();
        let mut wanted: Vec<IpAddr> =
            // fail-closed: an Option of the configuration.
            masquerade.map_or_else(Vec::new, |masquerade| masquerade.sources.clone());
        installed.sort();
        wanted.sort();
        if !wanted.is_empty() && !Hooks::of_listing(listing).guard {
            return Err(BackendError::CheckFailed(format!(
                "the masquerade of {} has no guard (chain masquerade_guard is missing)",
                endpoint.attachment
            )));
        }
        if installed != wanted {
            return Err(BackendError::CheckFailed(format!(
                "the masquerade of {} differs from its configuration",
                endpoint.attachment
            )));
        }
        Ok(())
    }

    fn refresh_uplinks(&mut self, uplinks: &[Link]) -> Result<(), BackendError> {
        for uplink in uplinks {
            if !self.uplinks.contains(&uplink.name) {
                self.uplinks.push(uplink.name.clone());
            }
        }
        Ok(())
    }
}

/// The comment of the rule masquerading a source: `masquerade <address>`.
const MASQUERADE: &str = "masquerade ";

/// The comment of a guard chain's dropping rule, whose counter is its reason's drops.
/// The comment of the guard's first rule, which lets on what does not leave by an uplink.
const GUARD_NOT_LEAVING: &str = "not leaving by an uplink";

pub fn guard_drop_comment() -> String {
    format!(
        "drop reason {}",
        DropReason::MasqueradeUntranslatable.name()
    )
}

/// The container addresses `record`'s NAT chain is entered by: those hairpin traffic is
/// addressed to and those masqueraded.
pub fn nat_keys(record: &Record) -> Vec<IpAddr> {
    let mut keys: Vec<IpAddr> = Vec::new();
    let hairpin = record
        .networks
        .iter()
        .filter(|_| record.hairpin)
        .map(ipnet::IpNet::addr);
    let sources = record
        .masquerade
        .iter()
        .flat_map(|masquerade| masquerade.sources.iter().copied());
    for addr in hairpin.chain(sources) {
        if !keys.contains(&addr) {
            keys.push(addr);
        }
    }
    keys
}

/// The rules of an attachment's NAT chain. Each repeats the whole condition, as the chain is
/// entered both by destination and by source: hairpin traffic (DNATed to one of its addresses
/// from that address's own subnet) is masqueraded, traffic of a masqueraded source leaving by
/// an uplink returns untranslated towards an excluded destination and is masqueraded towards
/// any other.
pub fn nat_rules(chain: &str, record: &Record) -> Vec<NfListObject<'static>> {
    let dnat = matches(
        Expression::Named(NamedExpression::CT(nftables::expr::CT {
            key: Cow::Borrowed("status"),
            family: None,
            dir: None,
        })),
        Operator::IN,
        text("dnat"),
    );
    let mut rules = Vec::new();
    for net in record.networks.iter().filter(|_| record.hairpin) {
        let ipv4 = net.addr().is_ipv4();
        rules.push(nft::rule(
            chain,
            vec![
                dnat.clone(),
                matches(address_field(ipv4, "daddr"), Operator::EQ, text(net.addr())),
                matches(address_field(ipv4, "saddr"), Operator::EQ, network(*net)),
                Statement::Masquerade(None),
            ],
            Some(format!("hairpin {net}")),
        ));
    }
    if let Some(masquerade) = &record.masquerade {
        for source in &masquerade.sources {
            let ipv4 = source.is_ipv4();
            let leaving = || {
                vec![
                    matches(meta(MetaKey::Oifname), Operator::EQ, text("@uplinks")),
                    matches(address_field(ipv4, "saddr"), Operator::EQ, text(source)),
                ]
            };
            // One rule per exclusion rather than one anonymous set: each anonymous set is a
            // set of the table, and nft fetches every set's elements one request at a time.
            for (net, _) in masquerade
                .excludes
                .iter()
                .filter(|(net, _)| net.addr().is_ipv4() == ipv4)
            {
                let mut statements = leaving();
                statements.push(matches(
                    address_field(ipv4, "daddr"),
                    Operator::EQ,
                    network(*net),
                ));
                statements.push(Statement::Return(None));
                rules.push(nft::rule(
                    chain,
                    statements,
                    Some(format!("excluded {net}")),
                ));
            }
            let mut statements = leaving();
            statements.push(Statement::Masquerade(None));
            rules.push(nft::rule(
                chain,
                statements,
                Some(format!("{MASQUERADE}{source}")),
            ));
        }
    }
    rules
}

/// The rules of an attachment's masquerade guard, entered by source after NAT with what
/// still has one of its masqueraded addresses: what does not leave by an uplink goes on (the
/// source is looked up first, as nearly every packet leaves translated and needs no more);
/// towards an excluded destination it goes on, untranslated as it should be; anything else is
/// what NAT could not translate, dropped and counted.
pub fn guard_rules(chain: &str, record: &Record) -> Vec<NfListObject<'static>> {
    let mut rules = vec![nft::rule(
        chain,
        vec![
            matches(meta(MetaKey::Oifname), Operator::NEQ, text("@uplinks")),
            Statement::Return(None),
        ],
        Some(GUARD_NOT_LEAVING.to_owned()),
    )];
    for (net, _) in record
        .masquerade
        .iter()
        .flat_map(|masquerade| &masquerade.excludes)
    {
        rules.push(nft::rule(
            chain,
            vec![
                matches(
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
        Some(guard_drop_comment()),
    ));
    rules
}
