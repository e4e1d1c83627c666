//! `cnibpf filter`: the filter rules of running attachments, as the backends hold them now.
//! `show` prints them in the configuration's rule shape, each with the proposal's `action`
//! (`insert` at its own index), so that what it prints is a rule list a configuration, or a
//! change of another attachment, can take as it is. `apply` changes them live: a list of
//! rules, each inserted, appended or deleted, validated as a configuration's, applied to each
//! attachment it reaches whole or not at all.

use std::path::Path;

use serde_json::{Map, Value, json};

use crate::{
    backend::{AttachmentRecord, Backend, BackendError, FilterRecord},
    cni::error::Error,
    config::{self, MAX_FILTER_RULES},
    instance::Instance,
    model::{
        ConnState, Direction, Filter, FilterRule, PortRange, RuleChange, RuleProtocol, Target,
    },
    paths::PinLayout,
};

/// Which attachments a command reaches: every one of `network`, or the container's (on one
/// interface when `ifname` names it).
#[derive(Clone, Debug)]
pub struct Selection {
    pub network: String,
    pub container: Option<String>,
    pub ifname: Option<String>,
}

impl Selection {
    fn takes(&self, record: &AttachmentRecord) -> bool {
        let attachment = &record.attachment;
        attachment.network == self.network
            && self
                .container
                .as_ref()
                .is_none_or(|container| *container == attachment.container_id)
            && self
                .ifname
                .as_ref()
                .is_none_or(|ifname| *ifname == attachment.ifname)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LiveFilterError {
    #[error("no attachment of network {network:?} matches{}", describe(container.as_deref(), ifname.as_deref()))]
    NoAttachment {
        network: String,
        container: Option<String>,
        ifname: Option<String>,
    },
    #[error(
        "container {container} has {count} attachments on network {network:?}: name one with --ifname"
    )]
    SeveralInterfaces {
        network: String,
        container: String,
        count: usize,
    },
    #[error(transparent)]
    State(#[from] Error),
}

fn describe(container: Option<&str>, ifname: Option<&str>) -> String {
    match (container, ifname) {
        (Some(container), Some(ifname)) => format!(" container {container} on {ifname}"),
        (Some(container), None) => format!(" container {container}"),
        (None, Some(ifname)) => format!(" interface {ifname}"),
        (None, None) => String::new(),
    }
}

/// One attachment's filter as a backend holds it.
struct Held {
    record: AttachmentRecord,
    filter: Option<FilterRecord>,
}

/// The filters of the attachments `selection` reaches, read under the instance's lock.
fn read(pins: &PinLayout, selection: &Selection) -> Result<Vec<Held>, LiveFilterError> {
    let mut held = Vec::new();
    for backend in Instance::to_read(pins).map_err(Error::from)?.backends() {
        let filters = backend.filters().map_err(Error::from)?;
        for record in backend.attachments().map_err(Error::from)? {
            if !selection.takes(&record) {
                continue;
            }
            let filter = filters
                .iter()
                .find(|(owner, _)| *owner == record.owner)
                .map(|(_, filter)| filter.clone());
            held.push(Held { record, filter });
        }
    }
    if held.is_empty() {
        return Err(LiveFilterError::NoAttachment {
            network: selection.network.clone(),
            container: selection.container.clone(),
            ifname: selection.ifname.clone(),
        });
    }
    held.sort_by(|one, other| {
        let key = |held: &Held| {
            let attachment = &held.record.attachment;
            (attachment.container_id.clone(), attachment.ifname.clone())
        };
        key(one).cmp(&key(other))
    });
    Ok(held)
}

/// `cnibpf filter show`: with a container, its rule list; else every attachment of the
/// network with its rules and default.
pub fn show(pin_path: &Path, selection: &Selection) -> Result<Value, LiveFilterError> {
    let held = read(&PinLayout::new(pin_path), selection)?;
    if let Some(container) = &selection.container {
        return match held.as_slice() {
            [one] => Ok(rule_list(one.filter.as_ref())),
            several => Err(LiveFilterError::SeveralInterfaces {
                network: selection.network.clone(),
                container: container.clone(),
                count: several.len(),
            }),
        };
    }
    Ok(Value::Array(
        held.iter()
            .map(|held| {
                let attachment = &held.record.attachment;
                json!({
                    "containerId": attachment.container_id,
                    "ifname": attachment.ifname,
                    "pod": held.record.pod.as_ref().map(ToString::to_string),
                    "filterDefault": held
                        .filter
                        .as_ref()
                        // fail-closed: an Option of what was read; an attachment without a
                        // filter lets everything pass.
                        .map_or(Target::Allow, |record| record.filter.default)
                        .as_str(),
                    "rules": rule_list(held.filter.as_ref()),
                })
            })
            .collect(),
    ))
}

/// What one attachment made of a list of changes: what it did, or why it refused.
pub struct Applied {
    pub attachment: String,
    pub outcome: Result<String, String>,
}

/// `cnibpf filter apply`: the changes `input` lists, applied to each attachment `selection`
/// reaches, each one's in one step (its rules all changed, or none). A list that does not
/// parse changes nothing anywhere. A failure of a backend ends its part of the run: the
/// attachments after it are reported as not reached.
pub fn apply(
    pin_path: &Path,
    selection: &Selection,
    input: &[u8],
) -> Result<Vec<Applied>, LiveFilterError> {
    let changes = config::parse_rule_changes(input).map_err(Error::from)?;
    let pins = PinLayout::new(pin_path);
    let mut instance = Instance::to_change(&pins).map_err(Error::from)?;
    let mut applied = Vec::new();
    for backend in instance.backends_mut() {
        let filters = backend.filters().map_err(Error::from)?;
        let mut failed = None;
        for record in backend.attachments().map_err(Error::from)? {
            if !selection.takes(&record) {
                continue;
            }
            let outcome =
                match &failed {
                    Some(error) => Err(format!("not reached: {error}")),
                    None => change_one(backend.as_mut(), &record, &filters, &changes).map_err(
                        |refusal| match refusal {
                            Refusal::Rules(reason) => reason,
                            Refusal::Backend(error) => {
                                let said = crate::output::with_causes(&error);
                                failed = Some(said.clone());
                                said
                            }
                        },
                    ),
                };
            applied.push(Applied {
                attachment: record.attachment.to_string(),
                outcome,
            });
        }
    }
    if applied.is_empty() {
        return Err(LiveFilterError::NoAttachment {
            network: selection.network.clone(),
            container: selection.container.clone(),
            ifname: selection.ifname.clone(),
        });
    }
    Ok(applied)
}

/// Why an attachment did not take a change.
enum Refusal {
    /// Its rules refuse it: nothing was attempted.
    Rules(String),
    /// Its backend failed.
    Backend(BackendError),
}

fn change_one(
    backend: &mut dyn Backend,
    record: &AttachmentRecord,
    filters: &[(u64, FilterRecord)],
    changes: &[RuleChange],
) -> Result<String, Refusal> {
    // An attachment without a filter lets everything pass: its first rules come with the
    // default ALLOW.
    let unfiltered = Filter {
        rules: Vec::new(),
        default: Target::Allow,
    };
    let current = filters
        .iter()
        .find(|(owner, _)| *owner == record.owner)
        // fail-closed: an Option of a search in what was read; no filter lets all pass.
        .map_or(&unfiltered, |(_, held)| &held.filter);
    let (next, done) = current
        .changed(changes, MAX_FILTER_RULES)
        .map_err(|refused| Refusal::Rules(format!("{}: {}", refused.key, refused.reason)))?;
    backend
        .change_filter(record.owner, &next)
        .and_then(|()| backend.commit())
        .map_err(Refusal::Backend)?;
    let indexes: Vec<String> = next
        .rules
        .iter()
        .map(|rule| rule.index.to_string())
        .collect();
    Ok(format!(
        "{}; rules now {}",
        done.join(", "),
        if indexes.is_empty() {
            "none".to_owned()
        } else {
            indexes.join(", ")
        }
    ))
}

fn rule_list(filter: Option<&FilterRecord>) -> Value {
    Value::Array(
        filter
            .iter()
            .flat_map(|record| &record.filter.rules)
            .map(rule_document)
            .collect(),
    )
}

/// A rule as a configuration writes it: the keys it sets, defaults left out.
pub fn rule_document(rule: &FilterRule) -> Value {
    let mut document = Map::new();
    document.insert("index".to_owned(), json!(rule.index));
    document.insert("action".to_owned(), json!("insert"));
    document.insert("target".to_owned(), json!(rule.target.as_str()));
    if let Some(src) = rule.src {
        document.insert("src".to_owned(), json!(src.to_string()));
    }
    if let Some(dst) = rule.dst {
        document.insert("dst".to_owned(), json!(dst.to_string()));
    }
    for (key, network) in [
        ("srcNetwork", &rule.src_network),
        ("dstNetwork", &rule.dst_network),
    ] {
        if let Some(network) = network {
            document.insert(key.to_owned(), json!(network.as_str()));
        }
    }
    if rule.protocol != RuleProtocol::Any {
        document.insert("proto".to_owned(), json!(rule.protocol.as_str()));
    }
    for (key, range) in [("sport", rule.sport), ("dport", rule.dport)] {
        if let Some(range) = range {
            document.insert(key.to_owned(), port_document(range));
        }
    }
    if rule.connstate != ConnState::Any {
        document.insert("connstate".to_owned(), json!(rule.connstate.as_str()));
    }
    if rule.direction != Direction::Both {
        document.insert("direction".to_owned(), json!(rule.direction.as_str()));
    }
    if rule.log {
        document.insert("log".to_owned(), json!(true));
    }
    Value::Object(document)
}

/// A port as a number, a range as `"low-high"`.
fn port_document(range: PortRange) -> Value {
    if range.low == range.high {
        json!(range.low)
    } else {
        json!(range.to_string())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::config::NetConf;

    /// What `show` prints for a rule reads back, through the configuration's parser, as the
    /// same rule.
    #[test]
    fn a_shown_rule_parses_back_into_itself() {
        let rules = json!([
            { "index": 10, "target": "DROP", "src": "172.64.0.0/13" },
            { "index": 20, "target": "ALLOW", "dst": "10.10.10.100/32", "proto": "tcp",
              "sport": "1000-2000", "dport": 80, "connstate": "new", "direction": "egress" },
            { "index": 30, "target": "ALLOW", "proto": "icmpv6", "direction": "ingress" },
            { "index": 40, "target": "REJECT", "srcNetwork": "dmz", "dstNetwork": "protected",
              "proto": "tcp", "dport": 389, "log": true },
        ]);
        let parse = |rules: &Value| {
            let config = json!({ "cniVersion": "1.0.0", "name": "n", "type": "cnibpf",
                                 "filter": rules });
            NetConf::parse(config.to_string().as_bytes())
                .expect("valid rules")
                .plugin
                .filter
        };
        let parsed = parse(&rules);
        let shown = Value::Array(parsed.iter().map(rule_document).collect());
        assert_eq!(parse(&shown), parsed);
        assert_eq!(
            shown[0],
            json!({ "index": 10, "action": "insert", "target": "DROP",
                                     "src": "172.64.0.0/13" })
        );
        assert_eq!(shown[1]["dport"], json!(80));
        assert_eq!(shown[1]["sport"], json!("1000-2000"));
        assert_eq!(
            (
                &shown[3]["srcNetwork"],
                &shown[3]["dstNetwork"],
                &shown[3]["log"]
            ),
            (&json!("dmz"), &json!("protected"), &json!(true))
        );
    }
}
