//! What a pinned map is, declared once beside its key and value types: its name, its kind, the
//! size the object declares, how the loader sizes it from the operator's capacity, and where
//! its entries name the attachment that owns them. The eBPF statics take their sizes from it
//! (and the object test holds each static to it), userspace sizes, resizes, copies and
//! measures maps by it, and the tests find an attachment's entries by it.

/// The kernel's map type of a pinned map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapKind {
    Hash,
    LruHash,
    PerCpuHash,
    Array,
    PerCpuArray,
    LpmTrie,
    RingBuf,
    ProgramArray,
}

impl MapKind {
    /// The kernel's `enum bpf_map_type` value.
    pub const fn kernel_type(self) -> u32 {
        match self {
            Self::Hash => 1,
            Self::Array => 2,
            Self::PerCpuHash => 5,
            Self::PerCpuArray => 6,
            Self::LruHash => 9,
            Self::LpmTrie => 11,
            Self::RingBuf => 27,
            Self::ProgramArray => 3,
        }
    }

    /// Whether each CPU has a value of its own.
    pub const fn per_cpu(self) -> bool {
        matches!(self, Self::PerCpuHash | Self::PerCpuArray)
    }
}

/// A dimension of the datapath's capacity, which the operator sizes (`maxFlows`,
/// `maxAttachments`, `maxHostPorts`, or the same flags of `cnibpf load` and `install`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dimension {
    /// Tracked connections.
    Flows,
    /// Attachments (container interfaces) on the node.
    Attachments,
    /// Port mappings of all attachments together.
    HostPorts,
}

impl Dimension {
    pub const ALL: [Self; 3] = [Self::Flows, Self::Attachments, Self::HostPorts];

    /// The configuration key.
    pub const fn key(self) -> &'static str {
        match self {
            Self::Flows => "maxFlows",
            Self::Attachments => "maxAttachments",
            Self::HostPorts => "maxHostPorts",
        }
    }

    /// The flag of `cnibpf load` and `install`.
    pub const fn flag(self) -> &'static str {
        match self {
            Self::Flows => "max-flows",
            Self::Attachments => "max-attachments",
            Self::HostPorts => "max-host-ports",
        }
    }

    /// The size of a datapath created without a setting: one that fits a small node (the
    /// maps at these sizes lock about 50 MiB, see docs/kubernetes.md, "Memory"). Each sized
    /// map's `max_entries` is its [`Sizing`] of this (a unit test holds them to it).
    pub const fn default_size(self) -> u32 {
        match self {
            Self::Flows => 65_536,
            Self::Attachments => 4_096,
            Self::HostPorts => 16_384,
        }
    }

    /// The sizes a setting may ask for. The smallest still serve a node with a handful of
    /// pods; the largest keep the datapath's memory within a few GiB.
    pub const fn bounds(self) -> (u32, u32) {
        match self {
            Self::Flows => (1_024, 4_194_304),
            Self::Attachments => (64, 65_536),
            Self::HostPorts => (64, 262_144),
        }
    }
}

/// How a map's size follows the operator's capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sizing {
    /// The size the object declares, whatever the capacity.
    Fixed,
    /// One entry per unit of the dimension, and the map a pinned datapath's size of the
    /// dimension is read from: one that every layout has.
    Measure(Dimension),
    /// This many entries per unit of the dimension.
    Times(Dimension, u32),
    /// A share of the dimension, never below [`MIN_SCALED`].
    Over(Dimension, u32),
}

/// The smallest size a share of a dimension gives.
pub const MIN_SCALED: u32 = 64;

impl Sizing {
    /// The dimension the map follows, if any.
    pub const fn dimension(self) -> Option<Dimension> {
        match self {
            Self::Fixed => None,
            Self::Measure(dimension) | Self::Times(dimension, _) | Self::Over(dimension, _) => {
                Some(dimension)
            }
        }
    }

    /// The map's entries for a dimension of `size`; `None` for a fixed map.
    pub const fn entries(self, size: u32) -> Option<u32> {
        match self {
            Self::Fixed => None,
            Self::Measure(_) => Some(size),
            Self::Times(_, factor) => Some(size.saturating_mul(factor)),
            Self::Over(_, divisor) => {
                let share = size / divisor;
                Some(if share < MIN_SCALED {
                    MIN_SCALED
                } else {
                    share
                })
            }
        }
    }
}

/// Where an entry of a map carries the owner id (`u64`, the `owners` key) of its attachment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnerField {
    /// Entries are not an attachment's (counters, settings), or are found another way.
    None,
    /// The key is the owner id.
    Key,
    /// At this byte offset of the value.
    Value(usize),
    /// At this byte offset of the key, in network byte order (an LPM trie's data).
    KeyBigEndian(usize),
}

/// A pinned map, as the object declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSpec {
    /// The pin name, under the instance's `pinPath` (and the eBPF static's name).
    pub name: &'static str,
    pub kind: MapKind,
    pub key_size: usize,
    pub value_size: usize,
    /// The size the object declares: the default of a sized map.
    pub max_entries: u32,
    pub sizing: Sizing,
    pub owner: OwnerField,
    /// The version of the map's key and value types, from 1: bumped when either changes, with
    /// a migration of the map's entries from the version before (userspace
    /// `backend::ebpf::compat::MAP_MIGRATIONS`). A change migrates that map alone; the
    /// versions the pinned maps have are in [`crate::datapath::versions`].
    pub version: u32,
}

impl MapSpec {
    /// A map of `kind` with keys `K` and values `V`, `max_entries` in the object, of a fixed
    /// size and no owner field; see [`Self::sized`] and [`Self::owned`].
    pub const fn new<K, V>(name: &'static str, kind: MapKind, max_entries: u32) -> Self {
        Self {
            name,
            kind,
            key_size: size_of::<K>(),
            value_size: size_of::<V>(),
            max_entries,
            sizing: Sizing::Fixed,
            owner: OwnerField::None,
            version: 1,
        }
    }

    /// An LPM trie of `K` (the kernel's key is `K` behind a 32-bit prefix length).
    pub const fn lpm_trie<K, V>(name: &'static str, max_entries: u32) -> Self {
        Self {
            key_size: 4 + size_of::<K>(),
            ..Self::new::<K, V>(name, MapKind::LpmTrie, max_entries)
        }
    }

    pub const fn sized(self, sizing: Sizing) -> Self {
        Self { sizing, ..self }
    }

    pub const fn owned(self, owner: OwnerField) -> Self {
        Self { owner, ..self }
    }

    /// The map's types at `version` (see [`Self::version`]).
    pub const fn at_version(self, version: u32) -> Self {
        Self { version, ..self }
    }

    /// The bytes of one CPU's value in a per-CPU map's lookup buffer (rounded up to 8, as the
    /// kernel lays them out), or of the value.
    pub const fn value_stride(&self) -> usize {
        if self.kind.per_cpu() {
            self.value_size.next_multiple_of(8)
        } else {
            self.value_size
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Dimension, MIN_SCALED, Sizing};
    use crate::maps;

    #[test]
    fn each_sized_map_declares_its_sizing_of_the_default_and_each_dimension_one_measure() {
        for spec in maps() {
            if let Some(dimension) = spec.sizing.dimension() {
                assert_eq!(
                    spec.sizing.entries(dimension.default_size()),
                    Some(spec.max_entries),
                    "{}",
                    spec.name
                );
            }
        }
        for dimension in Dimension::ALL {
            let measures = maps()
                .filter(|spec| spec.sizing == Sizing::Measure(dimension))
                .count();
            assert_eq!(measures, 1, "{dimension:?}");
        }
    }

    #[test]
    fn map_names_fit_the_kernels_and_map_versions_keys() {
        for spec in maps() {
            assert!(
                spec.name.len() <= crate::datapath::versions::MAX_NAME_LEN,
                "{}",
                spec.name
            );
            assert!(spec.version >= 1, "{}", spec.name);
        }
    }

    #[test]
    fn map_names_are_unique() {
        for spec in maps() {
            assert_eq!(maps().filter(|other| other.name == spec.name).count(), 1);
        }
    }

    #[test]
    fn shares_of_a_dimension_keep_a_floor_and_fixed_maps_follow_none() {
        assert_eq!(Sizing::Times(Dimension::Flows, 2).entries(100), Some(200));
        assert_eq!(
            Sizing::Over(Dimension::Flows, 8).entries(8_000),
            Some(1_000)
        );
        assert_eq!(
            Sizing::Over(Dimension::Flows, 8).entries(8),
            Some(MIN_SCALED)
        );
        assert_eq!(Sizing::Fixed.entries(100), None);
        assert_eq!(
            Sizing::Measure(Dimension::HostPorts).entries(100),
            Some(100)
        );
    }
}
