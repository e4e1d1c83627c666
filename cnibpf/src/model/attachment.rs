//! An attachment is one (network name, CNI_IFNAME, CNI_CONTAINERID): the unit that ADD creates
//! and DEL and GC remove. Its owner id tags every piece of state it creates.

use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attachment {
    pub network: String,
    pub container_id: String,
    pub ifname: String,
}

impl Attachment {
    pub fn new(network: &str, container_id: &str, ifname: &str) -> Self {
        Self {
            network: network.to_owned(),
            container_id: container_id.to_owned(),
            ifname: ifname.to_owned(),
        }
    }

    /// 64-bit FNV-1a of the three names, NUL separated: stable across invocations and hosts,
    /// so every run of the plugin finds the same attachment's state without a lookup table.
    /// Never zero, the datapath's owner of the host's own flows
    /// (`cnibpf_common::connections::HOST`).
    pub fn owner_id(&self) -> u64 {
        const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
        const PRIME: u64 = 0x0000_0100_0000_01b3;
        [&self.network, &self.ifname, &self.container_id]
            .iter()
            .flat_map(|part| part.bytes().chain([0]))
            .fold(OFFSET_BASIS, |hash, byte| {
                (hash ^ u64::from(byte)).wrapping_mul(PRIME)
            })
            .max(1)
    }
}

impl fmt::Display for Attachment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "network {:?}, container {:?}, ifname {:?}",
            self.network, self.container_id, self.ifname
        )
    }
}

/// The pod an attachment belongs to, when the runtime names it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pod {
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for Pod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_id_is_stable_and_separates_fields() {
        let a = Attachment::new("net", "abc", "eth0");
        assert_eq!(
            a.owner_id(),
            Attachment::new("net", "abc", "eth0").owner_id()
        );
        // Moving a byte between fields must change the id: the separator sees to that.
        assert_ne!(
            a.owner_id(),
            Attachment::new("ne", "tabc", "eth0").owner_id()
        );
        assert_ne!(
            a.owner_id(),
            Attachment::new("net", "abc", "eth1").owner_id()
        );
        assert_eq!(
            a.to_string(),
            "network \"net\", container \"abc\", ifname \"eth0\""
        );
    }
}
