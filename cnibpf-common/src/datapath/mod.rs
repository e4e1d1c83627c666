//! State of the whole datapath rather than of a capability: the layout stamp that upgrades
//! read, and the instance's settings.

pub mod layout;
pub mod settings;

pub use layout::{LAYOUT, LayoutInfo};
pub use settings::{SETTINGS, Settings};

use crate::map_spec::MapSpec;

/// The maps of the datapath as a whole.
pub const MAPS: [MapSpec; 2] = [LAYOUT, SETTINGS];
