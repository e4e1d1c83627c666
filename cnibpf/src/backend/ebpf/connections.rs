//! The one connection table (`connections`) every capability keeps its part of a connection
//! in: a capability that goes takes its part off its attachment's connections, a connection
//! left with no part goes, and so does every expired one on the way (the GC sweep is the same
//! pass without a part to take). The datapath writes the entries; the plugin only removes.

use aya::maps::{HashMap, MapData};
use cnibpf_common::connections::{
    self, Connection, ConnectionKey, PART_DNAT, PART_FILTER, PART_HOST_FLOW, PART_SNAT,
};

use super::{
    EbpfBackend, batch, found, map_error, monotonic_now_ns, on_demand::OnDemand, read_error,
    remove_entry,
};
use crate::{backend::BackendError, paths::PinLayout};

/// Every part a connection may have.
const ALL_PARTS: u8 = PART_SNAT | PART_DNAT | PART_FILTER | PART_HOST_FLOW;

/// The connection table.
pub(super) struct ConnectionMaps {
    pub(super) connections: OnDemand<HashMap<MapData, ConnectionKey, Connection>>,
    /// Whether this invocation already removed the expired connections (a release of an
    /// attachment's parts does it in the same pass).
    swept: bool,
}

impl ConnectionMaps {
    pub(super) fn open(pins: &PinLayout) -> Result<Self, BackendError> {
        Ok(Self {
            connections: OnDemand::new(pins, connections::CONNECTIONS.name),
            swept: false,
        })
    }
}

/// The parts to take off `entry`: every one when it has expired (also one without parts, when
/// a stale translation was its last), else those `release` names.
fn parts_to_take(
    key: &ConnectionKey,
    entry: &Connection,
    now: u64,
    release: &impl Fn(&ConnectionKey, &Connection) -> u8,
) -> u8 {
    if entry.is_expired(key.protocol, now) {
        ALL_PARTS
    } else {
        release(key, entry)
    }
}

impl EbpfBackend {
    /// Takes the parts (`PART_*` bits) `release` names off each connection, given its key and
    /// entry (parts it does not have are no matter); a connection left without parts goes, and
    /// so does every expired one. The masquerade replies of each connection that loses its
    /// masquerade go with it.
    pub(super) fn release_connections(
        &mut self,
        release: impl Fn(&ConnectionKey, &Connection) -> u8,
    ) -> Result<(), BackendError> {
        let now = monotonic_now_ns();
        let entries = batch::entries(self.connections.connections.open()?)
            .map_err(read_error(connections::CONNECTIONS.name))?;
        for (key, read) in entries {
            if parts_to_take(&key, &read, now, &release) == 0 {
                continue;
            }
            // As it is now: the datapath may have moved it on, or replaced it with another
            // connection of the tuple, since the table was read.
            let map = self.connections.connections.open_mut()?;
            let Some(mut entry) = found(map.get(&key, 0), connections::CONNECTIONS.name)? else {
                continue;
            };
            let taken = parts_to_take(&key, &entry, now, &release);
            if taken == 0 {
                continue;
            }
            if taken & entry.parts & PART_SNAT != 0 {
                self.masquerade.forget_reply(&key, &entry)?;
            }
            entry.parts &= !taken;
            let map = self.connections.connections.open_mut()?;
            if entry.parts == 0 {
                remove_entry(map, &key, connections::CONNECTIONS.name)?;
            } else {
                // (A write racing a packet's may undo that packet's refresh of the entry: the
                // next packet refreshes it again.)
                map.insert(&key, &entry, 0)
                    .map_err(map_error("could not write map connections"))?;
            }
        }
        self.connections.swept = true;
        Ok(())
    }

    /// The GC sweep of expired connections (unless a release in this run did it already).
    pub(super) fn sweep_expired_connections(&mut self) -> Result<(), BackendError> {
        if self.connections.swept {
            return Ok(());
        }
        self.release_connections(|_, _| 0)
    }
}
