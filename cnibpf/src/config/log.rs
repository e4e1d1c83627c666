//! What a call records of itself: its log (`logFile`, `logMaxSizeMB`, `logMaxFiles`) and
//! where its instance keeps call statistics.

use std::path::PathBuf;

use super::{ConfigError, absolute_path, decode, input::RecordingInput, pin_path};
use crate::paths;

/// Where and how much a call is logged (`logFile`, `logMaxSizeMB`, `logMaxFiles`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogConf {
    /// `None`: logging is off (`logFile: ""`).
    pub file: Option<PathBuf>,
    pub max_bytes: u64,
    /// Rotated files kept beside the current one.
    pub max_files: u32,
}

impl Default for LogConf {
    fn default() -> Self {
        Self {
            file: Some(PathBuf::from(paths::DEFAULT_LOG_FILE)),
            max_bytes: DEFAULT_LOG_MAX_SIZE_MB * 1024 * 1024,
            max_files: DEFAULT_LOG_MAX_FILES,
        }
    }
}

const DEFAULT_LOG_MAX_SIZE_MB: u64 = 10;
const DEFAULT_LOG_MAX_FILES: u32 = 5;
const MAX_LOG_SIZE_MB: u64 = 1024;
const MAX_LOG_FILES: u32 = 100;

pub(super) fn log_conf(
    file: Option<String>,
    max_size_mb: Option<u64>,
    max_files: Option<u32>,
) -> Result<LogConf, ConfigError> {
    let defaults = LogConf::default();
    let file = match file.as_deref() {
        None => defaults.file,
        Some("") => None,
        Some(text) => Some(absolute_path("logFile", text)?),
    };
    let max_size_mb = max_size_mb.unwrap_or(DEFAULT_LOG_MAX_SIZE_MB);
    if !(1..=MAX_LOG_SIZE_MB).contains(&max_size_mb) {
        return Err(ConfigError::invalid(
            "logMaxSizeMB",
            format!("must be between 1 and {MAX_LOG_SIZE_MB}, got {max_size_mb}"),
        ));
    }
    let max_files = max_files.unwrap_or(DEFAULT_LOG_MAX_FILES);
    if !(1..=MAX_LOG_FILES).contains(&max_files) {
        return Err(ConfigError::invalid(
            "logMaxFiles",
            format!("must be between 1 and {MAX_LOG_FILES}, got {max_files}"),
        ));
    }
    Ok(LogConf {
        file,
        max_bytes: max_size_mb * 1024 * 1024,
        max_files,
    })
}

/// Where a call is recorded — its instance's call statistics, its log — read from any
/// configuration, even one the verb refuses (or no JSON at all): a key that is missing or
/// invalid there takes its default, so that the refusal is recorded too.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recording {
    pub pin_path: PathBuf,
    pub log: LogConf,
}

impl Recording {
    pub fn of_stdin(bytes: &[u8]) -> Self {
        // fail-closed: recording only; the verb itself reports what is wrong with the input.
        let input: RecordingInput = serde_json::from_slice(bytes)
            .ok()
            .and_then(|value| decode(value, "").ok())
            .unwrap_or_default();
        Self {
            // fail-closed: as above.
            pin_path: pin_path(input.pin_path)
                .unwrap_or_else(|_| PathBuf::from(paths::DEFAULT_PIN_PATH)),
            // fail-closed: as above.
            log: log_conf(input.log_file, input.log_max_size_mb, input.log_max_files)
                .unwrap_or_default(),
        }
    }
}
