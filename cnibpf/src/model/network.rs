//! A CNI network as a filter rule names it (`srcNetwork`, `dstNetwork`): on this node, the
//! addresses of its attachments under the same cnibpf instance, followed as they come and go.

use std::fmt;

/// Longest network name: what the `owners` record holds (with its NUL).
const MAX_LEN: usize = cnibpf_common::endpoints::owners::NAME_LEN - 1;

/// A valid CNI network name: letters, digits, `_`, `.`, `-`, starting with a letter or a digit
/// (libcni's rule), at most [`MAX_LEN`] bytes.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(transparent)]
pub struct NetworkName(String);

impl NetworkName {
    /// The name, or why it is none.
    pub fn new(name: &str) -> Result<Self, String> {
        let valid = name.len() <= MAX_LEN
            && name.starts_with(|c: char| c.is_ascii_alphanumeric())
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
        if valid {
            Ok(Self(name.to_owned()))
        } else {
            Err(format!(
                "{name:?} is not a valid network name (letters, digits, '_', '.', '-', starting with a letter or digit, at most {MAX_LEN} bytes)"
            ))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The network's id in the datapath: 64-bit FNV-1a of its name, never zero (a rule's "no
    /// network"). Stable across invocations and hosts, as an attachment's owner id is.
    pub fn id(&self) -> u64 {
        const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
        const PRIME: u64 = 0x0000_0100_0000_01b3;
        self.0
            .bytes()
            .fold(OFFSET_BASIS, |hash, byte| {
                (hash ^ u64::from(byte)).wrapping_mul(PRIME)
            })
            .max(1)
    }
}

impl fmt::Display for NetworkName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> serde::Deserialize<'de> for NetworkName {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Self::new(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_network_name_is_what_libcni_takes() {
        for valid in ["dmz", "protected", "net-1.a_b", "9lives"] {
            assert_eq!(NetworkName::new(valid).expect(valid).as_str(), valid);
        }
        for invalid in ["", "-dmz", ".x", "a b", "dmz/1", "ü"] {
            assert!(NetworkName::new(invalid).is_err(), "{invalid:?}");
        }
        assert!(NetworkName::new(&"n".repeat(MAX_LEN)).is_ok());
        assert!(NetworkName::new(&"n".repeat(MAX_LEN + 1)).is_err());
    }

    #[test]
    fn a_networks_id_is_stable_and_not_zero() {
        let dmz = NetworkName::new("dmz").expect("valid");
        assert_eq!(dmz.id(), NetworkName::new("dmz").expect("valid").id());
        assert_ne!(dmz.id(), NetworkName::new("dmz2").expect("valid").id());
        assert_ne!(dmz.id(), 0);
    }
}
