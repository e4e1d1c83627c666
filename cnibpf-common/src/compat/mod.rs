//! The types of layouts the datapath no longer writes, kept only to read their pinned state
//! during a migration.

pub mod retired_flows;
