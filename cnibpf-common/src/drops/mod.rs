//! `drop_stats`: every packet the eBPF datapath drops, counted by why.
//!
//! A per-CPU array. Key: `u32` [`DropReason`] value. Value: [`DropCount`]. Written by the
//! programs at each place they return `TC_ACT_SHOT`, and only there (a packet handed to the
//! stack untranslated is not a drop); read by `cnibpf inspect` and `cnibpf metrics`, which
//! sum the CPUs. The nftables backend counts the same reasons on its drop rules.

pub mod budget;
pub mod events;

pub use budget::{DropEventBudget, EVENT_BUDGET};
pub use events::{EVENTS, FilterEvent};

use crate::impl_pod;
use crate::map_spec::{MapKind, MapSpec};

/// One slot per [`DropReason`] value, with room for reasons to come.
pub const DROP_STATS: MapSpec =
    MapSpec::new::<u32, DropCount>("drop_stats", MapKind::PerCpuArray, 32);

/// The maps of drop accounting.
pub const MAPS: [MapSpec; 3] = [DROP_STATS, EVENTS, EVENT_BUDGET];

/// Why a packet was dropped. The values are stable: they index `drop_stats` and are the
/// `reason` of a `filter_events` record, which every build since the first monitor reads.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum DropReason {
    /// A filter rule with target DROP matched (the attachment's policy).
    FilterRule = 1,
    /// No rule matched and the filter's default verdict is DROP.
    FilterDefault = 2,
    /// A later IP fragment whose first fragment the filter did not let through.
    FilterFragment = 3,
    /// The container sent an IPv4 or IPv6 packet from an address not its own.
    SourceCheckAddress = 4,
    /// The container sent an ARP packet with a sender address not its own.
    SourceCheckArp = 5,
    /// The container advertised (IPv6 neighbour advertisement) an address not its own.
    SourceCheckNeighbourAdvertisement = 6,
    /// The container sent a frame that is neither IP nor ARP, or whose ARP header is not
    /// IPv4 over Ethernet, or an IPv6 packet whose headers the check cannot walk.
    SourceCheckNotIp = 7,
    /// A filtered packet whose headers could not be read to judge it (fail closed).
    FilterUnreadable = 8,
    /// Masquerade found no free source port for a new flow within its search bound.
    MasqueradePortsExhausted = 9,
    /// Masquerade would send through an uplink that has no address of the packet's family.
    MasqueradeNoUplinkAddress = 10,
    /// A rewrite helper failed after the packet was partly changed.
    RewriteFailed = 11,
    /// nftables only: a packet from elsewhere than the loopback for 127.0.0.0/8 (the guard
    /// against CVE-2020-8558 beside 127.0.0.1 hostPorts).
    LocalnetGuard = 12,
    /// A packet from a masqueraded container that masquerade cannot translate — one no
    /// connection it tracks explains (what netfilter's conntrack calls INVALID: an
    /// out-of-window segment, a RST or FIN of an unknown tuple, a bad flag mix), an ICMP error
    /// about a connection never seen, a protocol without ports on eBPF — dropped at the uplink
    /// rather than sent out with the container's own address.
    MasqueradeUntranslatable = 13,
    /// A filter rule with target REJECT matched: the packet is dropped, and answered (a TCP
    /// reset, an ICMP "administratively prohibited") while the attachment's answer budget
    /// lasts.
    FilterReject = 14,
}

impl DropReason {
    pub const ALL: [Self; 14] = [
        Self::FilterRule,
        Self::FilterDefault,
        Self::FilterFragment,
        Self::SourceCheckAddress,
        Self::SourceCheckArp,
        Self::SourceCheckNeighbourAdvertisement,
        Self::SourceCheckNotIp,
        Self::FilterUnreadable,
        Self::MasqueradePortsExhausted,
        Self::MasqueradeNoUplinkAddress,
        Self::RewriteFailed,
        Self::LocalnetGuard,
        Self::MasqueradeUntranslatable,
        Self::FilterReject,
    ];

    pub const fn from_u8(value: u8) -> Option<Self> {
        let mut index = 0;
        while index < Self::ALL.len() {
            if Self::ALL[index] as u8 == value {
                return Some(Self::ALL[index]);
            }
            index += 1;
        }
        None
    }

    /// The reason as metrics, JSON and `inspect` spell it.
    pub const fn name(self) -> &'static str {
        match self {
            Self::FilterRule => "filter_rule",
            Self::FilterDefault => "filter_default",
            Self::FilterFragment => "filter_fragment",
            Self::SourceCheckAddress => "source_check_address",
            Self::SourceCheckArp => "source_check_arp",
            Self::SourceCheckNeighbourAdvertisement => "source_check_neighbour_advertisement",
            Self::SourceCheckNotIp => "source_check_not_ip",
            Self::FilterUnreadable => "filter_unreadable",
            Self::MasqueradePortsExhausted => "masquerade_ports_exhausted",
            Self::MasqueradeNoUplinkAddress => "masquerade_no_uplink_address",
            Self::RewriteFailed => "rewrite_failed",
            Self::LocalnetGuard => "localnet_guard",
            Self::MasqueradeUntranslatable => "masquerade_untranslatable",
            Self::FilterReject => "filter_reject",
        }
    }

    pub const fn key(self) -> u32 {
        self as u32
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DropCount {
    pub packets: u64,
    pub bytes: u64,
}
const _: () = assert!(size_of::<DropCount>() == 16);

impl_pod!(DropCount);

const _: () = {
    let mut index = 0;
    while index < DropReason::ALL.len() {
        assert!((DropReason::ALL[index] as u32) < DROP_STATS.max_entries);
        index += 1;
    }
};

#[cfg(test)]
mod tests {
    use super::DropReason;

    #[test]
    fn every_reason_reads_back_and_has_its_own_name() {
        for reason in DropReason::ALL {
            assert_eq!(DropReason::from_u8(reason as u8), Some(reason));
            let same_name = DropReason::ALL
                .iter()
                .filter(|other| other.name() == reason.name())
                .count();
            assert_eq!(same_name, 1, "{reason:?}");
        }
        assert_eq!(DropReason::from_u8(0), None);
    }
}
