//! What the backend holds, for `cnibpf inspect`, CHECK and GC: the records for who is attached
//! and what they asked for, the hostport maps for what is installed, the filter chains (with
//! their counters) for what they run.

use std::net::IpAddr;

use cnibpf_common::drops::{DropCount, DropReason};
use nftables::schema::Rule;

use super::{
    LOCALNET_GUARD_CHAIN, NftablesBackend, NftablesError, conntrack,
    filter::{filter_of, write},
    guard, guard_chain, nft, parse_owner, reject_chain,
    scrape::{add_drops, counted_drops},
    sources,
};
use crate::{
    backend::{
        AttachmentRecord, BackendError, FilterRecord, FlowTable, GONE_IFINDEX, Inspect,
        MATCH_EVENTS_SUPPRESSED, MasqueradeRecord, NetworkMembers, REJECT_ANSWERS_SENT,
        REJECT_ANSWERS_SUPPRESSED, SourceCheckRecord, UplinkAddresses, is_link_local,
    },
    model::{ResolvedMapping, Target},
    netlink,
};

impl Inspect for NftablesBackend {
    fn attachments(&self) -> Result<Vec<AttachmentRecord>, BackendError> {
        let mut out = Vec::new();
        for (owner, record) in self.store.records() {
            let Some(attachment) = parse_owner(&record.owner) else {
                continue;
            };
            let host_ifindex = netlink::index_of(&record.host)
                .map_err(|source| BackendError::Interface {
                    action: format!(
                        "could not look up interface {} of {attachment}",
                        record.host
                    ),
                    source: Box::new(source),
                })?
                // fail-closed: `index_of` kept the errors; only a gone interface gets here.
                .unwrap_or(GONE_IFINDEX);
            out.push(AttachmentRecord {
                owner,
                host_ifindex,
                attachment,
                pod: record.pod.clone(),
                host_ifname: record.host.clone(),
            });
        }
        Ok(out)
    }

    /// The state file's answer, read once per operation.
    fn holds(&self, owner: u64) -> Result<bool, BackendError> {
        Ok(self.store.record(owner).is_some())
    }

    fn port_mappings(&self) -> Result<Vec<(u64, ResolvedMapping)>, BackendError> {
        Ok(self
            .listing()?
            .mappings()
            .into_iter()
            .filter_map(|(owner, mapping)| Some((parse_owner(&owner)?.owner_id(), mapping)))
            .collect())
    }

    fn masquerades(&self) -> Result<Vec<(u64, MasqueradeRecord)>, BackendError> {
        Ok(self
            .store
            .records()
            .filter_map(|(owner, record)| {
                Some((
                    owner,
                    MasqueradeRecord {
                        masquerade: record.masquerade.clone()?,
                        flows: 0,
                    },
                ))
            })
            .collect())
    }

    fn uplink_addresses(&self) -> Result<Vec<UplinkAddresses>, BackendError> {
        let addresses =
            netlink::addresses().map_err(|source| BackendError::HostAddresses(Box::new(source)))?;
        let mut uplinks = Vec::new();
        for element in self.listing()?.elements("uplinks") {
            let nftables::expr::Expression::String(name) = &element.key else {
                continue;
            };
            // An uplink that is gone masquerades to nothing: not listed.
            let index = netlink::index_of(name).map_err(|source| BackendError::Interface {
                action: format!("could not look up uplink {name}"),
                source: Box::new(source),
            })?;
            uplinks.extend(index.map(|index| (index, name.to_string())));
        }
        Ok(uplinks
            .into_iter()
            .map(|(index, name)| UplinkAddresses {
                ifindex: index,
                ifname: Some(name),
                v4: addresses.iter().find_map(|(owner, addr)| match addr {
                    IpAddr::V4(addr) if *owner == index => Some(*addr),
                    _ => None,
                }),
                v6: addresses.iter().find_map(|(owner, addr)| match addr {
                    IpAddr::V6(addr) if *owner == index && !is_link_local(IpAddr::V6(*addr)) => {
                        Some(*addr)
                    }
                    _ => None,
                }),
            })
            .collect())
    }

    fn filters(&self) -> Result<Vec<(u64, FilterRecord)>, BackendError> {
        let listing = self.listing()?;
        let mut out = Vec::new();
        for (owner, record) in self.store.records() {
            if record.filter.is_none() {
                continue;
            }
            if let Some(filter) = filter_of(listing, owner)? {
                out.push((owner, filter));
            }
        }
        Ok(out)
    }

    fn source_checks(&self) -> Result<Vec<(u64, SourceCheckRecord)>, BackendError> {
        self.source_check_records()
    }

    /// The answers the attachments' reject chains sent and those their limits suppressed; the
    /// new connections the log chains' limits kept from the log.
    fn counters(&self) -> Result<Vec<(&'static str, u64)>, BackendError> {
        let listing = self.listing()?;
        let counted = |chain: &str, comments: &[&str]| -> u64 {
            listing
                .rules(chain)
                .iter()
                .filter(|rule| {
                    rule.comment
                        .as_deref()
                        .is_some_and(|comment| comments.contains(&comment))
                })
                .filter_map(|rule| nft::counter_of(&rule.expr))
                .map(|(packets, _)| packets)
                .sum()
        };
        let (mut sent, mut suppressed, mut unlogged) = (0, 0, 0);
        for (owner, _) in self.store.records() {
            let rejecting = reject_chain(owner);
            sent += counted(&rejecting, &[write::RESET, write::PROHIBITED]);
            suppressed += counted(&rejecting, &[write::SUPPRESSED]);
            let logging = format!("l_{owner:016x}_");
            for chain in listing
                .chain_names()
                .filter(|chain| chain.starts_with(&logging))
            {
                unlogged += counted(chain, &[write::SUPPRESSED]);
            }
        }
        Ok(vec![
            (REJECT_ANSWERS_SENT, sent),
            (REJECT_ANSWERS_SUPPRESSED, suppressed),
            (MATCH_EVENTS_SUPPRESSED, unlogged),
        ])
    }

    /// The filter's drops from its chains' counters, the source check's and the masquerade
    /// guard's from their chains' in table `netdev cnibpf`, the localnet guard's from its rule. What the kernel's own
    /// connection tracking and NAT drop (a full table, no port left) is the kernel's to count.
    fn drops(&self) -> Result<Option<Vec<(DropReason, DropCount)>>, BackendError> {
        let mut drops = counted_drops();
        let mut add = |reason, counted| add_drops(&mut drops, reason, counted);
        for (_, record) in self.filters()? {
            for (rule, hits) in record.filter.rules.iter().zip(&record.hits) {
                match rule.target {
                    Target::Drop => add(DropReason::FilterRule, *hits),
                    Target::Reject => add(DropReason::FilterReject, *hits),
                    Target::Allow => {}
                }
            }
            if record.filter.default == Target::Drop {
                add(DropReason::FilterDefault, record.default_hits);
            }
        }
        for (reason, counted) in sources::dropped_by_reason()? {
            add(reason, counted);
        }
        let listing = self.listing()?;
        if let Some(counted) = counted_by(listing.rules(LOCALNET_GUARD_CHAIN)) {
            add(DropReason::LocalnetGuard, counted);
        }
        let guards = self.netdev_listing()?;
        let guard = guard::drop_comment();
        for (owner, _) in self.store.records() {
            let dropping = guards
                .rules(&guard_chain(owner))
                .iter()
                .filter(|rule| rule.comment.as_deref() == Some(guard.as_str()));
            if let Some(counted) = counted_by(&dropping.cloned().collect::<Vec<_>>()) {
                add(DropReason::MasqueradeUntranslatable, counted);
            }
        }
        Ok(Some(drops.into_iter().collect()))
    }

    /// Each network's members as the records hold them: the attachments' addresses, which
    /// the transaction that wrote a record put into its network's sets.
    fn network_members(&self) -> Result<Vec<NetworkMembers>, BackendError> {
        let mut networks: Vec<NetworkMembers> = Vec::new();
        for (owner, record) in self.store.records() {
            let Some(attachment) = parse_owner(&record.owner) else {
                continue;
            };
            let members = record.networks.iter().map(|net| (net.addr(), owner));
            match networks
                .iter_mut()
                .find(|held| held.network == attachment.network)
            {
                Some(held) => held.members.extend(members),
                None => networks.push(NetworkMembers {
                    network: attachment.network,
                    members: members.collect(),
                }),
            }
        }
        for network in &mut networks {
            network.members.sort();
        }
        networks.sort_by(|a, b| a.network.cmp(&b.network));
        Ok(networks)
    }

    /// The kernel's connection tracking, which the nftables datapath relies on for NAT and the
    /// filter's state.
    fn flow_tables(&self) -> Result<Vec<FlowTable>, BackendError> {
        let Some((entries, capacity)) = conntrack::fill().map_err(NftablesError::ConntrackFill)?
        else {
            return Ok(Vec::new());
        };
        Ok(vec![FlowTable {
            name: "conntrack",
            entries,
            capacity,
        }])
    }
}

/// The (packets, bytes) of the counter of the first counted rule among `rules`.
fn counted_by(rules: &[Rule<'static>]) -> Option<(u64, u64)> {
    rules.iter().find_map(|rule| nft::counter_of(&rule.expr))
}
