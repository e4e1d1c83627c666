//! cnibpf's entry in a network configuration, as JSON: chained into a copy of the primary
//! network (replacing the reference portmap when asked to), and taken out of a network an
//! earlier release chained it into in place. The file the copy was made from and what it
//! replaced are kept in the entry itself (`cnibpfInstall`), which the plugin ignores like every
//! unknown top-level key: the file on the node is the whole record.

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

/// Chains `entry` into `network` (of `form`, read from file `file_name`, holding no cnibpf
/// entry): a portmap entry is an error unless `replace_portmap`, which puts cnibpf where it
/// was. The entry records the file it was rendered from (`source`) and what it replaced.
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
    bookkeeping.insert("source".to_owned(), Value::from(file_name));
    let mut index = 0;
    while index < plugins.len() {
        match plugin_type(&plugins[index]) {
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
                for key in PORTMAP_KEYS_CARRIED {
                    if let Some(value) = portmap.get(key)
                        && !ours.contains_key(key)
                    {
                        ours.insert(key.to_owned(), value.clone());
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
    if bookkeeping.contains_key("replacedPortmap") {
        let capabilities = ours.entry("capabilities").or_insert_with(|| json!({}));
        if let Some(capabilities) = capabilities.as_object_mut() {
            capabilities.insert("portMappings".to_owned(), Value::Bool(true));
        }
    }
    ours.insert(BOOKKEEPING.to_owned(), Value::Object(bookkeeping));
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

/// A network an earlier release of `install` chained cnibpf into in place, as it was before:
/// cnibpf's entries dropped, a portmap it replaced put back where it was, and the
/// single-plugin form restored when that install made the chain. `None` when cnibpf is not in
/// it. The second value names the file the network came from when it was converted.
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

/// Whether a network is Multus's (thin `multus`, thick `multus-shim`): a meta-plugin whose
/// pods' cluster network is another file of the directory.
pub fn is_multus(network: &Value) -> bool {
    let first = match network.get("plugins").and_then(Value::as_array) {
        Some(plugins) => plugins.first(),
        None => Some(network),
    };
    first
        .and_then(plugin_type)
        .is_some_and(|kind| ["multus", "multus-shim"].contains(&kind))
}

/// Whether Multus's network holds its cluster network inline (thin Multus's `delegates`) and
/// that chains cnibpf; `None` when it holds none (thick Multus reads the file itself).
pub fn multus_delegate_chains_cnibpf(network: &Value) -> Option<bool> {
    let first = match network.get("plugins").and_then(Value::as_array) {
        Some(plugins) => plugins.first()?,
        None => network,
    };
    let delegate = first.get("delegates")?.as_array()?.first()?;
    Some(chains_cnibpf(delegate))
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

    /// What an earlier release's in-place install made of `network`: the chain, with the
    /// bookkeeping it kept (`convertedFrom` for a single plugin it turned into a chain).
    fn in_place(network: &Value, form: Form, file_name: &str) -> Value {
        let mut chained = chain_in(network, form, file_name, &entry(), true)
            .expect("chained")
            .conflist;
        for plugin in plugins_mut(&mut chained) {
            if let Some(kept) = plugin.get_mut(BOOKKEEPING).and_then(Value::as_object_mut) {
                kept.shift_remove("source");
                if form == Form::Single {
                    kept.insert("convertedFrom".to_owned(), Value::from(file_name));
                }
            }
        }
        chained
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
    }

    #[test]
    fn a_portmap_is_refused_unless_replaced_and_recorded_with_the_source() {
        let refused = chain_in(&calico(), Form::List, "10-calico.conflist", &entry(), false)
            .expect_err("portmap present");
        assert!(
            refused.to_string().contains("--replace-portmap"),
            "{refused}"
        );
        let chained = chain_in(&calico(), Form::List, "10-calico.conflist", &entry(), true)
            .expect("replaced");
        assert_eq!(types(&chained.conflist), ["calico", "bandwidth", "cnibpf"]);
        let ours = &chained.conflist["plugins"][2];
        assert_eq!(ours["snat"], true, "carried over");
        assert_eq!(ours[BOOKKEEPING]["source"], "10-calico.conflist");
        assert_eq!(ours[BOOKKEEPING]["replacedPortmap"], calico()["plugins"][2]);
        assert_eq!(ours[BOOKKEEPING]["portmapIndex"], 2);
    }

    #[test]
    fn a_single_plugin_becomes_a_chain() {
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
    }

    #[test]
    fn an_earlier_in_place_chain_is_taken_out_to_what_it_was() {
        let (restored, converted) =
            chain_out(&in_place(&calico(), Form::List, "10-calico.conflist")).expect("ours");
        assert_eq!(restored, calico());
        assert_eq!(converted, None);
        let bridge = json!({ "cniVersion": "1.0.0", "name": "mynet", "type": "bridge",
            "ipam": { "type": "host-local", "subnet": "10.22.0.0/16" } });
        let (restored, converted) =
            chain_out(&in_place(&bridge, Form::Single, "10-mynet.conf")).expect("ours");
        assert_eq!(restored, bridge);
        assert_eq!(converted.as_deref(), Some("10-mynet.conf"));
        // Two entries (a hand edit beside an install) both go.
        let flannel = json!({ "name": "cbr0", "cniVersion": "0.3.1", "plugins": [
            { "type": "flannel" }, { "type": "cnibpf", "backend": "ebpf" }, { "type": "cnibpf" },
        ]});
        let (restored, _) = chain_out(&flannel).expect("ours");
        assert_eq!(types(&restored), ["flannel"]);
        assert!(chain_out(&json!({ "type": "bridge" })).is_none());
    }

    #[test]
    fn multus_is_told_apart_thin_and_thick() {
        let thin = json!({ "cniVersion": "0.3.1", "name": "multus-cni-network", "type": "multus",
            "kubeconfig": "/etc/cni/net.d/multus.d/multus.kubeconfig",
            "delegates": [calico()] });
        let thick = json!({ "cniVersion": "0.3.1", "name": "multus-cni-network",
            "plugins": [{ "type": "multus-shim", "logLevel": "verbose" }] });
        assert!(is_multus(&thin) && is_multus(&thick) && !is_multus(&calico()));
        assert_eq!(multus_delegate_chains_cnibpf(&thin), Some(false));
        assert_eq!(multus_delegate_chains_cnibpf(&thick), None);
        let chained = chain_in(&calico(), Form::List, "10-calico.conflist", &entry(), true)
            .expect("replaced")
            .conflist;
        let regenerated = json!({ "type": "multus", "name": "multus-cni-network",
            "delegates": [chained] });
        assert_eq!(multus_delegate_chains_cnibpf(&regenerated), Some(true));
    }
}
