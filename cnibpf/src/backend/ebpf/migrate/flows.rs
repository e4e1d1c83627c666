//! The connection tables of layouts 6 to 9 — `masq_flows`, `nat_flows`, `filter_flows`, one
//! per feature, their types unchanged across those layouts — merged into layout 10's one
//! table, `connections`: each old entry becomes its feature's part of its connection's entry.
//!
//! A part is only ever added where the connection has none of it, never written over: the
//! merge runs once before the links move to the new programs and once after (what the old
//! programs recorded in between), and again when a killed migration resumes, and none of those
//! passes undoes what the new programs have written since.

use std::path::Path;

use cnibpf_common::{
    address::Address,
    compat::retired_flows::{
        FILTER_FLOWS, FilterFlowKeyV9, FilterFlowV9, FlowKeyV9, MASQ_FLOWS, MasqFlowV9, NAT_FLOWS,
        NatFlowV9,
    },
    connections::{
        self, Connection, ConnectionKey, PART_DNAT, PART_FILTER, PART_SNAT,
        conntrack::STATE_ESTABLISHED,
    },
    filter::{DIRECTION_EGRESS, DIRECTION_INGRESS},
};

use super::open_old;
use crate::backend::{
    BackendError,
    ebpf::{EbpfBackend, batch, found, map_error, read_error},
};

/// The old connection tables, set aside by every migration from layouts 6 to 9.
pub const TABLES: [&str; 3] = [MASQ_FLOWS, NAT_FLOWS, FILTER_FLOWS];

/// What a connection's entry is to be with `part` added by `add`: `None` when it has the part
/// already, or is another attachment's. A connection without an entry gets one of `owner`,
/// opened `origin`-wards, in `state`, last seen at `last_seen_ns`.
fn with_part(
    existing: Option<Connection>,
    owner: u64,
    part: u8,
    opened: (u8, u8, u8, u64),
    add: impl FnOnce(&mut Connection),
) -> Option<Connection> {
    let (origin, state, fin, last_seen_ns) = opened;
    let mut connection = match existing {
        Some(connection) if connection.owner != owner || connection.parts & part != 0 => {
            return None;
        }
        Some(connection) => connection,
        None => Connection {
            owner,
            last_seen_ns,
            origin,
            state,
            fin,
            ..Connection::default()
        },
    };
    add(&mut connection);
    connection.parts |= part;
    Some(connection)
}

/// A masqueraded flow as its connection's SNAT part (the container opened it).
fn masquerade(existing: Option<Connection>, flow: &MasqFlowV9) -> Option<Connection> {
    let opened = (DIRECTION_EGRESS, flow.state, flow.fin, flow.last_seen_ns);
    with_part(existing, flow.owner, PART_SNAT, opened, |connection| {
        connection.nat_addr = Address::from_bytes(flow.nat_addr);
        connection.uplink_ifindex = flow.uplink_ifindex;
        connection.nat_port = flow.nat_port;
    })
}

/// A hostPort translation as its connection's DNAT part (the client opened it; the old table
/// kept no state, so it is taken as established, as its idle timeout was).
fn translation(existing: Option<Connection>, flow: &NatFlowV9) -> Option<Connection> {
    let opened = (DIRECTION_INGRESS, STATE_ESTABLISHED, 0, flow.last_seen_ns);
    with_part(existing, flow.owner, PART_DNAT, opened, |connection| {
        connection.orig_addr = Address::from_bytes(flow.orig_addr);
        connection.peer_addr = Address::from_bytes(flow.peer_addr);
        connection.peer_ifindex = flow.peer_ifindex;
        connection.orig_port = flow.orig_port;
        connection.peer_port = flow.peer_port;
        connection.peer_mac = flow.peer_mac;
        connection.gateway_mac = flow.gateway_mac;
    })
}

/// The filter's tracked connection as its part.
fn filtered(existing: Option<Connection>, flow: &FilterFlowV9) -> Option<Connection> {
    let opened = (flow.origin, flow.state, flow.fin, flow.last_seen_ns);
    with_part(existing, flow.owner, PART_FILTER, opened, |connection| {
        connection.generation = flow.generation;
        connection.rule = flow.rule;
        connection.verdict = flow.verdict;
        connection.last_verdict = flow.last_verdict;
    })
}

impl EbpfBackend {
    /// Merges every entry of the old connection tables set aside in `aside` (those the state
    /// had) into `connections`, adding only parts the connections lack.
    pub(super) fn merge_flows(&mut self, aside: &Path) -> Result<(), BackendError> {
        for (name, merge) in [
            (
                MASQ_FLOWS,
                Self::merge_masquerade as fn(&mut Self, &Path) -> _,
            ),
            (NAT_FLOWS, Self::merge_translations),
            (FILTER_FLOWS, Self::merge_filtered),
        ] {
            let path = aside.join(name);
            let held = path.try_exists().map_err(|source| BackendError::Pin {
                action: format!("could not look for {}", path.display()),
                source: Box::new(source),
            })?;
            if held {
                merge(self, &path)?;
            }
        }
        Ok(())
    }

    fn merge_masquerade(&mut self, path: &Path) -> Result<(), BackendError> {
        let old = open_old::<FlowKeyV9, MasqFlowV9>(path)?;
        for (key, flow) in batch::entries(&old).map_err(read_error(MASQ_FLOWS))? {
            let key = key.connection();
            let merged = masquerade(self.connection(&key)?, &flow);
            self.write_connection(&key, merged)?;
        }
        Ok(())
    }

    fn merge_translations(&mut self, path: &Path) -> Result<(), BackendError> {
        let old = open_old::<FlowKeyV9, NatFlowV9>(path)?;
        for (key, flow) in batch::entries(&old).map_err(read_error(NAT_FLOWS))? {
            let key = key.connection();
            let merged = translation(self.connection(&key)?, &flow);
            self.write_connection(&key, merged)?;
        }
        Ok(())
    }

    fn merge_filtered(&mut self, path: &Path) -> Result<(), BackendError> {
        let old = open_old::<FilterFlowKeyV9, FilterFlowV9>(path)?;
        for (old_key, flow) in batch::entries(&old).map_err(read_error(FILTER_FLOWS))? {
            let key = ConnectionKey {
                container_addr: Address::from_bytes(old_key.container_addr),
                remote_addr: Address::from_bytes(old_key.remote_addr),
                container_port: old_key.container_port,
                remote_port: old_key.remote_port,
                protocol: old_key.protocol,
                family: old_key.family,
                _pad: 0,
            };
            let merged = filtered(self.connection(&key)?, &flow);
            self.write_connection(&key, merged)?;
        }
        Ok(())
    }

    fn connection(&self, key: &ConnectionKey) -> Result<Option<Connection>, BackendError> {
        found(
            self.connections.connections.get(key, 0),
            connections::CONNECTIONS.name,
        )
    }

    fn write_connection(
        &mut self,
        key: &ConnectionKey,
        merged: Option<Connection>,
    ) -> Result<(), BackendError> {
        let Some(connection) = merged else {
            return Ok(());
        };
        self.connections
            .connections
            .insert(key, &connection, 0)
            .map_err(map_error("could not write map connections"))
    }
}

#[cfg(test)]
mod tests {
    use cnibpf_common::connections::conntrack::{SIDE_ORIGIN, STATE_OPENING};

    use super::*;

    fn masqueraded() -> MasqFlowV9 {
        MasqFlowV9 {
            nat_addr: [203, 0, 113, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            owner: 7,
            last_seen_ns: 1_000,
            uplink_ifindex: 3,
            nat_port: 40_001,
            state: STATE_OPENING,
            fin: SIDE_ORIGIN,
        }
    }

    #[test]
    fn a_masqueraded_flow_becomes_its_connections_snat_part() {
        let connection = masquerade(None, &masqueraded()).expect("a new entry");
        assert_eq!(connection.parts, PART_SNAT);
        assert_eq!(
            (connection.owner, connection.last_seen_ns, connection.origin),
            (7, 1_000, DIRECTION_EGRESS)
        );
        assert_eq!(
            (connection.state, connection.fin),
            (STATE_OPENING, SIDE_ORIGIN)
        );
        assert_eq!(
            (connection.nat_port, connection.uplink_ifindex),
            (40_001, 3)
        );
        assert_eq!(connection.nat_addr.bytes, masqueraded().nat_addr);
    }

    #[test]
    fn parts_of_one_connection_meet_in_one_entry() {
        let snat = masquerade(None, &masqueraded()).expect("a new entry");
        let filter = FilterFlowV9 {
            owner: 7,
            generation: 5,
            last_seen_ns: 2_000,
            rule: 1,
            origin: DIRECTION_EGRESS,
            verdict: 1,
            state: STATE_ESTABLISHED,
            last_verdict: 1,
            ..FilterFlowV9::default()
        };
        let both = filtered(Some(snat), &filter).expect("the filter's part added");
        assert_eq!(both.parts, PART_SNAT | PART_FILTER);
        assert_eq!((both.generation, both.rule, both.verdict), (5, 1, 1));
        assert_eq!(both.nat_port, 40_001, "the masquerade part kept");
        assert_eq!(
            (both.last_seen_ns, both.state),
            (1_000, STATE_OPENING),
            "the state the entry has is kept"
        );
    }

    #[test]
    fn a_part_is_never_written_over_nor_added_to_anothers_connection() {
        let snat = masquerade(None, &masqueraded()).expect("a new entry");
        let newer = MasqFlowV9 {
            nat_port: 40_002,
            ..masqueraded()
        };
        assert!(
            masquerade(Some(snat), &newer).is_none(),
            "a part already there (the new programs', or a resumed run's) stays"
        );
        let elsewhere = MasqFlowV9 {
            owner: 8,
            ..masqueraded()
        };
        let translated = NatFlowV9 {
            owner: 8,
            ..NatFlowV9::default()
        };
        assert!(translation(Some(snat), &translated).is_none());
        assert!(masquerade(Some(snat), &elsewhere).is_none());
    }

    #[test]
    fn a_translation_is_opened_from_outside_and_established() {
        let flow = NatFlowV9 {
            owner: 9,
            last_seen_ns: 3_000,
            orig_port: 8080,
            peer_port: 40_000,
            peer_ifindex: 12,
            ..NatFlowV9::default()
        };
        let connection = translation(None, &flow).expect("a new entry");
        assert_eq!(connection.parts, PART_DNAT);
        assert_eq!(
            (connection.origin, connection.state),
            (DIRECTION_INGRESS, STATE_ESTABLISHED)
        );
        assert_eq!(
            (
                connection.orig_port,
                connection.peer_port,
                connection.peer_ifindex
            ),
            (8080, 40_000, 12)
        );
    }
}
