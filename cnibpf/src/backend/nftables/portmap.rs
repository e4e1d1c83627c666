//! Port mappings: the hostport maps (DNAT by exact host address, then by port for any local
//! address), the hairpin set, and the condition rules at the head of chain `hostports`.

use std::{
    net::IpAddr,
    process::{Command, Stdio},
};

use ipnet::IpNet;

use super::{
    Element, NftablesBackend, PORT_MAPPING_SETS, TABLE, family_suffix, owner_comment, parse_owner,
};
use crate::{
    backend::{BackendError, Endpoint, PortMappings, check_mapping_count},
    model::{
        HostPortAccess, ResolvedMapping,
        conditions::{Condition, Subject},
    },
};

impl NftablesBackend {
    /// Deletes the attachment's hostPort condition rules (in chain `hostports`).
    fn delete_condition_rules(&mut self, owner: &str) {
        let doomed: Vec<u64> = self
            .rules
            .iter()
            .filter(|rule| rule.chain == "hostports" && rule.comment == owner)
            .map(|rule| rule.handle)
            .collect();
        for handle in doomed {
            self.script
                .push(format!("delete rule {TABLE} hostports handle {handle}"));
        }
        self.rules
            .retain(|rule| !(rule.chain == "hostports" && rule.comment == owner));
    }

    fn owned_mappings(&self, owner: &str) -> Vec<ResolvedMapping> {
        self.elements
            .iter()
            .filter(|element| element.comment == owner)
            .filter_map(mapping_of)
            .collect()
    }
}

impl PortMappings for NftablesBackend {
    fn setup_port_mappings(
        &mut self,
        endpoint: &Endpoint,
        mappings: &[ResolvedMapping],
    ) -> Result<(), BackendError> {
        let owner = owner_comment(&endpoint.attachment)?;
        self.ensure_table();
        let previous = self.owned_mappings(&owner);
        self.delete_elements(&owner, &PORT_MAPPING_SETS);
        self.delete_condition_rules(&owner);
        for mapping in mappings {
            let (map, key, value) = mapping_element(mapping);
            self.add_element(map, key, Some(value), &owner);
        }
        for rule in condition_rules(mappings, &endpoint.host_ports) {
            self.script.push(format!(
                "insert rule {TABLE} hostports {rule} comment \"{owner}\""
            ));
        }
        if !mappings.is_empty() && !endpoint.host_ports.no_hairpin_snat {
            for subnet in &endpoint.container_networks {
                let set = format!("hairpin{}", family_suffix(subnet.addr()));
                self.add_element(
                    &set,
                    format!("{} . {}", subnet.trunc(), subnet.addr()),
                    None,
                    &owner,
                );
            }
        }
        // Connections of a mapping that is gone or leads elsewhere must not keep going to the
        // old container, nor those a new hostPort met untranslated stay so (the reference
        // portmap's UDP bug): the kernel matches them before any DNAT.
        let changed: Vec<ResolvedMapping> = previous
            .iter()
            .filter(|mapping| !mappings.contains(mapping))
            .chain(
                mappings
                    .iter()
                    .filter(|mapping| !previous.contains(mapping)),
            )
            .copied()
            .collect();
        self.forget.extend(changed);
        Ok(())
    }

    fn teardown_port_mappings(&mut self, owner: u64) -> Result<(), BackendError> {
        let Some(text) = self.owner_text(owner) else {
            return Ok(());
        };
        let owned = self.owned_mappings(&text);
        self.forget.extend(owned);
        self.delete_elements(&text, &PORT_MAPPING_SETS);
        self.delete_condition_rules(&text);
        Ok(())
    }

    fn check_port_mappings(
        &self,
        endpoint: &Endpoint,
        mappings: &[ResolvedMapping],
    ) -> Result<(), BackendError> {
        let owner = owner_comment(&endpoint.attachment)?;
        let installed = self.owned_mappings(&owner);
        for mapping in mappings {
            if !installed.contains(mapping) {
                return Err(BackendError::CheckFailed(format!(
                    "port mapping {} is missing",
                    mapping
                )));
            }
        }
        check_mapping_count(installed.len(), mappings.len())?;
        let wanted = condition_rules(mappings, &endpoint.host_ports).len();
        let present = self
            .rules
            .iter()
            .filter(|rule| rule.chain == "hostports" && rule.comment == owner)
            .count();
        if wanted != present {
            return Err(BackendError::CheckFailed(format!(
                "{present} hostPort condition rules of {} installed, {wanted} configured",
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
        let held = self.elements.iter().find_map(|element| {
            let installed = mapping_of(element)?;
            let holder = parse_owner(&element.comment)?.owner_id();
            (holder != owner && installed.overlaps(mapping)).then_some(holder)
        });
        Ok(held)
    }
}

/// The hostPort element of a mapping: (map, key, value).
fn mapping_element(mapping: &ResolvedMapping) -> (&'static str, String, String) {
    let protocol = mapping.protocol.as_str();
    let (map, key) = match (mapping.host_addr, mapping.is_ipv4()) {
        (Some(addr), true) => (
            "hostports4",
            format!("{addr} . {protocol} . {}", mapping.host_port),
        ),
        (None, true) => (
            "hostports4_any",
            format!("{protocol} . {}", mapping.host_port),
        ),
        (Some(addr), false) => (
            "hostports6",
            format!("{addr} . {protocol} . {}", mapping.host_port),
        ),
        (None, false) => (
            "hostports6_any",
            format!("{protocol} . {}", mapping.host_port),
        ),
    };
    (
        map,
        key,
        format!("{} . {}", mapping.container_addr, mapping.container_port),
    )
}

pub(super) fn mapping_of(element: &Element) -> Option<ResolvedMapping> {
    let (host_addr, rest) = match element.set.as_str() {
        "hostports4" | "hostports6" => (
            Some(element.key_parts.first()?.parse::<IpAddr>().ok()?),
            &element.key_parts[1..],
        ),
        "hostports4_any" | "hostports6_any" => (None, &element.key_parts[..]),
        _ => return None,
    };
    Some(ResolvedMapping {
        protocol: rest.first()?.parse().ok()?,
        host_addr,
        host_port: rest.get(1)?.parse().ok()?,
        container_addr: element.value_parts.first()?.parse().ok()?,
        container_port: element.value_parts.get(1)?.parse().ok()?,
    })
}

/// The rules that keep clients out of an attachment's hostPorts, at the head of chain
/// `hostports`: for each condition, a packet to one of the attachment's hostPorts of that
/// family that fails it returns before any DNAT (all conditions must hold, as the reference
/// portmap's one rule with all of them). Host processes come in on no interface, so an
/// interface condition never holds for them, as with the reference.
fn condition_rules(mappings: &[ResolvedMapping], access: &HostPortAccess) -> Vec<String> {
    let mut rules = Vec::new();
    for ipv4 in [true, false] {
        let conditions = access.conditions(ipv4);
        let family: Vec<&ResolvedMapping> = mappings
            .iter()
            .filter(|mapping| mapping.is_ipv4() == ipv4)
            .collect();
        if conditions.is_empty() || family.is_empty() {
            continue;
        }
        let ip = if ipv4 { "ip" } else { "ip6" };
        let wildcard: Vec<String> = family
            .iter()
            .filter(|mapping| mapping.host_addr.is_none())
            .map(|mapping| format!("{} . {}", mapping.protocol, mapping.host_port))
            .collect();
        let specific: Vec<String> = family
            .iter()
            .filter_map(|mapping| {
                let addr = mapping.host_addr?;
                Some(format!(
                    "{addr} . {} . {}",
                    mapping.protocol, mapping.host_port
                ))
            })
            .collect();
        let mut selectors = Vec::new();
        if !wildcard.is_empty() {
            selectors.push(format!(
                "fib daddr type local meta l4proto . th dport {{ {} }}",
                wildcard.join(", ")
            ));
        }
        if !specific.is_empty() {
            selectors.push(format!(
                "{ip} daddr . meta l4proto . th dport {{ {} }}",
                specific.join(", ")
            ));
        }
        for condition in conditions {
            let failing = failing_condition(ip, condition);
            for selector in &selectors {
                rules.push(format!("{selector} {failing} return"));
            }
        }
    }
    rules
}

/// The nft match of packets that fail `condition`.
fn failing_condition(ip: &str, condition: &Condition) -> String {
    let operator = if condition.negated { "" } else { "!= " };
    let nets = |nets: &[IpNet]| {
        nets.iter()
            .map(|net| net.trunc().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match &condition.subject {
        Subject::Source(list) => format!("{ip} saddr {operator}{{ {} }}", nets(list)),
        Subject::Destination(list) => format!("{ip} daddr {operator}{{ {} }}", nets(list)),
        Subject::InInterface(name) => format!("iifname {operator}\"{name}\""),
    }
}

/// Removes the kernel's connection tracking entries towards `mapping`'s hostPort (on its
/// hostIP, or any address), so that the next packet meets the mappings as they are now
/// (`conntrack -D`; best effort: without the tool such entries age out by themselves).
pub(super) fn forget_connections(mapping: &ResolvedMapping) {
    let family = if mapping.is_ipv4() { "ipv4" } else { "ipv6" };
    let mut command = Command::new("conntrack");
    command
        .args(["-D", "-f", family, "-p", mapping.protocol.as_str()])
        .args(["--orig-port-dst", &mapping.host_port.to_string()]);
    if let Some(addr) = mapping.host_addr {
        command.args(["--orig-dst", &addr.to_string()]);
    }
    let _ = command.stdout(Stdio::null()).stderr(Stdio::null()).status();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;

    fn element(set: &str, key: &str, value: &str) -> Element {
        Element {
            set: set.to_owned(),
            key: key.to_owned(),
            key_parts: key.split(" . ").map(str::to_owned).collect(),
            value_parts: value.split(" . ").map(str::to_owned).collect(),
            comment: "n/eth0/c".to_owned(),
        }
    }

    #[test]
    fn mappings_read_back_from_their_elements() {
        for (host_addr, container_addr) in [
            (None, "10.22.0.2"),
            (Some("203.0.113.1"), "10.22.0.2"),
            (None, "fd00::2"),
            (Some("2001:db8::1"), "fd00::2"),
        ] {
            let mapping = ResolvedMapping {
                protocol: Protocol::Udp,
                host_addr: host_addr.map(|addr| addr.parse().expect("literal")),
                host_port: 5353,
                container_addr: container_addr.parse().expect("literal"),
                container_port: 53,
            };
            let (set, key, value) = mapping_element(&mapping);
            assert_eq!(
                mapping_of(&element(set, &key, &value)),
                Some(mapping),
                "{mapping}"
            );
        }
        assert_eq!(
            mapping_of(&element("hairpin4", "10.22.0.0/16 . 10.22.0.2", "")),
            None
        );
    }

    #[test]
    fn each_condition_returns_failing_packets_before_any_dnat() {
        let mapping = |host_addr: Option<&str>| ResolvedMapping {
            protocol: Protocol::Tcp,
            host_addr: host_addr.map(|addr| addr.parse().expect("literal")),
            host_port: 8080,
            container_addr: "10.22.0.2".parse().expect("literal"),
            container_port: 80,
        };
        let access = HostPortAccess {
            conditions_v4: vec![
                Condition {
                    negated: false,
                    subject: Subject::Source(vec!["192.0.2.0/24".parse().expect("literal")]),
                },
                Condition {
                    negated: true,
                    subject: Subject::InInterface("eth9".to_owned()),
                },
            ],
            ..HostPortAccess::default()
        };
        let rules = condition_rules(&[mapping(None), mapping(Some("203.0.113.1"))], &access);
        assert_eq!(
            rules,
            [
                "fib daddr type local meta l4proto . th dport { tcp . 8080 } ip saddr != { 192.0.2.0/24 } return",
                "ip daddr . meta l4proto . th dport { 203.0.113.1 . tcp . 8080 } ip saddr != { 192.0.2.0/24 } return",
                "fib daddr type local meta l4proto . th dport { tcp . 8080 } iifname \"eth9\" return",
                "ip daddr . meta l4proto . th dport { 203.0.113.1 . tcp . 8080 } iifname \"eth9\" return",
            ]
        );
        // No IPv6 conditions: nothing for IPv6 mappings.
        assert!(condition_rules(&[mapping(None)], &HostPortAccess::default()).is_empty());
    }
}
