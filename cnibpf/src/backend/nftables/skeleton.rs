//! The table's skeleton: its chains and hooks as this layout writes them, the localnet guard,\n//! and how a table's comment names its layout.

use super::{LAYOUT, NftablesError, host, migrate};

/// The fixed part of the table. Chains: `hostports`, run from prerouting and from output (host
/// processes), hands conditioned hostPorts to their attachment's `c_` chain and everything else
/// to `hostports_dnat` (DNAT by exact hostIP, then by port for any local address, 127.0.0.1
/// included for host processes; `localnet_guard` drops what arrives from elsewhere for
/// 127.0.0.0/8, as kube-proxy does against CVE-2020-8558); `postrouting` masquerades host
/// processes reaching a hostPort through 127.0.0.1 and hands DNATed traffic (by destination)
/// and traffic leaving by an uplink (by source) to the container's `n_` chain, which
/// masquerades hairpin traffic (a container reaching a container of its own subnet through a
/// hostPort) and its masqueraded traffic; `forward`, `input` and `local_out` let what passes
/// every filter through (replies, related errors, IPv6 neighbour and listener control,
/// `icmpv6_control`) and hand the rest of a container's traffic to its filter chains.
/// Sets `filtered_bridges` and `localnet_interfaces` name the interfaces whose settings cnibpf
/// switched on, to switch them off with the table.
pub(super) const SKELETON: &str = r#"
add table inet cnibpf { comment "cnibpf layout 3"; }
add set inet cnibpf attachments { type ifname; }
add set inet cnibpf uplinks { type ifname; }
add set inet cnibpf filtered_bridges { type ifname; }
add set inet cnibpf localnet_interfaces { type ifname; }
add map inet cnibpf hostports4 { type ipv4_addr . inet_proto . inet_service : ipv4_addr . inet_service; }
add map inet cnibpf hostports4_any { type inet_proto . inet_service : ipv4_addr . inet_service; }
add map inet cnibpf hostports6 { type ipv6_addr . inet_proto . inet_service : ipv6_addr . inet_service; }
add map inet cnibpf hostports6_any { type inet_proto . inet_service : ipv6_addr . inet_service; }
add set inet cnibpf specific_ports4 { type inet_proto . inet_service; }
add set inet cnibpf specific_ports6 { type inet_proto . inet_service; }
add map inet cnibpf conditions4 { type ipv4_addr . inet_proto . inet_service : verdict; }
add map inet cnibpf conditions4_any { type inet_proto . inet_service : verdict; }
add map inet cnibpf conditions6 { type ipv6_addr . inet_proto . inet_service : verdict; }
add map inet cnibpf conditions6_any { type inet_proto . inet_service : verdict; }
add map inet cnibpf filter_out4 { type ipv4_addr : verdict; }
add map inet cnibpf filter_in4 { type ipv4_addr : verdict; }
add map inet cnibpf filter_out6 { type ipv6_addr : verdict; }
add map inet cnibpf filter_in6 { type ipv6_addr : verdict; }
add chain inet cnibpf hostports
add chain inet cnibpf hostports_dnat
add chain inet cnibpf localnet_guard { type filter hook prerouting priority raw; policy accept; }
add chain inet cnibpf prerouting { type nat hook prerouting priority dstnat; policy accept; }
add chain inet cnibpf output { type nat hook output priority -100; policy accept; }
add chain inet cnibpf postrouting { type nat hook postrouting priority srcnat; policy accept; }
add chain inet cnibpf forward { type filter hook forward priority filter; policy accept; }
add chain inet cnibpf input { type filter hook input priority filter; policy accept; }
add chain inet cnibpf local_out { type filter hook output priority filter; policy accept; }
add rule inet cnibpf hostports ip daddr . meta l4proto . th dport vmap @conditions4
add rule inet cnibpf hostports fib daddr type local meta l4proto . th dport vmap @conditions4_any
add rule inet cnibpf hostports ip6 daddr . meta l4proto . th dport vmap @conditions6
add rule inet cnibpf hostports ip6 daddr != ::1 fib daddr type local meta l4proto . th dport vmap @conditions6_any
add rule inet cnibpf hostports goto hostports_dnat
add rule inet cnibpf hostports_dnat meta l4proto { tcp, udp, sctp } dnat ip to ip daddr . meta l4proto . th dport map @hostports4
add rule inet cnibpf hostports_dnat fib daddr type local meta l4proto { tcp, udp, sctp } dnat ip to meta l4proto . th dport map @hostports4_any
add rule inet cnibpf hostports_dnat meta l4proto { tcp, udp, sctp } dnat ip6 to ip6 daddr . meta l4proto . th dport map @hostports6
add rule inet cnibpf hostports_dnat ip6 daddr != ::1 fib daddr type local meta l4proto { tcp, udp, sctp } dnat ip6 to meta l4proto . th dport map @hostports6_any
add rule inet cnibpf prerouting jump hostports
add rule inet cnibpf output jump hostports
"#;

/// The rule of chain `localnet_guard`, counted. Tables made before it was counted hold it
/// without the counter and comment: the first ADD that meets one replaces it.
pub(super) const LOCALNET_GUARD: &str = r#"
flush chain inet cnibpf localnet_guard
add rule inet cnibpf localnet_guard iifname != "lo" ip daddr 127.0.0.0/8 counter drop comment "drop reason localnet_guard"
"#;

pub(super) const LOCALNET_GUARD_COMMENT: &str = "drop reason localnet_guard";

pub(super) const LOCALNET_GUARD_CHAIN: &str = "localnet_guard";

/// The shared objects layout 3 added to layout 2's (see `migrate`).
pub(super) const LAYOUT_3_OBJECTS: &str = r#"
add map inet cnibpf nat4 { type ipv4_addr : verdict; }
add map inet cnibpf nat6 { type ipv6_addr : verdict; }
add set inet cnibpf icmpv6_control { type icmpv6_type; elements = { nd-router-solicit, nd-router-advert, nd-neighbor-solicit, nd-neighbor-advert, nd-redirect, mld-listener-query, mld-listener-report, mld-listener-done, mld2-listener-report }; }
"#;

/// The rules of the hook chains `postrouting`, `forward`, `input` and `local_out` (the chains
/// layout 3 rewrote, see `migrate`).
pub(super) const HOOK_RULES: &str = r#"
add rule inet cnibpf postrouting ip saddr 127.0.0.0/8 ct status dnat masquerade
add rule inet cnibpf postrouting ct status dnat ip daddr vmap @nat4
add rule inet cnibpf postrouting ct status dnat ip6 daddr vmap @nat6
add rule inet cnibpf postrouting oifname @uplinks ip saddr vmap @nat4
add rule inet cnibpf postrouting oifname @uplinks ip6 saddr vmap @nat6
add rule inet cnibpf forward ct direction reply accept
add rule inet cnibpf forward ct state related accept
add rule inet cnibpf forward icmpv6 type @icmpv6_control accept
add rule inet cnibpf input ct direction reply accept
add rule inet cnibpf input ct state related accept
add rule inet cnibpf input icmpv6 type @icmpv6_control accept
add rule inet cnibpf local_out ct direction reply accept
add rule inet cnibpf local_out ct state related accept
add rule inet cnibpf local_out icmpv6 type @icmpv6_control accept
add rule inet cnibpf forward ip saddr vmap @filter_out4
add rule inet cnibpf forward ip daddr vmap @filter_in4
add rule inet cnibpf forward ip6 saddr vmap @filter_out6
add rule inet cnibpf forward ip6 daddr vmap @filter_in6
add rule inet cnibpf input ip saddr vmap @filter_out4
add rule inet cnibpf input ip6 saddr vmap @filter_out6
add rule inet cnibpf local_out ip daddr vmap @filter_in4
add rule inet cnibpf local_out ip6 daddr vmap @filter_in6
"#;

/// What table `inet cnibpf` is to this build.
pub(super) enum TableLayout {
    Absent,
    /// This build's layout: created so, or migrated (marked by chain `layout_3`).
    Current,
    /// The layout this build migrates from.
    Previous,
    /// Any other: its comment (empty for layout 1, which had none).
    Other(String),
}

/// The layout of the table whose comment (`None`: no table) is `comment`.
pub(super) fn layout_of(comment: Option<String>) -> Result<TableLayout, NftablesError> {
    Ok(match comment {
        None => TableLayout::Absent,
        Some(comment) if comment == LAYOUT => TableLayout::Current,
        Some(comment) if comment == migrate::PREVIOUS => {
            if host::has_chain(migrate::MARKER)? {
                TableLayout::Current
            } else {
                TableLayout::Previous
            }
        }
        Some(comment) => TableLayout::Other(comment),
    })
}
