//! The CNI protocol: environment, verbs, results and errors on stdout.

pub mod args;
mod delegate;
pub mod error;
mod link;
mod release;
pub mod result;

use std::{
    collections::BTreeSet,
    io::Read as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::PathBuf,
    time::Instant,
};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde_json::{Value, json};

use crate::{
    backend::{self, Access, BackendError, Endpoint},
    call_log, call_stats,
    config::{
        CleanupConf, CniVersion, ConfigError, NetConf, Recording, ReleaseOnly, SUPPORTED_VERSIONS,
        ifname_problem,
    },
    journal,
    lock::{InstanceLock, lock_timeout},
    model::{
        Attachment, ExcludeReason, Filter, HostPortAccess, Masquerade, ResolvedMapping,
        SourceCheck, Target, conditions::Subject, resolve_mappings,
    },
    netlink::{self, Link},
    output::log_line,
    paths::PinLayout,
    phases,
};
use args::{ArgsError, CniArgs};
use error::Error;
use link::HostInterfaceError;
use result::PrevResult;

#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    #[error("{0} is not set")]
    Missing(&'static str),
    #[error("unknown CNI_COMMAND {0:?}; expected ADD, DEL, CHECK, GC, STATUS or VERSION")]
    UnknownCommand(String),
    #[error(
        "CNI_CONTAINERID {0:?} is invalid: use letters, digits, '_', '.', '-', starting with a letter or digit"
    )]
    ContainerId(String),
    #[error("CNI_IFNAME {name:?} {problem}")]
    Ifname { name: String, problem: &'static str },
    #[error("CNI_NETNS {0:?} does not exist")]
    Netns(String),
    #[error("could not read the host's mounts (for the cgroup v2 hierarchy)")]
    Mounts(#[source] std::io::Error),
    #[error("CNI_NETNS {path:?} cannot be looked at")]
    NetnsUnreadable {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    HostInterface(#[from] HostInterfaceError),
    #[error(transparent)]
    Args(#[from] ArgsError),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    Gc,
    Status,
    Version,
}

impl Command {
    fn parse(text: &str) -> Result<Self, EnvError> {
        Ok(match text {
            "ADD" => Self::Add,
            "DEL" => Self::Del,
            "CHECK" => Self::Check,
            "GC" => Self::Gc,
            "STATUS" => Self::Status,
            "VERSION" => Self::Version,
            other => return Err(EnvError::UnknownCommand(other.to_owned())),
        })
    }
}

/// The CNI_* variables one invocation needs.
#[derive(Clone, Debug)]
struct Env {
    container_id: String,
    ifname: String,
    netns: Option<PathBuf>,
    args: CniArgs,
}

impl Env {
    /// Reads and validates the variables `command` requires, as libcni's skel does.
    fn read(command: Command) -> Result<Self, EnvError> {
        // fail-closed: a variable that is not set or not text is reported missing below.
        let var = |name: &'static str| std::env::var(name).ok().filter(|value| !value.is_empty());
        let needs_attachment = matches!(command, Command::Add | Command::Del | Command::Check);
        let container_id = var("CNI_CONTAINERID");
        let ifname = var("CNI_IFNAME");
        let netns = var("CNI_NETNS");
        if needs_attachment {
            let container_id = container_id
                .clone()
                .ok_or(EnvError::Missing("CNI_CONTAINERID"))?;
            let valid_id = container_id.len() < cnibpf_common::owner::NAME_LEN
                && container_id.starts_with(|c: char| c.is_ascii_alphanumeric())
                && container_id
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
            if !valid_id {
                return Err(EnvError::ContainerId(container_id));
            }
            let ifname = ifname.clone().ok_or(EnvError::Missing("CNI_IFNAME"))?;
            if let Some(problem) = ifname_problem(&ifname) {
                return Err(EnvError::Ifname {
                    name: ifname,
                    problem,
                });
            }
            if command != Command::Del && netns.is_none() {
                return Err(EnvError::Missing("CNI_NETNS"));
            }
        }
        if command != Command::Version && var("CNI_PATH").is_none() {
            return Err(EnvError::Missing("CNI_PATH"));
        }
        // ADD and CHECK use them (to name the pod) and refuse bad ones; DEL reads them only
        // for its log line: it must not fail on arguments the ADD would have refused already.
        // fail-closed: no CNI_ARGS is no arguments.
        let text = var("CNI_ARGS").unwrap_or_default();
        let args = match command {
            Command::Add | Command::Check => CniArgs::parse(&text)?,
            // fail-closed: naming only; a DEL goes on whatever its arguments are.
            Command::Del => CniArgs::parse(&text).unwrap_or_default(),
            _ => CniArgs::default(),
        };
        Ok(Self {
            // fail-closed: required (checked above) by the verbs that use them.
            container_id: container_id.unwrap_or_default(),
            // fail-closed: as above.
            ifname: ifname.unwrap_or_default(),
            netns: netns.map(PathBuf::from),
            args,
        })
    }
}

/// Runs one CNI invocation; returns the process exit code.
pub fn run(command_text: &str) -> i32 {
    let started = Instant::now();
    phases::begin();
    // The configuration is read whatever the command: a runtime writing it to a plugin that
    // quit early would get EPIPE instead of the error this plugin prints.
    let mut stdin = Vec::new();
    let outcome = std::io::stdin()
        .read_to_end(&mut stdin)
        .map_err(Error::Stdin)
        .and_then(|_| Command::parse(command_text).map_err(Error::from))
        .and_then(|command| dispatch(command, &stdin));
    // A result the runtime cannot read is a failed call: it answers with an error instead.
    let outcome = outcome.and_then(|output| match output {
        Some(output) => answer(&output).map_err(Error::Output),
        None => Ok(()),
    });
    phases::mark("answer");
    let Err(error) = outcome else {
        record(command_text, &stdin, 0, None, started);
        phases::report(command_text);
        return 0;
    };
    let cni_error = error.into_cni(&CniVersion::answer_version(&stdin));
    let message = if cni_error.details.is_empty() {
        cni_error.msg.clone()
    } else {
        format!("{}: {}", cni_error.msg, cni_error.details)
    };
    log_line!("cnibpf: {command_text}: {message}");
    let json = serde_json::json!(cni_error).to_string();
    // fail-closed: the call fails either way (exit 1); the error is on stderr too.
    let _ = answer(&json);
    record(
        command_text,
        &stdin,
        cni_error.code,
        Some(&message),
        started,
    );
    phases::report(command_text);
    1
}

/// Counts the call in its instance's call statistics and writes its line to the call log.
/// Neither can fail the call: a failure is said on stderr.
fn record(verb: &str, stdin: &[u8], code: u32, message: Option<&str>, started: Instant) {
    let recording = Recording::of_stdin(stdin);
    let noted = journal::noted();
    let duration = started.elapsed();
    let reclaimed = noted.reclaimed.len() as u64;
    let stats = PinLayout::new(&recording.pin_path).call_stats_file();
    // An instance this call removed whole keeps no statistics file.
    if noted.uninstalled.is_empty()
        && let Err(error) = call_stats::record(&stats, verb, code, duration, reclaimed)
    {
        log_line!("cnibpf: {verb}: the call is not counted: {error}");
    }
    let logged = call_log::write(
        &recording.log,
        &call_log::CallRecord {
            verb,
            code,
            message,
            duration,
            noted: &noted,
        },
    );
    if let Err(error) = logged {
        log_line!("cnibpf: {verb}: the call is not logged: {error}");
    }
    phases::mark("record");
}

/// The answer on stdout (see `output`).
fn answer(text: &str) -> std::io::Result<()> {
    crate::output::write_line(std::io::stdout(), text)
}

fn dispatch(command: Command, stdin: &[u8]) -> Result<Option<String>, Error> {
    if command == Command::Version {
        return Ok(Some(version_output(stdin)));
    }
    let env = Env::read(command)?;
    if !env.container_id.is_empty() {
        journal::container(&env.container_id, &env.ifname);
    }
    if let Some(pod) = &env.args.pod {
        journal::pod(&pod.to_string());
    }
    if let Some(release) = ReleaseOnly::of_stdin(stdin) {
        return release::dispatch(command, &env, stdin, &release);
    }
    match command {
        Command::Add => add(&env, stdin).map(Some),
        Command::Del => del(&env, stdin)
            .and_then(|()| release::if_uninstalled(&env, stdin, command))
            .map(|()| None),
        Command::Check => check(&env, stdin).map(|()| None),
        Command::Gc => gc(stdin)
            .and_then(|()| release::if_uninstalled(&env, stdin, command))
            .map(|()| None),
        Command::Status => status(stdin).map(|()| None),
        Command::Version => unreachable!("handled above"),
    }
}

fn version_output(stdin: &[u8]) -> String {
    json!({ "cniVersion": CniVersion::answer_version(stdin), "supportedVersions": SUPPORTED_VERSIONS })
        .to_string()
}

/// Everything ADD and CHECK derive from the config and the host before taking the lock.
struct Plan {
    attachment: Attachment,
    endpoint: Endpoint,
    mappings: Vec<ResolvedMapping>,
    masquerade: Option<Masquerade>,
    /// `None`: the attachment is not filtered (no rules, default ALLOW).
    filter: Option<Filter>,
    /// `None`: `sourceCheck: false`.
    source_check: Option<SourceCheck>,
}

fn plan(env: &Env, conf: &NetConf, prev_result: &Value) -> Result<Plan, Error> {
    let prev = PrevResult::parse(prev_result, &env.ifname)?;
    let attachment = Attachment::new(&conf.name, &env.container_id, &env.ifname);
    let mappings = resolve_mappings(&conf.port_mappings, &prev.container_addresses)?;
    let masquerade = masquerade_plan(conf, &prev)?;
    if conf.plugin.source_check {
        // Refused before anything is read in the container's namespace.
        source_check_plan(&prev, Vec::new())?;
    }
    let condition_interfaces = condition_interfaces(&conf.plugin.host_ports)?;
    let netns = env.netns.clone().ok_or(EnvError::Missing("CNI_NETNS"))?;
    match netns.try_exists() {
        Ok(true) => {}
        Ok(false) => return Err(EnvError::Netns(netns.display().to_string()).into()),
        Err(source) => {
            return Err(EnvError::NetnsUnreadable {
                path: netns.display().to_string(),
                source,
            }
            .into());
        }
    }
    let link = link::find_container_link(&prev, &netns, &env.ifname).map_err(EnvError::from)?;
    let uplinks = resolve_uplinks(conf)?;
    let cgroup = match &conf.plugin.cgroup_path {
        Some(path) => path.clone(),
        None => crate::paths::cgroup2_root()
            .map_err(EnvError::Mounts)?
            .ok_or_else(|| ConfigError::Invalid {
                key: "cgroupPath".to_owned(),
                reason: "no cgroup v2 hierarchy is mounted: mount one or name a cgroupPath"
                    .to_owned(),
            })?,
    };
    if !cgroup.is_dir() {
        return Err(ConfigError::Invalid {
            key: "cgroupPath".to_owned(),
            reason: format!("{} is not a directory", cgroup.display()),
        }
        .into());
    }
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
    // Shaping on the host-side veth (the `bandwidth` plugin chained before cnibpf), or asked
    // for in runtimeConfig (chained after it, when cnibpf declares the capability too).
    let shaped = conf.shaped
        || !netlink::added_qdiscs(link.host.index)
            .map_err(|error| Error::from(EnvError::HostInterface(error.into())))?
            .is_empty();
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
        if count > cnibpf_common::source::MAX_ADDRESSES {
            return Err(ConfigError::Invalid {
                key: "sourceCheck".to_owned(),
                reason: format!(
                    "the container has {count} {family} addresses ({check}), and at most {} of a family are checked: set sourceCheck to false for it",
                    cnibpf_common::source::MAX_ADDRESSES
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

/// An ADD's configuration, its previous result, and that result as this ADD answers it (in
/// the configuration's version).
fn decode_add(stdin: &[u8]) -> Result<(NetConf, Value, Value), Error> {
    let conf = NetConf::parse(stdin)?;
    journal::network(&conf.name);
    let prev_result = conf
        .prev_result
        .clone()
        .ok_or(ConfigError::MissingPrevResult)?;
    let output = result::convert(&prev_result, conf.cni_version, &conf.cni_version_text)?;
    Ok((conf, prev_result, output))
}

fn add(env: &Env, stdin: &[u8]) -> Result<String, Error> {
    let (conf, prev_result, output) = decode_add(stdin)?;
    phases::mark("decode");
    let plan = plan(env, &conf, &prev_result)?;
    phases::mark("plan");
    let pins = PinLayout::new(&conf.plugin.pin_path);
    let _lock = InstanceLock::acquire(&pins.lock_file(), lock_timeout())?;
    phases::mark("lock");
    let mut backend = backend::select(conf.plugin.backend, &pins, &conf.plugin.capacity)?;
    journal::backend(backend.name());
    phases::mark("backend");
    let owner = plan.attachment.owner_id();
    let mut others = backend::existing_except(&pins, Some(backend.name()), Access::Changes)?;
    // A hostPort may be held by an attachment of either backend: the other's are checked
    // here, the serving backend's own refuses in setup_port_mappings, atomically with claiming.
    for other in &mut others {
        backend::refuse_held_host_ports(other.as_mut(), owner, &plan.mappings)?;
        // What it reclaimed from attachments whose interface is gone.
        other.commit()?;
    }
    // The filter and the source check go first: once the datapath is hooked onto the
    // interface, no packet may pass unfiltered or unchecked.
    phases::mark("other backends");
    let marked = |name| {
        move |()| {
            phases::mark(name);
            Ok(())
        }
    };
    let applied = backend
        .setup_filter(&plan.endpoint, plan.filter.as_ref())
        .and_then(marked("filter"))
        .and_then(|()| backend.setup_source_check(&plan.endpoint, plan.source_check.as_ref()))
        .and_then(marked("source check"))
        .and_then(|()| backend.setup_endpoint(&plan.endpoint))
        .and_then(marked("endpoint"))
        .and_then(|()| backend.refresh_uplinks(&plan.endpoint.uplinks))
        .and_then(marked("uplinks"))
        .and_then(|()| backend.setup_port_mappings(&plan.endpoint, &plan.mappings))
        .and_then(marked("port mappings"))
        .and_then(|()| backend.setup_masquerade(&plan.endpoint, plan.masquerade.as_ref()))
        .and_then(marked("masquerade"))
        .and_then(|()| backend.commit())
        .and_then(marked("commit"));
    if let Err(error) = applied {
        // Undo: an attachment is either complete or absent. (The filter is found by its
        // interface: the attachment may not be recorded yet; the source check by its owner.)
        let undone = BackendError::collect(
            [
                (
                    "remove",
                    backend::remove_attachment(backend.as_mut(), owner),
                ),
                ("unfilter", backend.setup_filter(&plan.endpoint, None)),
                ("commit", backend.commit()),
            ]
            .into_iter()
            .filter_map(|(step, outcome)| outcome.err().map(|error| (step, error)))
            .collect(),
        );
        return Err(match undone {
            Ok(()) => error,
            Err(undo) => BackendError::UndoFailed {
                failed: Box::new(error),
                undo: Box::new(undo),
            },
        }
        .into());
    }
    for mapping in &plan.mappings {
        journal::note(journal::Change::HostPortHeld(mapping.to_string()));
    }
    // A re-ADD served by the other backend (the host gained or lost BPF, or `backend` changed)
    // moves the attachment: what the previous backend holds of it goes, once the new one
    // serves it.
    for other in &mut others {
        if other
            .attachments()?
            .iter()
            .any(|record| record.owner == owner)
        {
            backend::remove_attachment(other.as_mut(), owner)?;
            other.commit()?;
        }
    }
    Ok(output.to_string())
}

fn del(env: &Env, stdin: &[u8]) -> Result<(), Error> {
    let conf = CleanupConf::parse(stdin)?;
    journal::network(&conf.name);
    phases::mark("decode");
    let attachment = Attachment::new(&conf.name, &env.container_id, &env.ifname);
    let pins = PinLayout::new(&conf.pin_path);
    let _lock = InstanceLock::acquire(&pins.lock_file(), lock_timeout())?;
    phases::mark("lock");
    // Each backend is cleaned up even when another fails, and every failure is reported.
    let mut failures = Vec::new();
    let backends = backend::existing(&pins, Access::Changes)?;
    phases::mark("backend");
    if let Some(portmap) = &conf.replaced_portmap {
        let owner = attachment.owner_id();
        let mut held = false;
        for backend in &backends {
            held |= backend.holds(owner)?;
        }
        if !held {
            // Made while portmap was chained: its hostPorts are portmap's to remove.
            journal::backend("portmap");
            delegate::portmap_del(portmap)?;
            phases::mark("portmap");
            return Ok(());
        }
    }
    for mut backend in backends {
        journal::backend(backend.name());
        let removed = backend::remove_attachment(backend.as_mut(), attachment.owner_id());
        phases::mark("remove");
        let committed = backend.commit();
        phases::mark("commit");
        failures.extend(
            [removed, committed]
                .into_iter()
                .filter_map(Result::err)
                .map(|error| (backend.name(), error)),
        );
    }
    Ok(BackendError::collect(failures)?)
}

fn check(env: &Env, stdin: &[u8]) -> Result<(), Error> {
    let conf = NetConf::parse(stdin)?;
    journal::network(&conf.name);
    conf.require_version("CHECK")?;
    let prev_result = conf
        .prev_result
        .clone()
        .ok_or(ConfigError::MissingPrevResult)?;
    let plan = plan(env, &conf, &prev_result)?;
    let pins = PinLayout::new(&conf.plugin.pin_path);
    let _lock = InstanceLock::acquire(&pins.lock_file(), lock_timeout())?;
    // The backend that serves the attachment, whichever the configuration asks for now.
    let owner = plan.attachment.owner_id();
    let mut backends = backend::existing(&pins, Access::Changes)?;
    let mut serving = None;
    for (position, backend) in backends.iter().enumerate() {
        if backend
            .attachments()?
            .iter()
            .any(|record| record.owner == owner)
        {
            serving = Some(position);
            break;
        }
    }
    let Some(backend) = serving.and_then(|position| backends.get_mut(position)) else {
        // fail-closed: no backend holds it; the error below says so.
        return Err(BackendError::CheckFailed(format!(
            "no backend holds state for {} (pinPath {}, table inet cnibpf)",
            plan.attachment,
            pins.root().display()
        ))
        .into());
    };
    journal::backend(backend.name());
    backend.check_endpoint(&plan.endpoint)?;
    backend.check_port_mappings(&plan.endpoint, &plan.mappings)?;
    // CHECK is how an operator makes a changed uplink address take effect (see docs/datapath.md).
    backend.refresh_uplinks(&plan.endpoint.uplinks)?;
    backend.check_masquerade(&plan.endpoint, plan.masquerade.as_ref())?;
    backend.check_filter(&plan.endpoint, plan.filter.as_ref())?;
    backend.check_source_check(&plan.endpoint, plan.source_check.as_ref())?;
    backend.commit()?;
    Ok(())
}

fn gc(stdin: &[u8]) -> Result<(), Error> {
    let conf = NetConf::parse(stdin)?;
    journal::network(&conf.name);
    conf.require_version("GC")?;
    // Without the list every attachment of the network would look stale: refuse rather than
    // wipe a network because a runtime left the key out.
    let listed = conf
        .valid_attachments
        .as_ref()
        .ok_or_else(|| ConfigError::Invalid {
            key: "cni.dev/valid-attachments".to_owned(),
            reason: "is required for GC".to_owned(),
        })?;
    let valid: BTreeSet<(String, String)> = listed
        .iter()
        .map(|entry| (entry.container_id.clone(), entry.ifname.clone()))
        .collect();
    let pins = PinLayout::new(&conf.plugin.pin_path);
    let _lock = InstanceLock::acquire(&pins.lock_file(), lock_timeout())?;
    // One attachment or backend that cannot be cleaned up does not keep GC from the others.
    let mut failures = Vec::new();
    for mut backend in backend::existing(&pins, Access::Changes)? {
        journal::backend(backend.name());
        let records = match backend.attachments() {
            Ok(records) => records,
            Err(error) => {
                failures.push((backend.name(), error));
                continue;
            }
        };
        let stale: Vec<_> = records
            .into_iter()
            .filter(|record| {
                record.attachment.network == conf.name
                    && !valid.contains(&(
                        record.attachment.container_id.clone(),
                        record.attachment.ifname.clone(),
                    ))
            })
            .collect();
        let mut outcomes: Vec<Result<(), BackendError>> = stale
            .into_iter()
            .map(|record| {
                backend::remove_attachment(backend.as_mut(), record.owner).map(|()| {
                    journal::note(journal::Change::Removed(record.attachment.to_string()));
                })
            })
            .collect();
        outcomes.push(backend.sweep_expired());
        outcomes.push(backend.commit());
        failures.extend(
            outcomes
                .into_iter()
                .filter_map(Result::err)
                .map(|error| (backend.name(), error)),
        );
    }
    Ok(BackendError::collect(failures)?)
}

fn status(stdin: &[u8]) -> Result<(), Error> {
    let conf = NetConf::parse(stdin)?;
    journal::network(&conf.name);
    conf.require_version("STATUS")?;
    backend::any_available()
        .map_err(|error| Error::Unavailable(format!("no backend can work on this host: {error}")))
}
