//! CNI error codes: the spec's, and the plugin-specific ones docs/configuration.md documents.

pub const INCOMPATIBLE_VERSION: u32 = 1;
pub const INVALID_ENV: u32 = 4;
pub const DECODE: u32 = 6;
pub const INVALID_CONFIG: u32 = 7;
pub const TRY_AGAIN: u32 = 11;
pub const PLUGIN_UNAVAILABLE: u32 = 50;
pub const HOST_PORT_IN_USE: u32 = 100;
pub const NOT_SUPPORTED: u32 = 101;
pub const DATAPATH: u32 = 102;
pub const INTERFACE: u32 = 103;
pub const BACKEND_UNAVAILABLE: u32 = 104;
pub const CHECK_FAILED: u32 = 105;
pub const INCOMPATIBLE_STATE: u32 = 106;
pub const OUTPUT: u32 = 107;
pub const DELEGATE: u32 = 108;
