//! What ADD and CHECK derive from the configuration, the previous result and the host before
//! taking the instance lock: the attachment's [`Plan`].

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde_json::Value;

use super::{Env, EnvError, error::Error, link, result::PrevResult};
use crate::{
    backend::Endpoint,
    config::{ConfigError, NetConf},
    instance::Plan,
    model::{
        Attachment, ExcludeReason, Filter, HostPortAccess, Masquerade, SourceCheck, Target,
        conditions::Subject, resolve_mappings,
    },
    netlink::{self, Link},
};

pub(super) fn plan(env: &Env, conf: &NetConf, prev_result: &Value) -> Result<Plan, Error> {
    let prev = PrevResult::parse(prev_result, &env.ifname)?;
    let attachment = Attachment::new(&conf.name, &env.container_id, &env.ifname);
    let mappings = resolve_mappings(&conf.port_mappings, &prev.container_addresses)?;
    let masquerade = masquerade_plan(conf, &prev)?;
    if conf.plugin.source_check {
        // Refused before anything is read in the container's namespace.
        source_check_plan(&prev, Vec::new())?;
    }
    let condition_interfaces = condition_interfaces(&conf.plugin.host_ports)?;
    let netns = existing_netns(env)?;
    let link = link::find_container_link(&prev, &netns, &env.ifname).map_err(EnvError::from)?;
    let uplinks = resolve_uplinks(conf)?;
    let cgroup = cgroup_of(conf)?;
    let (source_check, may_have_siblings) = if conf.plugin.source_check {
        let link_locals = link::container_link_locals(&netns, &env.ifname, link.container_mac)
            .map_err(EnvError::from)?;
        let siblings = link::has_other_veths(&netns, &env.ifname).map_err(EnvError::from)?;
        (Some(source_check_plan(&prev, link_locals)?), siblings)
    } else {
        (None, false)
    };
    // fail-closed: an Option of the interface; without a bridge the interface is the gateway.
    let gateway_ifindex = link.host.master.unwrap_or(link.host.index);
    let shaped = is_shaped(conf, &link.host)?;
    if (!mappings.is_empty() || conf.plugin.ip_masq) && uplinks.is_empty() {
        return Err(ConfigError::Invalid {
            key: "uplinks".to_owned(),
            reason: "port mappings and ipMasq need an uplink, and the host has no default route: name the uplinks"
                .to_owned(),
        }
        .into());
    }
    let filter = (!conf.plugin.filter.is_empty() || conf.plugin.filter_default == Target::Drop)
        .then(|| Filter {
            rules: conf.plugin.filter.clone(),
            default: conf.plugin.filter_default,
        });
    Ok(Plan {
        endpoint: Endpoint {
            attachment: attachment.clone(),
            host: link.host,
            uplinks,
            service_interfaces: conf.plugin.service_interfaces.clone(),
            container_mac: link.container_mac,
            gateway_mac: link.gateway_mac,
            gateway_v4: prev.gateways.iter().find_map(|gateway| match gateway {
                IpAddr::V4(gateway) => Some(*gateway),
                IpAddr::V6(_) => None,
            }),
            gateway_v6: prev.gateways.iter().find_map(|gateway| match gateway {
                IpAddr::V6(gateway) => Some(*gateway),
                IpAddr::V4(_) => None,
            }),
            cgroup,
            container_networks: prev.container_addresses.clone(),
            pod: env.args.pod.clone(),
            shaped,
            host_firewall: conf.plugin.host_firewall,
            filtered: filter.is_some(),
            host_ports_mapped: !mappings.is_empty(),
            may_have_siblings,
            masqueraded: masquerade.is_some(),
            gateway_ifindex,
            host_ports: conf.plugin.host_ports.clone(),
            condition_interfaces,
        },
        attachment,
        mappings,
        masquerade,
        filter,
        source_check,
    })
}

/// CNI_NETNS, which must be there.
fn existing_netns(env: &Env) -> Result<std::path::PathBuf, Error> {
    let netns = env.netns.clone().ok_or(EnvError::Missing("CNI_NETNS"))?;
    match netns.try_exists() {
        Ok(true) => Ok(netns),
        Ok(false) => Err(EnvError::Netns(netns.display().to_string()).into()),
        Err(source) => Err(EnvError::NetnsUnreadable {
            path: netns.display().to_string(),
            source,
        }
        .into()),
    }
}

/// The cgroup v2 directory the host-socket hooks attach to: `cgroupPath`, else the mounted
/// hierarchy's root.
fn cgroup_of(conf: &NetConf) -> Result<std::path::PathBuf, Error> {
    let invalid = |reason: String| ConfigError::Invalid {
        key: "cgroupPath".to_owned(),
        reason,
    };
    let cgroup = match &conf.plugin.cgroup_path {
        Some(path) => path.clone(),
        None => crate::paths::cgroup2_root()
            .map_err(EnvError::Mounts)?
            .ok_or_else(|| {
                invalid(
                    "no cgroup v2 hierarchy is mounted: mount one or name a cgroupPath".to_owned(),
                )
            })?,
    };
    if !cgroup.is_dir() {
        return Err(invalid(format!("{} is not a directory", cgroup.display())).into());
    }
    Ok(cgroup)
}

/// Whether the container's traffic is shaped on its host-side veth: by the `bandwidth`
/// plugin chained before cnibpf (its qdiscs are there), or as asked in runtimeConfig (chained
/// after it, when cnibpf declares the capability too).
fn is_shaped(conf: &NetConf, host: &Link) -> Result<bool, Error> {
    if conf.shaped {
        return Ok(true);
    }
    let qdiscs = netlink::added_qdiscs(host.index)
        .map_err(|error| Error::from(EnvError::HostInterface(error.into())))?;
    Ok(!qdiscs.is_empty())
}

/// The addresses the container may send from: prevResult's for CNI_IFNAME and its interface's
/// IPv6 link-local ones, at most as many of a family as the datapath checks.
fn source_check_plan(
    prev: &PrevResult,
    link_locals: Vec<Ipv6Addr>,
) -> Result<SourceCheck, ConfigError> {
    let check = SourceCheck::new(
        prev.container_addresses
            .iter()
            .map(IpNet::addr)
            .chain(link_locals.into_iter().map(IpAddr::V6)),
    );
    for (family, is_family) in [
        ("IPv4", IpAddr::is_ipv4 as fn(&IpAddr) -> bool),
        ("IPv6", IpAddr::is_ipv6),
    ] {
        let count = check
            .addresses
            .iter()
            .filter(|address| is_family(address))
            .count();
        if count > cnibpf_common::sources::MAX_ADDRESSES {
            return Err(ConfigError::Invalid {
                key: "sourceCheck".to_owned(),
                reason: format!(
                    "the container has {count} {family} addresses ({check}), and at most {} of a family are checked: set sourceCheck to false for it",
                    cnibpf_common::sources::MAX_ADDRESSES
                ),
            });
        }
    }
    Ok(check)
}

/// The indexes of the interfaces hostPort conditions name; one that does not exist is an error
/// (103): its index could not be matched, and a negated condition would open the port to it.
fn condition_interfaces(access: &HostPortAccess) -> Result<Vec<(String, u32)>, Error> {
    let mut interfaces: Vec<(String, u32)> = Vec::new();
    for condition in access.conditions_v4.iter().chain(&access.conditions_v6) {
        if let Subject::InInterface(name) = &condition.subject
            && !interfaces.iter().any(|(known, _)| known == name)
        {
            interfaces.push((name.clone(), netlink::link_by_name(name)?.index));
        }
    }
    Ok(interfaces)
}

/// The masquerade `ipMasq` asks for: the container's addresses, never towards their own
/// subnets, multicast or `ipMasqExclude`.
fn masquerade_plan(conf: &NetConf, prev: &PrevResult) -> Result<Option<Masquerade>, ConfigError> {
    if !conf.plugin.ip_masq {
        return Ok(None);
    }
    if prev.container_addresses.is_empty() {
        return Err(ConfigError::Invalid {
            key: "ipMasq".to_owned(),
            reason: "needs the container's addresses, and prevResult has none for CNI_IFNAME"
                .to_owned(),
        });
    }
    let multicast: [IpNet; 2] = [
        IpNet::V4(Ipv4Net::new_assert(Ipv4Addr::new(224, 0, 0, 0), 4)),
        IpNet::V6(Ipv6Net::new_assert(
            Ipv6Addr::new(0xff00, 0, 0, 0, 0, 0, 0, 0),
            8,
        )),
    ];
    let mut excludes: Vec<(IpNet, ExcludeReason)> = Vec::new();
    let candidates = prev
        .container_addresses
        .iter()
        .map(|net| (net.trunc(), ExcludeReason::OwnSubnet))
        .chain(multicast.map(|net| (net, ExcludeReason::Multicast)))
        .chain(
            conf.plugin
                .ip_masq_exclude
                .iter()
                .map(|net| (net.trunc(), ExcludeReason::Configured)),
        );
    for (net, reason) in candidates {
        if !excludes.iter().any(|(held, _)| *held == net) {
            excludes.push((net, reason));
        }
    }
    Ok(Some(Masquerade {
        sources: prev.container_addresses.iter().map(IpNet::addr).collect(),
        excludes,
    }))
}

/// The configured uplinks, or the devices of the default routes.
fn resolve_uplinks(conf: &NetConf) -> Result<Vec<Link>, Error> {
    match &conf.plugin.uplinks {
        Some(names) => names
            .iter()
            .map(|name| netlink::link_by_name(name).map_err(Error::from))
            .collect(),
        None => netlink::default_route_links()?
            .into_iter()
            .map(|index| netlink::link_by_index(index).map_err(Error::from))
            .collect(),
    }
}
