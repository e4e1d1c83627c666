//! The instance's state file: every attachment's record and what the instance switched on,
//! outside the ruleset (as netavark keeps its own), so that a firewall reload that flushes the
//! ruleset takes nothing that cannot be put back. The ruleset is derived from it; the table's
//! comment names the state it was derived from (`instance`), so a table and a state file that
//! do not belong together are never mixed.
//!
//! Written atomically (a reader sees the old state or the new, whole) under the instance lock;
//! a file that cannot be read is an error, never an empty state. Removed with the table.

use std::{
    collections::BTreeMap,
    fs, io,
    net::IpAddr,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use super::{LAYOUT, NftablesError, record::Record};
use crate::paths::PinLayout;

/// What the state file holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct State {
    /// The layout of the table derived from it ([`LAYOUT`]).
    pub layout: String,
    /// Names the table made from this state (its comment says it too).
    pub instance: u64,
    /// Every attachment's record, by owner id.
    pub attachments: BTreeMap<OwnerId, Record>,
    /// The uplinks the instance masquerades through.
    pub uplinks: Vec<String>,
    /// Bridges whose netfilter calls cnibpf switched on (`nf_call_iptables`), to switch off
    /// with the table.
    pub filtered_bridges: Vec<String>,
    /// Interfaces whose `route_localnet` cnibpf switched on, likewise.
    pub localnet_interfaces: Vec<String>,
    /// The interfaces whose addresses are not the node's, as the last ADD or CHECK said.
    pub service_interfaces: Vec<String>,
    /// The node's addresses as last put into the table (`node_addrs4`/`6`).
    pub node_addresses: Vec<IpAddr>,
}

/// The state file of one instance, as read at the start of an operation.
#[derive(Debug)]
pub struct Store {
    path: PathBuf,
    /// `None`: there is no file.
    state: Option<State>,
}

impl Store {
    /// The state of the instance at `pins`: absent (no file) or whole; unreadable is an error.
    pub fn load(pins: &PinLayout) -> Result<Self, NftablesError> {
        Self::load_at(pins.nftables_state_file())
    }

    fn load_at(path: PathBuf) -> Result<Self, NftablesError> {
        let state = match fs::read(&path) {
            Ok(bytes) => {
                Some(
                    serde_json::from_slice(&bytes).map_err(|error| NftablesError::State {
                        path: path.clone(),
                        source: io::Error::new(io::ErrorKind::InvalidData, error),
                    })?,
                )
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => None,
            Err(source) => return Err(NftablesError::State { path, source }),
        };
        Ok(Self { path, state })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The state, when there is a file.
    pub fn state(&self) -> Option<&State> {
        self.state.as_ref()
    }

    /// The state as it is, or a new one for a table this operation makes.
    pub fn state_or_new(&self) -> Result<State, NftablesError> {
        match &self.state {
            Some(state) => Ok(state.clone()),
            None => Ok(State {
                layout: LAYOUT.to_owned(),
                instance: new_instance_id().map_err(|source| NftablesError::State {
                    path: self.path.clone(),
                    source,
                })?,
                ..State::default()
            }),
        }
    }

    pub fn record(&self, owner: u64) -> Option<&Record> {
        self.state.as_ref()?.attachments.get(&OwnerId(owner))
    }

    /// Every record, by owner id.
    pub fn records(&self) -> impl Iterator<Item = (u64, &Record)> {
        self.state
            .iter()
            .flat_map(|state| &state.attachments)
            .map(|(owner, record)| (owner.0, record))
    }

    pub fn has_records(&self) -> bool {
        self.state
            .as_ref()
            .is_some_and(|state| !state.attachments.is_empty())
    }

    /// Makes `state` the instance's state, on disk first; `None` removes the file. What a
    /// writer killed mid-write left beside it goes first (the caller holds the instance lock,
    /// which every writer holds).
    pub fn save(&mut self, state: Option<State>) -> Result<(), NftablesError> {
        if state == self.state {
            return Ok(());
        }
        let reaped = crate::atomic_file::reap_temporaries(&self.path).map(drop);
        let written = reaped.and_then(|()| match &state {
            Some(state) => serde_json::to_vec_pretty(state)
                .map_err(io::Error::other)
                .and_then(|mut text| {
                    text.push(b'\n');
                    if let Some(directory) = self.path.parent() {
                        fs::create_dir_all(directory)?;
                    }
                    crate::atomic_file::replace(&self.path, &text, 0o600)
                }),
            None => match fs::remove_file(&self.path) {
                Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
                other => other,
            },
        });
        written.map_err(|source| NftablesError::State {
            path: self.path.clone(),
            source,
        })?;
        self.state = state;
        Ok(())
    }
}

/// An owner id, as the state file keys records by it: 16 hex digits, as in chain names. A key
/// that is not one makes the file unreadable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct OwnerId(pub u64);

impl Serialize for OwnerId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&format_args!("{:016x}", self.0))
    }
}

impl<'de> Deserialize<'de> for OwnerId {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        u64::from_str_radix(&text, 16)
            .map(Self)
            .map_err(|_| serde::de::Error::custom(format!("{text:?} is not an owner id")))
    }
}

/// A new table's instance id: random, so that a table made from another state (another
/// instance's, or one removed and made again) never passes for this one's.
fn new_instance_id() -> io::Result<u64> {
    let mut bytes = [0u8; 8];
    // SAFETY: the buffer is valid for its length; getrandom(2) writes at most that many bytes.
    let read = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if read != 8 {
        return Err(io::Error::last_os_error());
    }
    Ok(u64::from_ne_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_round_trips_and_an_absent_file_is_no_state() {
        let directory = std::env::temp_dir().join(format!("cnibpf-store-{}", std::process::id()));
        fs::create_dir_all(&directory).expect("created");
        let mut store = Store::load_at(directory.join("state.json")).expect("no file");
        assert!(store.state().is_none());
        let mut state = store.state_or_new().expect("a new state");
        state.attachments.insert(
            OwnerId(7),
            Record {
                owner: "n/eth0/c".to_owned(),
                host: "veth1".to_owned(),
                ..Record::default()
            },
        );
        store.save(Some(state.clone())).expect("written");
        let read = Store::load_at(store.path().to_owned()).expect("readable");
        assert_eq!(read.state(), Some(&state));
        assert_eq!(
            read.records().map(|(owner, _)| owner).collect::<Vec<_>>(),
            [7]
        );
        fs::write(read.path(), b"{\"layout\":").expect("written");
        assert!(
            Store::load_at(read.path().to_owned()).is_err(),
            "unreadable"
        );
        store.save(None).expect("removed");
        assert!(!store.path().exists());
        fs::remove_dir_all(&directory).expect("cleaned up");
    }
}
