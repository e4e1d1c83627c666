//! Names and paths the configuration gives: the network's name, interface names, absolute
//! paths.

use std::path::PathBuf;

use super::ConfigError;

pub(super) fn validate_network_name(name: &str) -> Result<(), ConfigError> {
    let valid = name.len() < cnibpf_common::endpoints::owners::NAME_LEN
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
    if valid {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            "name",
            format!(
                "{name:?} is not a valid network name (letters, digits, '_', '.', '-', starting with a letter or digit, under {} bytes)",
                cnibpf_common::endpoints::owners::NAME_LEN
            ),
        ))
    }
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
