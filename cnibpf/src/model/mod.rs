//! The domain: what an attachment is and what it asks of the datapath — port mappings, their
//! conditions, masquerade, filter rules, the addresses it may send from — with the words of
//! the configuration written once (`FromStr`/`Display`). Config parses into these; both
//! backends, inspect and monitor use them.

pub mod attachment;
pub mod capacity;
pub mod conditions;
pub mod filter;
pub mod mapping;
pub mod masquerade;
pub mod network;
pub mod sources;
mod vocabulary;

pub use attachment::{Attachment, Pod};
pub use capacity::{Capacity, Dimension};
pub use filter::{Filter, FilterRule, RuleChange, RuleMatch};
pub use mapping::{HostPortAccess, MappingError, PortMapping, ResolvedMapping, resolve_mappings};
pub use masquerade::{ExcludeReason, Masquerade};
pub use network::NetworkName;
pub use sources::SourceCheck;
pub use vocabulary::*;
