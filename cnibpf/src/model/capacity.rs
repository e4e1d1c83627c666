//! How much the eBPF datapath holds: its maps are preallocated, so their sizes are the memory
//! it locks. An operator sizes three dimensions (`maxFlows`, `maxAttachments`, `maxHostPorts`,
//! or the same flags of `cnibpf load` and `install`); each map follows one of them.

use std::fmt;

pub use cnibpf_common::map_spec::Dimension;

/// `value` as a size of `dimension`, or why it is not one.
pub fn checked_size(dimension: Dimension, value: u64) -> Result<u32, String> {
    let (low, high) = dimension.bounds();
    u32::try_from(value)
        .ok()
        .filter(|size| (low..=high).contains(size))
        .ok_or_else(|| format!("must be between {low} and {high}, got {value}"))
}

/// The capacity an operator asks for: a dimension left `None` keeps the size a loaded
/// datapath has (its default when the datapath is created), so that a network that does not
/// say never resizes what another one, or `cnibpf load`, set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Capacity {
    pub flows: Option<u32>,
    pub attachments: Option<u32>,
    pub host_ports: Option<u32>,
}

impl Capacity {
    pub fn get(&self, dimension: Dimension) -> Option<u32> {
        match dimension {
            Dimension::Flows => self.flows,
            Dimension::Attachments => self.attachments,
            Dimension::HostPorts => self.host_ports,
        }
    }

    /// Checked sizes for the dimensions given (`None` where not given).
    pub fn parse(
        flows: Option<u64>,
        attachments: Option<u64>,
        host_ports: Option<u64>,
    ) -> Result<Self, (Dimension, String)> {
        let check = |dimension: Dimension, value: Option<u64>| {
            value
                .map(|value| checked_size(dimension, value))
                .transpose()
                .map_err(|reason| (dimension, reason))
        };
        Ok(Self {
            flows: check(Dimension::Flows, flows)?,
            attachments: check(Dimension::Attachments, attachments)?,
            host_ports: check(Dimension::HostPorts, host_ports)?,
        })
    }

    /// The dimensions given, as configuration keys and values (what `install` writes into
    /// cnibpf's entry).
    pub fn keys(&self) -> impl Iterator<Item = (&'static str, u32)> + '_ {
        Dimension::ALL
            .into_iter()
            .filter_map(|dimension| Some((dimension.key(), self.get(dimension)?)))
    }
}

/// The dimensions given, e.g. `maxFlows 65536, maxAttachments 4096`.
impl fmt::Display for Capacity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (position, (key, size)) in self.keys().enumerate() {
            if position > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{key} {size}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_outside_the_bounds_are_refused_with_the_bounds() {
        assert_eq!(checked_size(Dimension::Flows, 65_536), Ok(65_536));
        assert_eq!(
            checked_size(Dimension::Flows, 1_000),
            Err("must be between 1024 and 4194304, got 1000".to_owned())
        );
        assert!(checked_size(Dimension::Attachments, u64::from(u32::MAX) + 1).is_err());
        assert!(checked_size(Dimension::HostPorts, 262_145).is_err());
        for dimension in Dimension::ALL {
            let (low, high) = dimension.bounds();
            assert!(
                (low..=high).contains(&dimension.default_size()),
                "{dimension:?}"
            );
        }
    }

    #[test]
    fn a_capacity_names_the_key_it_refuses_and_lists_only_what_was_given() {
        assert_eq!(
            Capacity::parse(None, Some(10), None),
            Err((
                Dimension::Attachments,
                "must be between 64 and 65536, got 10".to_owned()
            ))
        );
        let capacity = Capacity::parse(Some(131_072), None, Some(1_024)).expect("valid");
        assert_eq!(
            capacity.keys().collect::<Vec<_>>(),
            [("maxFlows", 131_072), ("maxHostPorts", 1_024)]
        );
        assert_eq!(Capacity::default().keys().count(), 0);
        assert_eq!(capacity.to_string(), "maxFlows 131072, maxHostPorts 1024");
    }
}
