//! JSON decoded the way the reference plugins decode it (Go's `encoding/json`): an object key
//! names a struct field when it equals the field's name or, failing that, equals it ignoring
//! case. containerd's CNI library, for one, sends `{"HostPort": …}` where CRI-O sends
//! `{"hostPort": …}`. Keys that name no field are left as they are (a struct that denies
//! unknown fields still sees them), and two keys naming one field are refused rather than one
//! silently winning. Shape errors read "expected …, got …" with the offending value.

use serde::de::{
    self, DeserializeSeed, Deserializer, IntoDeserializer as _, MapAccess, SeqAccess, Visitor,
};
use serde_json::Value;

/// A JSON value as a serde `Deserializer` that folds the case of object keys onto the fields
/// of the struct being decoded, at every depth.
#[derive(Debug)]
pub struct Folding(pub Value);

/// Whether `key` names `field` under Go's rule: equal after simple case folding. Field names are
/// ASCII, and the only non-ASCII characters that fold onto ASCII letters are the long s (onto
/// `s`) and the Kelvin sign (onto `k`).
pub fn names_field(key: &str, field: &str) -> bool {
    let fold = |c: char| match c {
        '\u{17f}' => 's',
        '\u{212a}' => 'k',
        c => c.to_ascii_lowercase(),
    };
    key.chars().map(fold).eq(field.chars().map(fold))
}

/// A short description of a JSON value for messages: its type and, for scalars, itself.
pub fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".to_owned(),
        Value::Bool(flag) => format!("boolean {flag}"),
        Value::Number(number) => format!("number {number}"),
        Value::String(text) => format!("string {text:?}"),
        Value::Array(_) => "an array".to_owned(),
        Value::Object(_) => "an object".to_owned(),
    }
}

fn expected(what: &str, value: &Value) -> serde_json::Error {
    de::Error::custom(format!("expected {what}, got {}", describe(value)))
}

/// The entries of `object` with every key that names one of `fields` spelled as that field.
fn fold_keys(
    object: serde_json::Map<String, Value>,
    fields: &'static [&'static str],
) -> Result<Vec<(String, Value)>, serde_json::Error> {
    let mut claimed: Vec<(&'static str, String)> = Vec::new();
    let mut entries = Vec::with_capacity(object.len());
    for (key, value) in object {
        let field = fields
            .iter()
            .find(|field| **field == key)
            .or_else(|| fields.iter().find(|field| names_field(&key, field)));
        let Some(field) = field else {
            entries.push((key, value));
            continue;
        };
        if let Some((_, earlier)) = claimed.iter().find(|(claimed, _)| claimed == field) {
            return Err(de::Error::custom(format!(
                "keys {earlier:?} and {key:?} both name {field:?}"
            )));
        }
        claimed.push((field, key));
        entries.push(((*field).to_owned(), value));
    }
    Ok(entries)
}

impl<'de> Deserializer<'de> for Folding {
    type Error = serde_json::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Array(items) => visitor.visit_seq(Items(items.into_iter())),
            Value::Object(object) => visitor.visit_map(Entries {
                entries: object.into_iter().collect::<Vec<_>>().into_iter(),
                value: None,
            }),
            scalar => scalar.deserialize_any(visitor),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        // As in Go, an explicit null leaves a field as if it were absent.
        match self.0 {
            Value::Null => visitor.visit_none(),
            value => visitor.visit_some(Self(value)),
        }
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Bool(flag) => visitor.visit_bool(flag),
            other => Err(expected("true or false", &other)),
        }
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::String(text) => visitor.visit_string(text),
            other => Err(expected("a string", &other)),
        }
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        self.deserialize_string(visitor)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Array(items) => visitor.visit_seq(Items(items.into_iter())),
            other => Err(expected("an array", &other)),
        }
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Object(_) => self.deserialize_any(visitor),
            other => Err(expected("an object", &other)),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Object(object) => visitor.visit_map(Entries {
                entries: fold_keys(object, fields)?.into_iter(),
                value: None,
            }),
            other => Err(expected("an object", &other)),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.deserialize_enum(name, variants, visitor)
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        visitor.visit_unit()
    }

    serde::forward_to_deserialize_any! {
        i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char bytes byte_buf unit unit_struct
        tuple tuple_struct identifier
    }
}

struct Items(std::vec::IntoIter<Value>);

impl<'de> SeqAccess<'de> for Items {
    type Error = serde_json::Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Self::Error> {
        self.0
            .next()
            .map(|item| seed.deserialize(Folding(item)))
            .transpose()
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

struct Entries {
    entries: std::vec::IntoIter<(String, Value)>,
    value: Option<Value>,
}

impl<'de> MapAccess<'de> for Entries {
    type Error = serde_json::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Self::Error> {
        let Some((key, value)) = self.entries.next() else {
            return Ok(None);
        };
        self.value = Some(value);
        seed.deserialize(key.into_deserializer()).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, Self::Error> {
        let value = self
            .value
            .take()
            .ok_or_else(|| de::Error::custom("a map value was asked for before its key"))?;
        seed.deserialize(Folding(value))
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.entries.len())
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;
    use serde_json::json;

    use super::*;

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(rename_all = "camelCase")]
    struct Entry {
        host_port: u16,
        #[serde(rename = "hostIP")]
        host_ip: Option<String>,
        inner: Option<Inner>,
    }

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        src: Option<String>,
    }

    fn decode(value: Value) -> Result<Entry, String> {
        serde_path_to_error::deserialize(Folding(value))
            .map_err(|error| format!("{}: {}", error.path(), error.inner()))
    }

    #[test]
    fn keys_match_fields_ignoring_case_at_every_depth() {
        let entry = decode(json!({ "HostPort": 80, "HOSTIP": "::", "Inner": { "SRC": "a" } }))
            .expect("decodes");
        assert_eq!(
            entry,
            Entry {
                host_port: 80,
                host_ip: Some("::".to_owned()),
                inner: Some(Inner {
                    src: Some("a".to_owned())
                }),
            }
        );
    }

    #[test]
    fn go_folds_the_long_s_and_the_kelvin_sign() {
        assert!(names_field("hoſtPort", "hostPort"));
        assert!(names_field("\u{212a}ey", "key"));
        assert!(!names_field("hostPorts", "hostPort"));
        assert!(!names_field("host_port", "hostPort"));
    }

    #[test]
    fn unknown_keys_stay_unknown_and_two_spellings_of_one_field_are_refused() {
        let error = decode(json!({ "hostPort": 1, "inner": { "dst": "a" } })).expect_err("unknown");
        assert!(
            error.starts_with("inner.dst: unknown field `dst`"),
            "{error}"
        );
        let error = decode(json!({ "hostPort": 1, "inner": { "src": "a", "Src": "b" } }))
            .expect_err("ambiguous");
        assert!(
            error.contains("keys \"Src\" and \"src\" both name \"src\"")
                || error.contains("keys \"src\" and \"Src\" both name \"src\""),
            "{error}"
        );
    }

    #[test]
    fn shape_errors_name_the_path_and_the_value() {
        let error = decode(json!({ "hostPort": "80" })).expect_err("string");
        assert!(
            error.starts_with("hostPort: invalid type: string \"80\""),
            "{error}"
        );
        let error = decode(json!({ "hostPort": 1, "inner": [] })).expect_err("array");
        assert_eq!(error, "inner: expected an object, got an array");
        let error = decode(json!({ "hostPort": 1, "hostIP": 5 })).expect_err("number");
        assert_eq!(error, "hostIP: expected a string, got number 5");
    }

    #[test]
    fn null_is_absent() {
        let entry = decode(json!({ "hostPort": 1, "hostIP": null })).expect("decodes");
        assert_eq!(entry.host_ip, None);
    }
}
