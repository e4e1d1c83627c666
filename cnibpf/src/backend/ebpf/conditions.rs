//! `port_conditions`: an attachment's hostPort conditions as the datapath evaluates them.

use cnibpf_common::{
    FAMILY_IPV4, FAMILY_IPV6, addr,
    portmap::{
        self, ConditionTerm, PortConditions, PortConditionsKey,
        conditions::{KIND_DESTINATION, KIND_IN_INTERFACE, KIND_SOURCE, MAX_TERMS},
    },
};
use ipnet::IpNet;

use super::{EbpfBackend, found, map_error, remove_entry};
use crate::{
    backend::{BackendError, Endpoint},
    model::conditions::{Condition, Subject},
};

impl EbpfBackend {
    /// Makes the attachment's `port_conditions` entries those of `endpoint` (none for a family
    /// without conditions).
    pub(super) fn write_port_conditions(
        &mut self,
        endpoint: &Endpoint,
    ) -> Result<(), BackendError> {
        let owner = endpoint.attachment.owner_id();
        // A new attachment has no entry to remove or compare.
        let new = self.is_new(owner);
        for ipv4 in [true, false] {
            let key = conditions_key(owner, ipv4);
            let conditions = endpoint.host_ports.conditions(ipv4);
            if conditions.is_empty() {
                if new {
                    continue;
                }
                remove_entry(
                    self.port_mapping.port_conditions.open_mut()?,
                    &key,
                    portmap::CONDITIONS.name,
                )?;
                continue;
            }
            let value = encode(conditions, &endpoint.condition_interfaces);
            if new
                || found(
                    self.port_mapping.port_conditions.open()?.get(&key, 0),
                    portmap::CONDITIONS.name,
                )? != Some(value)
            {
                self.port_mapping
                    .port_conditions
                    .open_mut()?
                    .insert(&key, &value, 0)
                    .map_err(map_error("could not write map port_conditions"))?;
            }
        }
        Ok(())
    }

    pub(super) fn remove_port_conditions(&mut self, owner: u64) -> Result<(), BackendError> {
        for ipv4 in [true, false] {
            remove_entry(
                self.port_mapping.port_conditions.open_mut()?,
                &conditions_key(owner, ipv4),
                portmap::CONDITIONS.name,
            )?;
        }
        Ok(())
    }

    /// CHECK: the entries are what `endpoint` needs.
    pub(super) fn check_port_conditions(&self, endpoint: &Endpoint) -> Result<(), BackendError> {
        let owner = endpoint.attachment.owner_id();
        for ipv4 in [true, false] {
            let conditions = endpoint.host_ports.conditions(ipv4);
            let wanted = (!conditions.is_empty())
                .then(|| encode(conditions, &endpoint.condition_interfaces));
            let key = conditions_key(owner, ipv4);
            if found(
                self.port_mapping.port_conditions.open()?.get(&key, 0),
                portmap::CONDITIONS.name,
            )? != wanted
            {
                return Err(BackendError::CheckFailed(format!(
                    "the IPv{} hostPort conditions of {} are missing or differ",
                    if ipv4 { 4 } else { 6 },
                    endpoint.attachment
                )));
            }
        }
        Ok(())
    }
}

fn conditions_key(owner: u64, ipv4: bool) -> PortConditionsKey {
    PortConditionsKey {
        owner,
        family: if ipv4 { FAMILY_IPV4 } else { FAMILY_IPV6 },
        _pad: 0,
        _pad2: 0,
        _pad3: 0,
    }
}

/// Terms grouped by clause, one clause per condition (configuration checked their number).
fn encode(conditions: &[Condition], interfaces: &[(String, u32)]) -> PortConditions {
    let mut value = PortConditions::default();
    let mut terms = Vec::new();
    for (clause, condition) in (0u8..).zip(conditions) {
        if condition.negated {
            value.negated |= 1 << clause;
        }
        let net_term = |kind: u8, net: &IpNet| ConditionTerm {
            addr: addr::to_address(net.trunc().addr()),
            mask: addr::to_address(net.netmask()),
            ifindex: 0,
            kind,
            clause,
            _pad: 0,
        };
        match &condition.subject {
            Subject::Source(nets) => {
                terms.extend(nets.iter().map(|net| net_term(KIND_SOURCE, net)))
            }
            Subject::Destination(nets) => {
                terms.extend(nets.iter().map(|net| net_term(KIND_DESTINATION, net)));
            }
            Subject::InInterface(name) => terms.push(ConditionTerm {
                ifindex: interfaces
                    .iter()
                    .find(|(known, _)| known == name)
                    // fail-closed: the plan resolved every named interface (0 matches none).
                    .map_or(0, |(_, index)| *index),
                kind: KIND_IN_INTERFACE,
                clause,
                ..ConditionTerm::default()
            }),
        }
        value.clause_count = clause + 1;
    }
    for (slot, term) in value.terms.iter_mut().zip(terms.iter().take(MAX_TERMS)) {
        *slot = *term;
    }
    // fail-closed: no kernel result; MAX_TERMS fits a u8.
    value.term_count = u8::try_from(terms.len().min(MAX_TERMS)).unwrap_or(u8::MAX);
    value
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::conditions::parse;

    #[test]
    fn clauses_and_negation() {
        let words: Vec<String> = ["-s", "192.0.2.0/24,198.51.100.1", "!", "-i", "eth0"]
            .iter()
            .map(|word| (*word).to_owned())
            .collect();
        let conditions = parse("conditionsV4", &words, true).expect("valid");
        let value = encode(&conditions, &[("eth0".to_owned(), 7)]);
        assert_eq!(value.term_count, 3);
        assert_eq!(value.clause_count, 2);
        assert_eq!(value.negated, 0b10);
        assert_eq!(value.terms[0].kind, KIND_SOURCE);
        assert_eq!(&value.terms[0].addr.bytes[..4], &[192, 0, 2, 0]);
        assert_eq!(&value.terms[0].mask.bytes[..4], &[255, 255, 255, 0]);
        assert_eq!(value.terms[1].clause, 0);
        assert_eq!(&value.terms[1].mask.bytes[..4], &[255, 255, 255, 255]);
        assert_eq!(value.terms[2].kind, KIND_IN_INTERFACE);
        assert_eq!(value.terms[2].ifindex, 7);
        assert_eq!(value.terms[2].clause, 1);
    }
}
