//! cnibpf's entry in a network configuration, as JSON: chained in (once, replacing the
//! reference portmap when asked to) and taken out again, restoring what it replaced. What the
//! uninstall needs to restore is kept in the entry itself (`cnibpfInstall`), which the plugin
//! ignores like every unknown top-level key: the file on the node is the whole record.

use serde_json::{Map, Value, json};

use super::InstallError;
use crate::paths::PLUGIN_NAME;

/// The entry's key holding what the install replaced.
const BOOKKEEPING: &str = "cnibpfInstall";
/// The reference portmap's keys cnibpf honours the same way, carried over when it replaces it.
const PORTMAP_KEYS_CARRIED: [&str; 3] = ["snat", "conditionsV4", "conditionsV6"];

/// How a network configuration file is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// One plugin (`.conf`, `.json`).
    Single,
    /// A chain (`.conflist`).
    List,
}

impl Form {
    /// The form of a parsed file; `None` for JSON that is neither.
    pub fn of(value: &Value) -> Option<Self> {
        let object = value.as_object()?;
        if object.get("plugins").is_some_and(Value::is_array) {
            Some(Self::List)
        } else if object.get("type").is_some_and(Value::is_string) {
            Some(Self::Single)
        } else {
            None
        }
    }
}

/// A configuration with cnibpf chained in, and what the user should know about it.
#[derive(Debug)]
pub struct Chained {
    pub conflist: Value,
    pub notes: Vec<String>,
}

/// Chains `entry` into `network` (of `form`, read from file `file_name`). An entry of cnibpf
/// already there is updated in place (its bookkeeping kept) and any second one dropped; a
/// portmap entry is an error unless `replace_portmap`, which puts cnibpf where it was.
pub fn chain_in(
    network: &Value,
    form: Form,
    file_name: &str,
    entry: &Map<String, Value>,
    replace_portmap: bool,
) -> Result<Chained, InstallError> {
    let mut conflist = match form {
        Form::List => network.clone(),
        Form::Single => single_to_list(network, file_name),
    };
    let name = conflist["name"].as_str().unwrap_or_default().to_owned();
    let plugins = plugins_mut(&mut conflist);
    let mut notes = Vec::new();
    let mut ours = Map::new();
    ours.insert("type".to_owned(), Value::from(PLUGIN_NAME));
    ours.extend(
        entry
            .iter()
            .filter(|(key, _)| *key != "type")
            .map(|(key, value)| (key.clone(), value.clone())),
    );
    let mut position = None;
    let mut bookkeeping = Map::new();
    if form == Form::Single {
        bookkeeping.insert("convertedFrom".to_owned(), Value::from(file_name));
    }
    let mut index = 0;
    while index < plugins.len() {
        match plugin_type(&plugins[index]) {
            Some(PLUGIN_NAME) => {
                let held = plugins.remove(index);
                if position.is_none() {
                    position = Some(index);
                    if let Some(Value::Object(kept)) = held.get(BOOKKEEPING) {
                        bookkeeping.extend(kept.clone());
                    }
                }
            }
            Some("portmap") if replace_portmap => {
                let portmap = plugins.remove(index);
                for key in portmap.as_object().into_iter().flat_map(Map::keys) {
                    if !["type", "capabilities", "name", "cniVersion"].contains(&key.as_str())
                        && !PORTMAP_KEYS_CARRIED.contains(&key.as_str())
                    {
                        notes.push(format!(
                            "portmap's key {key:?} is not carried over to cnibpf"
                        ));
                    }
                }
                bookkeeping.insert("replacedPortmap".to_owned(), portmap);
                bookkeeping.insert("portmapIndex".to_owned(), Value::from(index));
                position.get_or_insert(index);
            }
            Some("portmap") => {
                return Err(InstallError::PortmapPresent {
                    network: name,
                    file: file_name.to_owned(),
                });
            }
            _ => {
                if plugins[index].get("ipMasq") == Some(&Value::Bool(true)) {
                    notes.push(format!(
                        "plugin {} of network {name:?} masquerades too (ipMasq: true): set ipMasq on one of them only",
                        plugin_type(&plugins[index]).unwrap_or("?")
                    ));
                }
                index += 1;
            }
        }
    }
    // Without the capability no runtime sends hostPorts; an entry that names its capabilities
    // keeps what it names.
    if !ours.contains_key("capabilities") {
        ours.insert("capabilities".to_owned(), json!({ "portMappings": true }));
    }
    // A re-install finds the replaced portmap in the bookkeeping: its keys are carried over
    // again, unless the entry now sets them.
    if let Some(portmap) = bookkeeping.get("replacedPortmap") {
        for key in PORTMAP_KEYS_CARRIED {
            if let Some(value) = portmap.get(key)
                && !ours.contains_key(key)
            {
                ours.insert(key.to_owned(), value.clone());
            }
        }
        let capabilities = ours.entry("capabilities").or_insert_with(|| json!({}));
        if let Some(capabilities) = capabilities.as_object_mut() {
            capabilities.insert("portMappings".to_owned(), Value::Bool(true));
        }
    }
    if !bookkeeping.is_empty() {
        ours.insert(BOOKKEEPING.to_owned(), Value::Object(bookkeeping));
    }
    let position = position.unwrap_or(plugins.len()).min(plugins.len());
    // A `bandwidth` plugin after cnibpf shapes the pod's veth once cnibpf's ADD is done: the
    // capability lets that ADD see the pod's rates and keep its traffic on the veth's qdiscs
    // from the first packet (the datapath's qdisc watcher would notice a moment later).
    if plugins[position..]
        .iter()
        .any(|plugin| plugin_type(plugin) == Some("bandwidth"))
    {
        let capabilities = ours.entry("capabilities").or_insert_with(|| json!({}));
        if let Some(capabilities) = capabilities.as_object_mut() {
            capabilities.insert("bandwidth".to_owned(), Value::Bool(true));
        }
    }
    plugins.insert(position, Value::Object(ours));
    Ok(Chained { conflist, notes })
}

/// `network` without cnibpf: its entries dropped, a portmap it replaced put back where it was,
/// and the single-plugin form restored when the install made the chain. `None` when cnibpf is
/// not in it. The second value names the file the network came from when it was converted.
pub fn chain_out(network: &Value) -> Option<(Value, Option<String>)> {
    if Form::of(network)? != Form::List {
        return None;
    }
    let mut conflist = network.clone();
    let plugins = plugins_mut(&mut conflist);
    let mut bookkeeping = None;
    let before = plugins.len();
    plugins.retain(|plugin| {
        let ours = plugin_type(plugin) == Some(PLUGIN_NAME);
        if ours && bookkeeping.is_none() {
            bookkeeping = plugin.get(BOOKKEEPING).cloned();
        }
        !ours
    });
    if plugins.len() == before {
        return None;
    }
    let bookkeeping = bookkeeping.unwrap_or(Value::Null);
    if let Some(portmap) = bookkeeping.get("replacedPortmap") {
        let index = bookkeeping
            .get("portmapIndex")
            .and_then(Value::as_u64)
            .and_then(|index| usize::try_from(index).ok())
            .unwrap_or(plugins.len())
            .min(plugins.len());
        plugins.insert(index, portmap.clone());
    }
    let converted_from = bookkeeping
        .get("convertedFrom")
        .and_then(Value::as_str)
        .map(str::to_owned);
    if converted_from.is_some() && plugins.len() == 1 {
        return Some((list_to_single(&conflist), converted_from));
    }
    Some((conflist, None))
}

/// Whether a network (a conflist, or a single plugin) runs cnibpf.
pub fn chains_cnibpf(network: &Value) -> bool {
    match network.get("plugins").and_then(Value::as_array) {
        Some(plugins) => plugins
            .iter()
            .any(|plugin| plugin_type(plugin) == Some(PLUGIN_NAME)),
        None => plugin_type(network) == Some(PLUGIN_NAME),
    }
}

fn plugin_type(plugin: &Value) -> Option<&str> {
    plugin.get("type").and_then(Value::as_str)
}

fn plugins_mut(conflist: &mut Value) -> &mut Vec<Value> {
    if !conflist["plugins"].is_array() {
        conflist["plugins"] = json!([]);
    }
    conflist["plugins"]
        .as_array_mut()
        .expect("made an array above")
}

/// A single-plugin configuration as a chain of one: the network's keys at the top, the
/// plugin's below.
fn single_to_list(single: &Value, file_name: &str) -> Value {
    let mut plugin = single.as_object().cloned().unwrap_or_default();
    let mut list = Map::new();
    for key in ["cniVersion", "name"] {
        if let Some(value) = plugin.shift_remove(key) {
            list.insert(key.to_owned(), value);
        }
    }
    if let Some(Value::Array(versions)) = plugin.shift_remove("cniVersions") {
        list.insert("cniVersions".to_owned(), Value::Array(versions));
    }
    if !list.contains_key("name") {
        list.insert("name".to_owned(), Value::from(file_name));
    }
    list.insert("plugins".to_owned(), json!([plugin]));
    Value::Object(list)
}

fn list_to_single(list: &Value) -> Value {
    let mut single = Map::new();
    for key in ["cniVersion", "name"] {
        if let Some(value) = list.get(key) {
            single.insert(key.to_owned(), value.clone());
        }
    }
    if let Some(Value::Object(plugin)) = list["plugins"].get(0) {
        single.extend(plugin.clone());
    }
    Value::Object(single)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> Map<String, Value> {
        json!({ "ipMasq": true, "capabilities": { "portMappings": true } })
            .as_object()
            .cloned()
            .expect("an object")
    }

    fn calico() -> Value {
        json!({ "name": "k8s-pod-network", "cniVersion": "0.3.1", "plugins": [
            { "type": "calico", "ipam": { "type": "calico-ipam" } },
            { "type": "bandwidth", "capabilities": { "bandwidth": true } },
            { "type": "portmap", "snat": true, "capabilities": { "portMappings": true } },
        ]})
    }

    fn types(conflist: &Value) -> Vec<&str> {
        conflist["plugins"]
            .as_array()
            .expect("plugins")
            .iter()
            .filter_map(plugin_type)
            .collect()
    }

    #[test]
    fn a_bandwidth_plugin_after_cnibpf_gets_its_capability_declared() {
        let k3s = json!({ "name": "cbr0", "cniVersion": "1.0.0", "plugins": [
            { "type": "flannel" },
            { "type": "portmap", "capabilities": { "portMappings": true } },
            { "type": "bandwidth", "capabilities": { "bandwidth": true } },
        ]});
        let chained =
            chain_in(&k3s, Form::List, "10-flannel.conflist", &entry(), true).expect("replaced");
        assert_eq!(types(&chained.conflist), ["flannel", "cnibpf", "bandwidth"]);
        assert_eq!(
            chained.conflist["plugins"][1]["capabilities"],
            json!({ "portMappings": true, "bandwidth": true })
        );
        // Before cnibpf, bandwidth has shaped the veth when cnibpf's ADD looks.
        let before = chain_in(&calico(), Form::List, "10-calico.conflist", &entry(), true)
            .expect("replaced");
        assert_eq!(
            before.conflist["plugins"][2]["capabilities"],
            json!({ "portMappings": true })
        );
        let (restored, _) = chain_out(&chained.conflist).expect("ours");
        assert_eq!(restored, k3s);
    }

    #[test]
    fn a_portmap_is_refused_unless_replaced_and_comes_back_on_removal() {
        let refused = chain_in(&calico(), Form::List, "10-calico.conflist", &entry(), false)
            .expect_err("portmap present");
        assert!(
            refused.to_string().contains("--replace-portmap"),
            "{refused}"
        );
        let chained = chain_in(&calico(), Form::List, "10-calico.conflist", &entry(), true)
            .expect("replaced");
        assert_eq!(types(&chained.conflist), ["calico", "bandwidth", "cnibpf"]);
        assert_eq!(chained.conflist["plugins"][2]["snat"], true, "carried over");
        let again = chain_in(
            &chained.conflist,
            Form::List,
            "10-calico.conflist",
            &entry(),
            false,
        )
        .expect("re-install");
        assert_eq!(chained.conflist, again.conflist, "idempotent");
        let (restored, converted) = chain_out(&again.conflist).expect("ours");
        assert_eq!(restored, calico());
        assert_eq!(converted, None);
    }

    #[test]
    fn a_single_plugin_becomes_a_chain_and_back() {
        let bridge = json!({ "cniVersion": "1.0.0", "name": "mynet", "type": "bridge",
            "bridge": "cni0", "isGateway": true, "ipMasq": true,
            "ipam": { "type": "host-local", "subnet": "10.22.0.0/16" } });
        let chained =
            chain_in(&bridge, Form::Single, "10-mynet.conf", &entry(), false).expect("chained");
        assert_eq!(chained.conflist["name"], "mynet");
        assert_eq!(types(&chained.conflist), ["bridge", "cnibpf"]);
        assert!(
            chained.notes.iter().any(|note| note.contains("ipMasq")),
            "{:?}",
            chained.notes
        );
        let (restored, converted) = chain_out(&chained.conflist).expect("ours");
        assert_eq!(restored, bridge);
        assert_eq!(converted.as_deref(), Some("10-mynet.conf"));
    }

    #[test]
    fn duplicates_collapse_into_one_entry_in_place() {
        let flannel = json!({ "name": "cbr0", "cniVersion": "0.3.1", "plugins": [
            { "type": "flannel", "delegate": { "hairpinMode": true } },
            { "type": "cnibpf", "backend": "ebpf" },
            { "type": "portmap", "capabilities": { "portMappings": true } },
            { "type": "cnibpf" },
        ]});
        let chained =
            chain_in(&flannel, Form::List, "10-flannel.conflist", &entry(), true).expect("ok");
        assert_eq!(types(&chained.conflist), ["flannel", "cnibpf"]);
        assert_eq!(chained.conflist["plugins"][1]["ipMasq"], true, "updated");
        assert!(chain_out(&json!({ "type": "bridge" })).is_none());
    }
}
