//! The nftables backend: the same configuration served by one table, `inet cnibpf`, where BPF
//! is unavailable.
//!
//! The table's chains and rules are fixed (created with the table); everything that belongs to
//! an attachment is an element of one of its sets and maps — hostPorts, hairpin and
//! masquerade sources and exclusions, the filter's dispatch — or, for the filter's rules, one
//! chain pair per attachment. Each element carries the attachment's identity in its comment as
//! plain text, `<network>/<ifname>/<container id>`, so DEL and GC find exactly what it added
//! from the kernel's own listing. The changes of one CNI operation are collected and applied
//! by one `nft -f` run: one atomic transaction.
//!
//! `listing` reads the kernel's listing into the model; `endpoint`, `portmap`, `masquerade`
//! and `filter` each serve one capability, adding to the operation's script.

mod endpoint;
mod filter;
mod inspect;
mod listing;
mod masquerade;
mod portmap;

use std::{
    io::Write as _,
    net::IpAddr,
    process::{Command, Stdio},
};

use serde_json::Value;

use self::portmap::forget_connections;
use super::{Backend, BackendError};
use crate::model::{Attachment, ResolvedMapping};

const NFT: &str = "nft";
const TABLE: &str = "inet cnibpf";
/// nftables keeps comments of at most 128 bytes, NUL included.
const COMMENT_MAX: usize = 127;

#[derive(Debug, thiserror::Error)]
pub enum NftablesError {
    #[error("could not run {NFT}")]
    Run(#[source] std::io::Error),
    #[error("{NFT} refused the change: {0}")]
    Refused(String),
    #[error("could not read the table from {NFT}: {0}")]
    Listing(String),
    #[error(
        "{0} is too long for the nftables backend, which keeps owners in comments of at most {COMMENT_MAX} bytes"
    )]
    OwnerTooLong(String),
}

/// The fixed part of the table. Chains: `hostports` (DNAT to containers by exact host address,
/// then by port for any local address — never loopback, which would need route_localnet), run
/// from prerouting and from output (host processes); `postrouting` masquerades hairpin traffic
/// (a container reaching a container of its own subnet through a hostPort) and container
/// traffic leaving through an uplink; `forward`, `input` and `local_out` hand a container's
/// traffic to its filter chains.
const SKELETON: &str = r"
add table inet cnibpf
add set inet cnibpf attachments { type ifname; }
add set inet cnibpf pods { type ifname; }
add set inet cnibpf uplinks { type ifname; }
add map inet cnibpf hostports4 { type ipv4_addr . inet_proto . inet_service : ipv4_addr . inet_service; }
add map inet cnibpf hostports4_any { type inet_proto . inet_service : ipv4_addr . inet_service; }
add map inet cnibpf hostports6 { type ipv6_addr . inet_proto . inet_service : ipv6_addr . inet_service; }
add map inet cnibpf hostports6_any { type inet_proto . inet_service : ipv6_addr . inet_service; }
add set inet cnibpf hairpin4 { type ipv4_addr . ipv4_addr; flags interval; }
add set inet cnibpf hairpin6 { type ipv6_addr . ipv6_addr; flags interval; }
add set inet cnibpf masq_sources4 { type ipv4_addr; }
add set inet cnibpf masq_sources6 { type ipv6_addr; }
add set inet cnibpf masq_excludes4 { type ipv4_addr . ipv4_addr; flags interval; }
add set inet cnibpf masq_excludes6 { type ipv6_addr . ipv6_addr; flags interval; }
add map inet cnibpf filter_out4 { type ipv4_addr : verdict; }
add map inet cnibpf filter_in4 { type ipv4_addr : verdict; }
add map inet cnibpf filter_out6 { type ipv6_addr : verdict; }
add map inet cnibpf filter_in6 { type ipv6_addr : verdict; }
add chain inet cnibpf hostports
add chain inet cnibpf prerouting { type nat hook prerouting priority dstnat; policy accept; }
add chain inet cnibpf output { type nat hook output priority -100; policy accept; }
add chain inet cnibpf postrouting { type nat hook postrouting priority srcnat; policy accept; }
add chain inet cnibpf forward { type filter hook forward priority filter; policy accept; }
add chain inet cnibpf input { type filter hook input priority filter; policy accept; }
add chain inet cnibpf local_out { type filter hook output priority filter; policy accept; }
add rule inet cnibpf hostports ip daddr != 127.0.0.0/8 meta l4proto { tcp, udp, sctp } dnat ip to ip daddr . meta l4proto . th dport map @hostports4
add rule inet cnibpf hostports ip daddr != 127.0.0.0/8 fib daddr type local meta l4proto { tcp, udp, sctp } dnat ip to meta l4proto . th dport map @hostports4_any
add rule inet cnibpf hostports ip6 daddr != ::1 meta l4proto { tcp, udp, sctp } dnat ip6 to ip6 daddr . meta l4proto . th dport map @hostports6
add rule inet cnibpf hostports ip6 daddr != ::1 fib daddr type local meta l4proto { tcp, udp, sctp } dnat ip6 to meta l4proto . th dport map @hostports6_any
add rule inet cnibpf prerouting jump hostports
add rule inet cnibpf output jump hostports
add rule inet cnibpf postrouting ct status dnat ip saddr . ip daddr @hairpin4 masquerade
add rule inet cnibpf postrouting ct status dnat ip6 saddr . ip6 daddr @hairpin6 masquerade
add rule inet cnibpf postrouting oifname @uplinks ip saddr @masq_sources4 ip saddr . ip daddr != @masq_excludes4 masquerade
add rule inet cnibpf postrouting oifname @uplinks ip6 saddr @masq_sources6 ip6 saddr . ip6 daddr != @masq_excludes6 masquerade
add rule inet cnibpf forward ip saddr vmap @filter_out4
add rule inet cnibpf forward ip daddr vmap @filter_in4
add rule inet cnibpf forward ip6 saddr vmap @filter_out6
add rule inet cnibpf forward ip6 daddr vmap @filter_in6
add rule inet cnibpf input ip saddr vmap @filter_out4
add rule inet cnibpf input ip6 saddr vmap @filter_out6
add rule inet cnibpf local_out ip daddr vmap @filter_in4
add rule inet cnibpf local_out ip6 daddr vmap @filter_in6
";

/// The sets and maps that hold an attachment's port mappings, its masquerade, and its
/// filter's dispatch.
const PORT_MAPPING_SETS: [&str; 6] = [
    "hostports4",
    "hostports4_any",
    "hostports6",
    "hostports6_any",
    "hairpin4",
    "hairpin6",
];
const MASQUERADE_SETS: [&str; 4] = [
    "masq_sources4",
    "masq_sources6",
    "masq_excludes4",
    "masq_excludes6",
];
const FILTER_MAPS: [&str; 4] = ["filter_out4", "filter_in4", "filter_out6", "filter_in6"];

/// One element of a set or map, as the kernel lists it.
#[derive(Clone, Debug)]
struct Element {
    /// The set or map.
    set: String,
    /// The key in nft syntax, for deleting it.
    key: String,
    /// The key's parts (a concatenation's in order).
    key_parts: Vec<String>,
    /// A map's value parts (a concatenation's in order; a verdict's target chain).
    value_parts: Vec<String>,
    comment: String,
}

/// A rule of an attachment's filter chain, as the kernel lists it.
#[derive(Clone, Debug)]
struct ListedRule {
    chain: String,
    comment: String,
    expr: Vec<Value>,
    handle: u64,
}

#[derive(Debug, Default)]
pub struct NftablesBackend {
    exists: bool,
    elements: Vec<Element>,
    chains: Vec<String>,
    rules: Vec<ListedRule>,
    /// Commands of this operation, applied together by [`Backend::commit`].
    script: Vec<String>,
    /// hostPorts added or removed by this operation, whose connection tracking entries go
    /// once the transaction is in (before, a packet could recreate them).
    forget: Vec<ResolvedMapping>,
}

impl NftablesBackend {
    /// Whether nftables can work here (STATUS): `nft` runs and the kernel answers it.
    pub fn probe() -> Result<(), BackendError> {
        let unavailable = |reason: String| BackendError::Unavailable {
            backend: "nftables",
            reason,
        };
        let output = Command::new(NFT)
            .args(["list", "tables"])
            .stdin(Stdio::null())
            .output()
            .map_err(|error| unavailable(format!("{NFT} cannot run: {error}")))?;
        if output.status.success() {
            Ok(())
        } else {
            Err(unavailable(format!(
                "{NFT} list tables failed: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            )))
        }
    }

    /// [`Self::open`] for ADD: a table that cannot be listed means nftables cannot work here
    /// (no `nft`, no nf_tables), which a forced or fallen-back backend reports as such.
    pub fn open_for_changes() -> Result<Self, BackendError> {
        Self::open().map_err(|error| {
            let mut reason = error.to_string();
            let mut cause = std::error::Error::source(&error);
            while let Some(inner) = cause {
                reason = format!("{reason}: {inner}");
                cause = inner.source();
            }
            BackendError::Unavailable {
                backend: "nftables",
                reason,
            }
        })
    }

    /// The table as the kernel has it (empty when there is none), ready for changes.
    pub fn open() -> Result<Self, BackendError> {
        let output = Command::new(NFT)
            .args(["-j", "list", "table", "inet", "cnibpf"])
            .stdin(Stdio::null())
            .output()
            .map_err(NftablesError::Run)?;
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            if stderr.contains("No such file or directory") {
                return Ok(Self::default());
            }
            return Err(NftablesError::Listing(stderr.trim().to_owned()).into());
        }
        let listing: Value = serde_json::from_slice(&output.stdout)
            .map_err(|error| NftablesError::Listing(error.to_string()))?;
        let mut backend = Self {
            exists: true,
            ..Self::default()
        };
        for object in listing["nftables"].as_array().into_iter().flatten() {
            if let Some(set) = object.get("set").or_else(|| object.get("map")) {
                backend.read_elements(set);
            } else if let Some(chain) = object.get("chain") {
                if let Some(name) = chain["name"].as_str() {
                    backend.chains.push(name.to_owned());
                }
            } else if let Some(rule) = object.get("rule") {
                backend.rules.push(ListedRule {
                    chain: rule["chain"].as_str().unwrap_or_default().to_owned(),
                    comment: rule["comment"].as_str().unwrap_or_default().to_owned(),
                    expr: rule["expr"].as_array().cloned().unwrap_or_default(),
                    handle: rule["handle"].as_u64().unwrap_or_default(),
                });
            }
        }
        Ok(backend)
    }

    /// The table if it exists, for DEL, GC, inspect and ADD's hostPort conflicts (`None`
    /// without `nft` too: nothing of ours can be there then). Asks the kernel over netlink
    /// first: on a host without the table (every eBPF host) no `nft` process runs.
    pub fn open_existing() -> Result<Option<Self>, BackendError> {
        if !table_exists().unwrap_or(true) {
            return Ok(None);
        }
        match Self::open() {
            Ok(backend) => Ok(backend.exists.then_some(backend)),
            Err(BackendError::Nftables(NftablesError::Run(error)))
                if error.kind() == std::io::ErrorKind::NotFound =>
            {
                Ok(None)
            }
            Err(error) => Err(error),
        }
    }

    fn ensure_table(&mut self) {
        if !self.exists {
            self.script.extend(
                SKELETON
                    .lines()
                    .filter(|line| !line.is_empty())
                    .map(str::to_owned),
            );
            self.exists = true;
        }
    }

    fn elements_of<'a>(
        &'a self,
        owner: &'a str,
        sets: &'a [&str],
    ) -> impl Iterator<Item = &'a Element> + 'a {
        self.elements
            .iter()
            .filter(move |element| element.comment == owner && sets.contains(&element.set.as_str()))
    }

    /// Deletes the owner's elements of `sets` (from the kernel at commit, and from the model).
    fn delete_elements(&mut self, owner: &str, sets: &[&str]) {
        let doomed: Vec<Element> = self.elements_of(owner, sets).cloned().collect();
        for element in &doomed {
            self.script.push(format!(
                "delete element {TABLE} {} {{ {} }}",
                element.set, element.key
            ));
        }
        self.elements
            .retain(|element| !(element.comment == owner && sets.contains(&element.set.as_str())));
    }

    fn add_element(&mut self, set: &str, key: String, value: Option<String>, owner: &str) {
        let value_text = value
            .as_ref()
            .map(|value| format!(" : {value}"))
            .unwrap_or_default();
        self.script.push(format!(
            "add element {TABLE} {set} {{ {key} comment \"{owner}\"{value_text} }}"
        ));
        self.elements.push(Element {
            set: set.to_owned(),
            key: key.clone(),
            key_parts: key
                .split(" . ")
                .map(|part| part.trim_matches('"').to_owned())
                .collect(),
            value_parts: value
                .map(|value| {
                    value
                        .trim_start_matches("jump ")
                        .split(" . ")
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default(),
            comment: owner.to_owned(),
        });
    }

    /// The owner text of the attachment with id `owner`, from any element it owns (not only
    /// its `attachments` entry: DEL must find what a half-removed attachment left).
    fn owner_text(&self, owner: u64) -> Option<String> {
        self.elements
            .iter()
            .find(|element| parse_owner(&element.comment).is_some_and(|a| a.owner_id() == owner))
            .map(|element| element.comment.clone())
    }
}

/// Whether the kernel has the table `inet cnibpf`: one `NFT_MSG_GETTABLE` over
/// `NETLINK_NETFILTER` (an `nft` process costs about 3.5 ms).
fn table_exists() -> std::io::Result<bool> {
    const NFNL_SUBSYS_NFTABLES: u16 = 10;
    const NFT_MSG_NEWTABLE: u16 = 0;
    const NFT_MSG_GETTABLE: u16 = 1;
    const NFTA_TABLE_NAME: u16 = 1;
    const NFPROTO_INET: u8 = 1;
    const NLMSG_ERROR: u16 = 2;
    const NLM_F_REQUEST_ACK: u16 = 1 | 4;
    let name = b"cnibpf\0";
    // nlmsghdr, nfgenmsg, one attribute (padded to 4 bytes).
    let attribute_len = 4 + name.len();
    let length = 16 + 4 + attribute_len.next_multiple_of(4);
    let mut request = Vec::with_capacity(length);
    request.extend((length as u32).to_ne_bytes());
    request.extend(((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE).to_ne_bytes());
    request.extend(NLM_F_REQUEST_ACK.to_ne_bytes());
    request.extend(1u32.to_ne_bytes());
    request.extend(0u32.to_ne_bytes());
    request.extend([NFPROTO_INET, 0, 0, 0]);
    request.extend((attribute_len as u16).to_ne_bytes());
    request.extend(NFTA_TABLE_NAME.to_ne_bytes());
    request.extend(name);
    request.resize(length, 0);
    let mut socket = netlink_sys::Socket::new(netlink_sys::protocols::NETLINK_NETFILTER)?;
    socket.bind_auto()?;
    socket.connect(&netlink_sys::SocketAddr::new(0, 0))?;
    socket.send(&request, 0)?;
    let mut found = false;
    loop {
        let (reply, _) = socket.recv_from_full()?;
        let mut offset = 0;
        while offset + 16 <= reply.len() {
            let field = |at: usize, width: usize| &reply[offset + at..offset + at + width];
            let message_len =
                u32::from_ne_bytes(field(0, 4).try_into().unwrap_or_default()) as usize;
            let kind = u16::from_ne_bytes(field(4, 2).try_into().unwrap_or_default());
            if kind == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWTABLE {
                found = true;
            } else if kind == NLMSG_ERROR && offset + 20 <= reply.len() {
                let error = i32::from_ne_bytes(field(16, 4).try_into().unwrap_or_default());
                return match error {
                    0 => Ok(found),
                    error if error == -libc::ENOENT => Ok(false),
                    error => Err(std::io::Error::from_raw_os_error(-error)),
                };
            }
            if message_len < 16 {
                break;
            }
            offset += message_len.next_multiple_of(4);
        }
    }
}

/// The text form of an attachment kept in comments; refused when it does not fit one.
fn owner_comment(attachment: &Attachment) -> Result<String, NftablesError> {
    let text = format!(
        "{}/{}/{}",
        attachment.network, attachment.ifname, attachment.container_id
    );
    if text.len() > COMMENT_MAX {
        return Err(NftablesError::OwnerTooLong(text));
    }
    Ok(text)
}

fn parse_owner(comment: &str) -> Option<Attachment> {
    let mut parts = comment.splitn(3, '/');
    let (network, ifname, container_id) = (parts.next()?, parts.next()?, parts.next()?);
    Some(Attachment::new(network, container_id, ifname))
}

/// The suffix of an address's family in set names: `4` or `6`.
fn family_suffix(addr: IpAddr) -> char {
    if addr.is_ipv4() { '4' } else { '6' }
}

impl Backend for NftablesBackend {
    fn name(&self) -> &'static str {
        "nftables"
    }

    fn sweep_expired(&mut self) -> Result<(), BackendError> {
        // The kernel's connection tracking expires its own entries.
        Ok(())
    }

    fn commit(&mut self) -> Result<(), BackendError> {
        if self.script.is_empty() {
            return Ok(());
        }
        let script = std::mem::take(&mut self.script).join("\n") + "\n";
        let mut child = Command::new(NFT)
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(NftablesError::Run)?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(script.as_bytes())
                .map_err(NftablesError::Run)?;
        }
        let output = child.wait_with_output().map_err(NftablesError::Run)?;
        if output.status.success() {
            for mapping in std::mem::take(&mut self.forget) {
                forget_connections(&mapping);
            }
            Ok(())
        } else {
            Err(
                NftablesError::Refused(String::from_utf8_lossy(&output.stderr).trim().to_owned())
                    .into(),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_round_trip_through_comments_and_long_ones_are_refused() {
        let attachment = Attachment::new("net-a", "0123456789abcdef", "eth0");
        let comment = owner_comment(&attachment).expect("fits");
        assert_eq!(comment, "net-a/eth0/0123456789abcdef");
        assert_eq!(parse_owner(&comment), Some(attachment));
        let long = Attachment::new(&"n".repeat(100), &"c".repeat(64), "eth0");
        assert!(matches!(
            owner_comment(&long),
            Err(NftablesError::OwnerTooLong(_))
        ));
    }
}
