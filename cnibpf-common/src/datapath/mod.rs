//! State of the whole datapath rather than of a capability: the layout stamp and the maps'
//! versions that upgrades read, and the instance's settings.

pub mod layout;
pub mod settings;
pub mod versions;

pub use layout::{LAYOUT, LayoutInfo};
pub use settings::{SETTINGS, Settings};
pub use versions::{MAP_VERSIONS, MapName};

use crate::map_spec::MapSpec;

/// The maps of the datapath as a whole.
pub const MAPS: [MapSpec; 3] = [LAYOUT, SETTINGS, MAP_VERSIONS];
