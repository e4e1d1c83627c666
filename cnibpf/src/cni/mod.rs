//! The CNI protocol: environment, verbs, results and errors on stdout.

pub mod args;
mod delegate;
pub mod error;
mod link;
mod plan;
mod release;
pub mod result;

use std::{collections::BTreeSet, io::Read as _, path::PathBuf, time::Instant};

use serde_json::{Value, json};

use crate::{
    backend::BackendError,
    call_log, call_stats,
    config::{
        CleanupConf, CniVersion, ConfigError, NetConf, Recording, ReleaseOnly, SUPPORTED_VERSIONS,
        ifname_problem,
    },
    instance::{Instance, Serving},
    journal,
    model::Attachment,
    output::log_line,
    paths::PinLayout,
    phases,
};
use args::{ArgsError, CniArgs};
use error::Error;
use link::HostInterfaceError;
use plan::plan;

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
            let valid_id = container_id.len() < cnibpf_common::endpoints::owners::NAME_LEN
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
    Serving::open(&pins, conf.plugin.backend, &conf.plugin.capacity)?.add(&plan)?;
    Ok(output.to_string())
}

fn del(env: &Env, stdin: &[u8]) -> Result<(), Error> {
    let conf = CleanupConf::parse(stdin)?;
    journal::network(&conf.name);
    phases::mark("decode");
    let owner = Attachment::new(&conf.name, &env.container_id, &env.ifname).owner_id();
    let mut instance = Instance::to_change(&PinLayout::new(&conf.pin_path))?;
    if let Some(portmap) = &conf.replaced_portmap
        && !instance.holds(owner)?
    {
        // Made while portmap was chained: its hostPorts are portmap's to remove.
        journal::backend("portmap");
        delegate::portmap_del(portmap)?;
        phases::mark("portmap");
        return Ok(());
    }
    Ok(instance.remove(owner)?)
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
    Ok(Instance::to_change(&pins)?.check(&plan, &pins)?)
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
    let collected =
        Instance::to_change(&PinLayout::new(&conf.plugin.pin_path))?.collect(|record| {
            Ok(record.attachment.network == conf.name
                && !valid.contains(&(
                    record.attachment.container_id.clone(),
                    record.attachment.ifname.clone(),
                )))
        });
    for (_, record) in &collected.removed {
        journal::note(journal::Change::Removed(record.attachment.to_string()));
    }
    Ok(BackendError::collect(collected.failures)?)
}

fn status(stdin: &[u8]) -> Result<(), Error> {
    let conf = NetConf::parse(stdin)?;
    journal::network(&conf.name);
    conf.require_version("STATUS")?;
    crate::backend::any_available()
        .map_err(|error| Error::Unavailable(format!("no backend can work on this host: {error}")))
}
