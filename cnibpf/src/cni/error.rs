//! The one conversion from every subsystem's error to the CNI error JSON.

use serde::Serialize;

use super::{EnvError, delegate::DelegateError};
use crate::{
    backend::BackendError, code, config::ConfigError, instance::InstanceError, lock::LockError,
    model::MappingError, netlink::NetlinkError,
};

/// An error as the CNI spec prints it on stdout.
#[derive(Debug, Serialize)]
pub struct CniError {
    #[serde(rename = "cniVersion")]
    pub cni_version: String,
    pub code: u32,
    pub msg: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub details: String,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Env(#[from] EnvError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Mapping(#[from] MappingError),
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error(transparent)]
    Delegate(#[from] DelegateError),
    #[error("{0}")]
    Unavailable(String),
    #[error("could not read the network configuration from stdin")]
    Stdin(#[source] std::io::Error),
    #[error("could not write the result to stdout")]
    Output(#[source] std::io::Error),
}

impl From<InstanceError> for Error {
    fn from(error: InstanceError) -> Self {
        match error {
            InstanceError::Lock(error) => Self::Lock(error),
            InstanceError::Backend(error) => Self::Backend(error),
        }
    }
}

impl Error {
    pub fn code(&self) -> u32 {
        match self {
            Self::Env(_) => code::INVALID_ENV,
            Self::Config(error) => error.code(),
            Self::Mapping(_) => code::INVALID_CONFIG,
            Self::Netlink(_) => code::INTERFACE,
            Self::Backend(error) => error.code(),
            Self::Lock(_) => code::TRY_AGAIN,
            Self::Delegate(error) => error.code(),
            Self::Stdin(_) => code::DECODE,
            Self::Output(_) => code::OUTPUT,
            Self::Unavailable(_) => code::PLUGIN_UNAVAILABLE,
        }
    }

    pub fn into_cni(self, cni_version: &str) -> CniError {
        let mut details = Vec::new();
        let mut source = std::error::Error::source(&self);
        while let Some(cause) = source {
            details.push(cause.to_string());
            source = cause.source();
        }
        CniError {
            cni_version: cni_version.to_owned(),
            code: self.code(),
            msg: self.to_string(),
            details: details.join(": "),
        }
    }
}
