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
    NftablesBackend, NftablesError, host,
    nft::{self, address_field, matches, meta, network, text},
    owner_comment,
    record::Record,
};
use crate::{
    backend::{BackendError, Endpoint, PortMappings, check_mapping_count},
    model::{
        HostPortAccess, ResolvedMapping,
        conditions::{Condition, Subject},
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
        let access = endpoint.host_ports.clone();
        let change = self.attach(endpoint)?;
        if let Some(after) = change.after.as_mut() {
            after.mappings = mappings.to_vec();
            after.hairpin = hairpin;
            after.conditioned_v4 =
                !access.conditions_v4.is_empty() && mappings.iter().any(ResolvedMapping::is_ipv4);
            after.conditioned_v6 = !access.conditions_v6.is_empty()
                && mappings.iter().any(|mapping| !mapping.is_ipv4());
        }
        change.access = Some(access);
        Ok(())
    }

    fn teardown_port_mappings(&mut self, owner: u64) -> Result<(), BackendError> {
        if let Some(after) = self.change(owner)?.after.as_mut() {
            after.mappings.clear();
            after.hairpin = false;
            after.conditioned_v4 = false;
            after.conditioned_v6 = false;
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
        let chain = super::conditions_chain(endpoint.attachment.owner_id());
        let conditioned = [true, false].into_iter().any(|ipv4| {
            !endpoint.host_ports.conditions(ipv4).is_empty()
                && mappings.iter().any(|mapping| mapping.is_ipv4() == ipv4)
        });
        if conditioned != listing.has_chain(&chain) {
            return Err(BackendError::CheckFailed(format!(
                "the hostPort conditions of {} differ from its configuration",
                endpoint.attachment
            )));
        }
        Ok(())
    }

    fn holder_of(
        &self,
        owner: u64,
        mapping: &ResolvedMapping,
    ) -> Result<Option<u64>, BackendError> {
        Ok(self
            .listing()?
            .holder_of(owner, mapping)?
            .map(|(holder, _, _)| holder))
    }
}

/// The rules of an attachment's conditions chain: for each condition of a family it has
/// hostPorts in, a packet that fails it returns before any DNAT (the chain is entered by
/// `goto`, so its return leaves the hostport chain too); one that passes them all goes on to
/// the DNAT. All conditions must hold, as with the reference portmap's one rule with all of
/// them. Host processes come in on no interface, so an interface condition never holds for
/// them, as with the reference.
pub fn condition_rules(
    chain: &str,
    record: &Record,
    access: &HostPortAccess,
) -> Vec<NfListObject<'static>> {
    let mut rules = Vec::new();
    for (ipv4, conditioned) in [
        (true, record.conditioned_v4),
        (false, record.conditioned_v6),
    ] {
        if !conditioned {
            continue;
        }
        for condition in access.conditions(ipv4) {
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
