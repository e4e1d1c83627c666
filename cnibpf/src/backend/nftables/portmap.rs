//! Port mappings: the hostport maps (DNAT by exact hostIP, then by port for any local address),
//! the address-specific markers that let a wildcard hostPort find an overlapping specific one
//! without a scan, the hairpin set, and the conditions chain `c_<owner>` that conditioned
//! hostPorts are handed to first.

use nftables::{
    expr::{Expression, MetaKey, NamedExpression, SetItem},
    schema::NfListObject,
    stmt::{JumpTarget, Operator, Statement},
};

use super::{
    NftablesBackend, NftablesError,
    hooks::Hooks,
    host,
    listing::Listing,
    nft::{self, address_field, matches, meta, network, network_of, text},
    owner_comment,
    record::Record,
};
use crate::{
    backend::{BackendError, Endpoint, PortMappings, check_mapping_count, node_addresses},
    model::{
        ResolvedMapping,
        conditions::{Condition, Conditions, Subject},
    },
    netlink,
};

impl PortMappings for NftablesBackend {
    fn setup_port_mappings(
        &mut self,
        endpoint: &Endpoint,
        mappings: &[ResolvedMapping],
    ) -> Result<(), BackendError> {
        let hairpin = !mappings.is_empty() && !endpoint.host_ports.no_hairpin_snat;
        // Host processes reach a hostPort by 127.0.0.1 as with the reference portmap: the
        // interface towards the container must carry packets from 127.0.0.1 until they are
        // masqueraded (`route_localnet`), which needs `snat` as there.
        let localhost = hairpin
            && mappings.iter().any(|mapping| {
                mapping.is_ipv4() && mapping.host_addr.is_none_or(|addr| addr.is_loopback())
            });
        if localhost {
            let gateway = netlink::link_by_index(endpoint.gateway_ifindex).map_err(|source| {
                NftablesError::HostSetting {
                    action: format!("find interface {}", endpoint.gateway_ifindex),
                    source: std::io::Error::other(source.to_string()),
                }
            })?;
            if host::route_localnet_on(&gateway.name)? {
                self.localnet_interfaces.push(gateway.name);
            }
        }
        let access = &endpoint.host_ports;
        let of_family = |ipv4: bool| {
            if mappings.iter().any(|mapping| mapping.is_ipv4() == ipv4) {
                access.conditions(ipv4).clone()
            } else {
                Conditions::new()
            }
        };
        let (conditions_v4, conditions_v6) = (of_family(true), of_family(false));
        let change = self.attach(endpoint)?;
        if let Some(after) = change.after.as_mut() {
            after.mappings = mappings.to_vec();
            after.hairpin = hairpin;
            after.conditions_v4 = conditions_v4;
            after.conditions_v6 = conditions_v6;
        }
        Ok(())
    }

    fn teardown_port_mappings(&mut self, owner: u64) -> Result<(), BackendError> {
        if let Some(after) = self.change(owner).after.as_mut() {
            after.mappings.clear();
            after.hairpin = false;
            after.conditions_v4.clear();
            after.conditions_v6.clear();
        }
        Ok(())
    }

    fn check_port_mappings(
        &self,
        endpoint: &Endpoint,
        mappings: &[ResolvedMapping],
    ) -> Result<(), BackendError> {
        let listing = self.listing()?;
        let owner = owner_comment(&endpoint.attachment)?;
        let installed: Vec<ResolvedMapping> = listing
            .mappings()
            .into_iter()
            .filter(|(held_by, _)| *held_by == owner)
            .map(|(_, mapping)| mapping)
            .collect();
        for mapping in mappings {
            if !installed.contains(mapping) {
                return Err(BackendError::CheckFailed(format!(
                    "port mapping {mapping} is missing"
                )));
            }
        }
        check_mapping_count(installed.len(), mappings.len())?;
        if !mappings.is_empty() && !Hooks::of_listing(listing).localnet {
            return Err(BackendError::CheckFailed(format!(
                "the hostPorts of {} have no localnet guard (chain localnet_guard, localnet_new or localnet_local is missing)",
                endpoint.attachment
            )));
        }
        let wanted = [true, false].map(|ipv4| {
            if mappings.iter().any(|mapping| mapping.is_ipv4() == ipv4) {
                endpoint.host_ports.conditions(ipv4).clone()
            } else {
                Conditions::new()
            }
        });
        let installed = conditions_of(listing, endpoint.attachment.owner_id())?;
        if installed != wanted {
            return Err(BackendError::CheckFailed(format!(
                "the hostPort conditions of {} differ from its configuration",
                endpoint.attachment
            )));
        }
        Ok(())
    }

    /// Sets `node_addrs4`/`6`, which a wildcard hostPort takes, to the node's addresses.
    fn refresh_host_addresses(
        &mut self,
        service_interfaces: &[String],
    ) -> Result<(), BackendError> {
        let addresses = node_addresses(service_interfaces)?
            .into_iter()
            .map(|(_, addr)| addr)
            .collect();
        self.node_addresses = Some((service_interfaces.to_vec(), addresses));
        Ok(())
    }

    fn holder_of(
        &self,
        owner: u64,
        mapping: &ResolvedMapping,
    ) -> Result<Option<u64>, BackendError> {
        Ok(self
            .listing()?
            .holders_of(owner, mapping)
            .into_iter()
            .next()
            .map(|(holder, _)| holder))
    }
}

/// The rules of an attachment's conditions chain: for each condition of a family it has
/// hostPorts in, a packet that fails it returns before any DNAT (the chain is entered by
/// `goto`, so its return leaves the hostport chain too); one that passes them all goes on to
/// the DNAT. All conditions must hold, as with the reference portmap's one rule with all of
/// them. Host processes come in on no interface, so an interface condition never holds for
/// them, as with the reference.
pub fn condition_rules(chain: &str, record: &Record) -> Vec<NfListObject<'static>> {
    let mut rules = Vec::new();
    for ipv4 in [true, false] {
        for condition in record.conditions(ipv4) {
            rules.push(nft::rule(
                chain,
                vec![
                    matches(
                        meta(MetaKey::Nfproto),
                        Operator::EQ,
                        text(if ipv4 { "ipv4" } else { "ipv6" }),
                    ),
                    failing(ipv4, condition),
                    Statement::Return(None),
                ],
                None,
            ));
        }
    }
    rules.push(nft::rule(
        chain,
        vec![Statement::Goto(JumpTarget {
            target: "hostports_dnat".into(),
        })],
        None,
    ));
    rules
}

/// The match of packets that fail `condition`.
fn failing(ipv4: bool, condition: &Condition) -> Statement<'static> {
    let operator = if condition.negated {
        Operator::EQ
    } else {
        Operator::NEQ
    };
    // One network is matched as itself: an anonymous set is a set of the table, and nft
    // fetches every set's elements one request at a time.
    let set = |nets: &[ipnet::IpNet]| match nets {
        [net] => network(*net),
        nets => Expression::Named(NamedExpression::Set(
            nets.iter()
                .map(|net| SetItem::Element(network(*net)))
                .collect(),
        )),
    };
    match &condition.subject {
        Subject::Source(nets) => matches(address_field(ipv4, "saddr"), operator, set(nets)),
        Subject::Destination(nets) => matches(address_field(ipv4, "daddr"), operator, set(nets)),
        Subject::InInterface(name) => matches(meta(MetaKey::Iifname), operator, text(name)),
    }
}

/// The conditions of attachment `owner`'s chain `c_<owner>` as the kernel lists them (IPv4's,
/// IPv6's): each rule `condition_rules` wrote read back from its matches; a rule it did not
/// write is an error.
pub fn conditions_of(listing: &Listing, owner: u64) -> Result<[Conditions; 2], NftablesError> {
    let chain = super::conditions_chain(owner);
    let mut read = [Conditions::new(), Conditions::new()];
    for rule in listing.rules(&chain) {
        let unreadable = |reason: &str| NftablesError::Rule {
            chain: chain.clone(),
            reason: reason.to_owned(),
        };
        match &rule.expr[..] {
            [Statement::Goto(target)] if target.target == "hostports_dnat" => {}
            [
                Statement::Match(family),
                Statement::Match(failing),
                Statement::Return(_),
            ] => {
                let ipv4 = match &family.right {
                    Expression::String(name) if name == "ipv4" => true,
                    Expression::String(name) if name == "ipv6" => false,
                    _ => return Err(unreadable("a condition of no family")),
                };
                let condition = condition_of(failing)
                    .ok_or_else(|| unreadable("a condition cnibpf does not write"))?;
                read[usize::from(!ipv4)].push(condition);
            }
            _ => return Err(unreadable("a rule cnibpf does not write")),
        }
    }
    Ok(read)
}

/// The condition whose failing packets `failing` matches (see `failing`).
fn condition_of(failing: &nftables::stmt::Match<'_>) -> Option<Condition> {
    let negated = match failing.op {
        Operator::EQ | Operator::IN => true,
        Operator::NEQ => false,
        _ => return None,
    };
    let nets = || match &failing.right {
        Expression::Named(NamedExpression::Set(items)) => items
            .iter()
            .map(|item| match item {
                SetItem::Element(element) => network_of(element),
                _ => None,
            })
            .collect(),
        single => network_of(single).map(|net| vec![net]),
    };
    let subject = match &failing.left {
        Expression::Named(NamedExpression::Payload(nftables::expr::Payload::PayloadField(
            field,
        ))) => match field.field.as_ref() {
            "saddr" => Subject::Source(nets()?),
            "daddr" => Subject::Destination(nets()?),
            _ => return None,
        },
        Expression::Named(NamedExpression::Meta(meta)) if meta.key == MetaKey::Iifname => {
            match &failing.right {
                Expression::String(name) => Subject::InInterface(name.to_string()),
                _ => return None,
            }
        }
        _ => return None,
    };
    Some(Condition { negated, subject })
}
