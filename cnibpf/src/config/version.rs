//! Spec versions: which this plugin speaks, their order, and the verbs that need a newer one.

use std::fmt;

use serde_json::Value;

use super::{ConfigError, names_field};

/// Spec versions this plugin speaks, oldest first.
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// A spec version, ordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct CniVersion(u8, u8, u8);

impl CniVersion {
    pub const V0_4_0: Self = Self(0, 4, 0);
    pub const V1_0_0: Self = Self(1, 0, 0);
    pub const V1_1_0: Self = Self(1, 1, 0);

    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        if !SUPPORTED_VERSIONS.contains(&text) {
            return Err(ConfigError::UnsupportedVersion {
                version: text.to_owned(),
            });
        }
        let mut parts = text.split('.').map(|part| part.parse::<u8>().unwrap_or(0));
        Ok(Self(
            parts.next().unwrap_or(0),
            parts.next().unwrap_or(0),
            parts.next().unwrap_or(0),
        ))
    }

    /// The version an error or VERSION answer is printed in: the configuration's own when it
    /// names a supported one, else the newest.
    pub fn answer_version(stdin: &[u8]) -> String {
        serde_json::from_slice::<Value>(stdin)
            .ok()
            .and_then(|conf| {
                let object = conf.as_object()?;
                object
                    .iter()
                    .find(|(key, _)| names_field(key, "cniVersion"))
                    .and_then(|(_, version)| version.as_str().map(str::to_owned))
            })
            .filter(|version| SUPPORTED_VERSIONS.contains(&version.as_str()))
            .unwrap_or_else(|| SUPPORTED_VERSIONS[SUPPORTED_VERSIONS.len() - 1].to_owned())
    }
}

impl fmt::Display for CniVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

pub(super) fn require_version(
    version: CniVersion,
    text: &str,
    verb: &'static str,
) -> Result<(), ConfigError> {
    let minimum = match verb {
        "CHECK" => CniVersion::V0_4_0,
        "GC" | "STATUS" => CniVersion::V1_1_0,
        _ => return Ok(()),
    };
    if version < minimum {
        return Err(ConfigError::VerbNeedsVersion {
            verb,
            minimum,
            version: text.to_owned(),
        });
    }
    Ok(())
}
