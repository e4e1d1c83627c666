//! Masquerade and hairpin: the attachment's NAT chain `n_<owner>`, entered from chain
//! `postrouting` through the verdict maps `nat4`/`nat6` keyed by the container's addresses —
//! by destination for hairpin traffic, by source for traffic leaving by an uplink — and set
//! `uplinks`. Hash maps and a chain of its own keep an ADD or DEL as cheap with a thousand
//! attachments as with one: interval sets keyed by (source, destination) took the kernel a
//! scan of every element for each change.
//!
//! What NAT chains never see (conntrack's INVALID and untracked packets) is the masquerade
//! guard's, on the uplinks' egress (`guard`).

use std::{borrow::Cow, net::IpAddr};

use nftables::{
    expr::{Expression, MetaKey, NamedExpression},
    schema::NfListObject,
    stmt::{Operator, Statement},
};

use super::{
    NftablesBackend, family_suffix, guard,
    listing::Listing,
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
        let guards = self.netdev_listing()?;
        let owner = owner_comment(&endpoint.attachment)?;
        let chain = nat_chain(endpoint.attachment.owner_id());
        let entered_by = |listing: &Listing, map: String, source: IpAddr| {
            listing.elements(&map).iter().any(|element| {
                element.comment.as_deref() == Some(owner.as_str())
                    && nft::address_of(&element.key) == Some(source)
            })
        };
        let dispatched = |source: IpAddr| {
            entered_by(
                listing,
                format!("nat{}", family_suffix(source.is_ipv4())),
                source,
            ) && entered_by(guards, guard::map_of(source), source)
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
        let hooked = guard::hooked_in(guards);
        // fail-closed: no state records no uplink.
        let uplinks = self.store.state().map_or(&[][..], |state| &state.uplinks);
        if !wanted.is_empty()
            && let Some(unguarded) = uplinks.iter().find(|uplink| !hooked.contains(uplink))
        {
            return Err(BackendError::CheckFailed(format!(
                "the masquerade of {} has no guard on uplink {unguarded} (chain netdev {} {} is missing)",
                endpoint.attachment,
                nft::TABLE,
                guard::hook_chain(unguarded)
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
