//! The kernel's listing of the table (`nft -j list table`), read into elements and rules.

use serde_json::Value;

use super::{Element, NftablesBackend};

impl NftablesBackend {
    pub(super) fn read_elements(&mut self, set: &Value) {
        let name = set["name"].as_str().unwrap_or_default().to_owned();
        for entry in set["elem"].as_array().into_iter().flatten() {
            // A map element is [key, value]; a set element the key alone.
            let (key, value) = match entry.as_array() {
                Some(pair) if pair.len() == 2 => (&pair[0], Some(&pair[1])),
                _ => (entry, None),
            };
            let (key, comment) = match key.get("elem") {
                Some(elem) => (&elem["val"], elem["comment"].as_str().unwrap_or_default()),
                None => (key, ""),
            };
            let key_parts = parts(key);
            let value_parts = value.map(parts).unwrap_or_default();
            self.elements.push(Element {
                set: name.clone(),
                key: key_parts
                    .iter()
                    .map(|part| quote_if_name(&name, part))
                    .collect::<Vec<_>>()
                    .join(" . "),
                key_parts,
                value_parts,
                comment: comment.to_owned(),
            });
        }
    }
}

/// The parts of a listed key or value: addresses, ports, protocols, prefixes as text.
fn parts(value: &Value) -> Vec<String> {
    match value {
        Value::Object(object) if object.contains_key("concat") => object["concat"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(parts)
            .collect(),
        Value::Object(object) if object.contains_key("prefix") => vec![format!(
            "{}/{}",
            object["prefix"]["addr"].as_str().unwrap_or_default(),
            object["prefix"]["len"]
        )],
        Value::Object(object) if object.contains_key("jump") => {
            vec![
                object["jump"]["target"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            ]
        }
        Value::String(text) => vec![text.clone()],
        Value::Number(number) => vec![number.to_string()],
        _ => Vec::new(),
    }
}

fn quote_if_name(set: &str, part: &str) -> String {
    if set == "attachments" || set == "uplinks" || set == "pods" {
        format!("\"{part}\"")
    } else {
        part.to_owned()
    }
}

/// (packets, bytes) of a rule's counter.
pub(super) fn counter(expr: &[Value]) -> (u64, u64) {
    expr.iter()
        .find_map(|statement| statement.get("counter"))
        .map_or((0, 0), |counter| {
            (
                counter["packets"].as_u64().unwrap_or(0),
                counter["bytes"].as_u64().unwrap_or(0),
            )
        })
}

pub(super) fn has_verdict(expr: &[Value], verdict: &str) -> bool {
    expr.iter()
        .any(|statement| statement.get(verdict).is_some())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn listed_keys_and_values_split_into_their_parts() {
        assert_eq!(
            parts(&json!({ "concat": ["10.0.0.1", "tcp", 8080] })),
            ["10.0.0.1", "tcp", "8080"]
        );
        assert_eq!(
            parts(&json!({ "prefix": { "addr": "10.22.0.0", "len": 16 } })),
            ["10.22.0.0/16"]
        );
        assert_eq!(
            parts(&json!({ "jump": { "target": "f0123_out" } })),
            ["f0123_out"]
        );
        assert!(parts(&json!(null)).is_empty());
        assert_eq!(quote_if_name("attachments", "veth1"), "\"veth1\"");
        assert_eq!(quote_if_name("hostports4", "tcp"), "tcp");
    }

    #[test]
    fn counters_and_verdicts_are_read_from_a_rule_listing() {
        let expr = [
            json!({ "match": { "op": "==", "left": {}, "right": 1 } }),
            json!({ "counter": { "packets": 3, "bytes": 180 } }),
            json!({ "drop": null }),
        ];
        assert_eq!(counter(&expr), (3, 180));
        assert!(has_verdict(&expr, "drop"));
        assert!(!has_verdict(&expr, "return"));
        assert_eq!(counter(&expr[..1]), (0, 0));
    }
}
