//! Names and paths the configuration gives: the network's name, interface names, absolute
//! paths.

use std::path::PathBuf;

use super::ConfigError;

pub(super) fn validate_network_name(name: &str) -> Result<(), ConfigError> {
    crate::model::NetworkName::new(name)
        .map(drop)
        .map_err(|reason| ConfigError::invalid("name", reason))
}

/// Interface name rules of the kernel (`dev_valid_name`).
pub fn ifname_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("is empty")
    } else if name.len() >= cnibpf_common::endpoints::owners::IFNAME_LEN {
        Some("is longer than 15 bytes")
    } else if name == "." || name == ".." {
        Some("is not a valid interface name")
    } else if name
        .chars()
        .any(|c| c == '/' || c == ':' || c.is_whitespace())
    {
        Some("contains '/', ':' or whitespace")
    } else {
        None
    }
}

pub(super) fn absolute_path(key: &str, text: &str) -> Result<PathBuf, ConfigError> {
    let path = PathBuf::from(text);
    if !path.is_absolute()
        || path
            .components()
            .any(|c| c == std::path::Component::ParentDir)
    {
        return Err(ConfigError::invalid(
            key,
            format!("expected an absolute path without '..', got {text:?}"),
        ));
    }
    Ok(path)
}
