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

use std::{
    collections::BTreeMap,
    io::Write as _,
    net::IpAddr,
    process::{Command, Stdio},
};

use ipnet::IpNet;
use serde_json::Value;

use super::{
    AttachmentRecord, Backend, BackendError, Endpoint, Filter, FilterRecord, Masquerade,
    MasqueradeRecord, UplinkAddresses,
};
use crate::{
    attachment::{Attachment, ResolvedMapping},
    cni::args::Pod,
    config::{
        ConnState, Direction, FilterRule, HostPortAccess, PortRange, Protocol, RuleProtocol,
        Target,
        conditions::{Condition, Subject},
    },
    netlink::{self, Link},
};

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

    fn read_elements(&mut self, set: &Value) {
        let name = set["name"].as_str().unwrap_or_default().to_owned();
        for entry in set["elem"].as_array().into_iter().flatten() {
            // A map element is [key, value]; a set element the key alone.
            let (key, value) = match entry.as_array() {
                Some(pair) if pair.len() == 2 => (&pair[0], Some(&pair[1])),
                _ => (entry, None),
            };
            let (key, comment) = match key.get("elem") {
                Some(elem) => (&elem["val"], elem["comment"].as_str().unwrap_or_default()),
                None => (key, ""),
            };
            let key_parts = parts(key);
            let value_parts = value.map(parts).unwrap_or_default();
            self.elements.push(Element {
                set: name.clone(),
                key: key_parts
                    .iter()
                    .map(|part| quote_if_name(&name, part))
                    .collect::<Vec<_>>()
                    .join(" . "),
                key_parts,
                value_parts,
                comment: comment.to_owned(),
            });
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

    /// Deletes the attachment's hostPort condition rules (in chain `hostports`).
    fn delete_condition_rules(&mut self, owner: &str) {
        let doomed: Vec<u64> = self
            .rules
            .iter()
            .filter(|rule| rule.chain == "hostports" && rule.comment == owner)
            .map(|rule| rule.handle)
            .collect();
        for handle in doomed {
            self.script
                .push(format!("delete rule {TABLE} hostports handle {handle}"));
        }
        self.rules
            .retain(|rule| !(rule.chain == "hostports" && rule.comment == owner));
    }

    /// Makes `pod` the one recorded for the attachment on `host_ifname` (in set `pods`, keyed
    /// by that interface, the pod in the comment); `None` removes it.
    fn record_pod(&mut self, host_ifname: &str, pod: Option<&Pod>) {
        let key = vec![host_ifname.to_owned()];
        let current = self
            .elements
            .iter()
            .find(|element| element.set == "pods" && element.key_parts == key)
            .map(|element| element.comment.clone());
        let wanted = pod.map(|pod| {
            let mut text = pod.to_string();
            while text.len() > COMMENT_MAX {
                text.pop();
            }
            text
        });
        if current == wanted {
            return;
        }
        // A table made by an earlier cnibpf has no such set yet.
        self.script
            .push(format!("add set {TABLE} pods {{ type ifname; }}"));
        if current.is_some() {
            self.script.push(format!(
                "delete element {TABLE} pods {{ \"{host_ifname}\" }}"
            ));
            self.elements
                .retain(|element| !(element.set == "pods" && element.key_parts == key));
        }
        if let Some(text) = wanted {
            self.add_element("pods", format!("\"{host_ifname}\""), None, &text);
        }
    }

    fn pod_of(&self, host_ifname: &str) -> Option<Pod> {
        let element = self.elements.iter().find(|element| {
            element.set == "pods"
                && element.key_parts.first().map(String::as_str) == Some(host_ifname)
        })?;
        let (namespace, name) = element.comment.split_once('/')?;
        Some(Pod {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
    }

    fn remove_filter_chains(&mut self, owner: &str) {
        self.delete_elements(owner, &FILTER_MAPS);
        for chain in filter_chains(owner) {
            if self.chains.contains(&chain) {
                self.script.push(format!("delete chain {TABLE} {chain}"));
                self.chains.retain(|known| *known != chain);
                self.rules.retain(|rule| rule.chain != chain);
            }
        }
    }

    fn owned_mappings(&self, owner: &str) -> Vec<ResolvedMapping> {
        self.elements
            .iter()
            .filter(|element| element.comment == owner)
            .filter_map(mapping_of)
            .collect()
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

/// The filter chains of an attachment: what it sends (`_out`) and receives (`_in`).
fn filter_chains(owner: &str) -> [String; 2] {
    let id = parse_owner(owner).map_or(0, |attachment| attachment.owner_id());
    [format!("f{id:016x}_out"), format!("f{id:016x}_in")]
}

/// The parts of a listed key or value: addresses, ports, protocols, prefixes as text.
fn parts(value: &Value) -> Vec<String> {
    match value {
        Value::Object(object) if object.contains_key("concat") => object["concat"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(parts)
            .collect(),
        Value::Object(object) if object.contains_key("prefix") => vec![format!(
            "{}/{}",
            object["prefix"]["addr"].as_str().unwrap_or_default(),
            object["prefix"]["len"]
        )],
        Value::Object(object) if object.contains_key("jump") => {
            vec![
                object["jump"]["target"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            ]
        }
        Value::String(text) => vec![text.clone()],
        Value::Number(number) => vec![number.to_string()],
        _ => Vec::new(),
    }
}

fn quote_if_name(set: &str, part: &str) -> String {
    if set == "attachments" || set == "uplinks" || set == "pods" {
        format!("\"{part}\"")
    } else {
        part.to_owned()
    }
}

fn protocol_of(name: &str) -> Option<Protocol> {
    match name {
        "tcp" => Some(Protocol::Tcp),
        "udp" => Some(Protocol::Udp),
        "sctp" => Some(Protocol::Sctp),
        _ => None,
    }
}

/// The hostPort element of a mapping: (map, key, value).
fn mapping_element(mapping: &ResolvedMapping) -> (&'static str, String, String) {
    let protocol = mapping.protocol.as_str();
    let (map, key) = match (mapping.host_addr, mapping.is_ipv4()) {
        (Some(addr), true) => (
            "hostports4",
            format!("{addr} . {protocol} . {}", mapping.host_port),
        ),
        (None, true) => (
            "hostports4_any",
            format!("{protocol} . {}", mapping.host_port),
        ),
        (Some(addr), false) => (
            "hostports6",
            format!("{addr} . {protocol} . {}", mapping.host_port),
        ),
        (None, false) => (
            "hostports6_any",
            format!("{protocol} . {}", mapping.host_port),
        ),
    };
    (
        map,
        key,
        format!("{} . {}", mapping.container_addr, mapping.container_port),
    )
}

fn mapping_of(element: &Element) -> Option<ResolvedMapping> {
    let (host_addr, rest) = match element.set.as_str() {
        "hostports4" | "hostports6" => (
            Some(element.key_parts.first()?.parse::<IpAddr>().ok()?),
            &element.key_parts[1..],
        ),
        "hostports4_any" | "hostports6_any" => (None, &element.key_parts[..]),
        _ => return None,
    };
    Some(ResolvedMapping {
        protocol: protocol_of(rest.first()?)?,
        host_addr,
        host_port: rest.get(1)?.parse().ok()?,
        container_addr: element.value_parts.first()?.parse().ok()?,
        container_port: element.value_parts.get(1)?.parse().ok()?,
    })
}

fn family_suffix(addr: IpAddr) -> char {
    if addr.is_ipv4() { '4' } else { '6' }
}

/// The rules that keep clients out of an attachment's hostPorts, at the head of chain
/// `hostports`: for each condition, a packet to one of the attachment's hostPorts of that
/// family that fails it returns before any DNAT (all conditions must hold, as the reference
/// portmap's one rule with all of them). Host processes come in on no interface, so an
/// interface condition never holds for them, as with the reference.
fn condition_rules(mappings: &[ResolvedMapping], access: &HostPortAccess) -> Vec<String> {
    let mut rules = Vec::new();
    for ipv4 in [true, false] {
        let conditions = access.conditions(ipv4);
        let family: Vec<&ResolvedMapping> = mappings
            .iter()
            .filter(|mapping| mapping.is_ipv4() == ipv4)
            .collect();
        if conditions.is_empty() || family.is_empty() {
            continue;
        }
        let ip = if ipv4 { "ip" } else { "ip6" };
        let wildcard: Vec<String> = family
            .iter()
            .filter(|mapping| mapping.host_addr.is_none())
            .map(|mapping| format!("{} . {}", mapping.protocol, mapping.host_port))
            .collect();
        let specific: Vec<String> = family
            .iter()
            .filter_map(|mapping| {
                let addr = mapping.host_addr?;
                Some(format!(
                    "{addr} . {} . {}",
                    mapping.protocol, mapping.host_port
                ))
            })
            .collect();
        let mut selectors = Vec::new();
        if !wildcard.is_empty() {
            selectors.push(format!(
                "fib daddr type local meta l4proto . th dport {{ {} }}",
                wildcard.join(", ")
            ));
        }
        if !specific.is_empty() {
            selectors.push(format!(
                "{ip} daddr . meta l4proto . th dport {{ {} }}",
                specific.join(", ")
            ));
        }
        for condition in conditions {
            let failing = failing_condition(ip, condition);
            for selector in &selectors {
                rules.push(format!("{selector} {failing} return"));
            }
        }
    }
    rules
}

/// The nft match of packets that fail `condition`.
fn failing_condition(ip: &str, condition: &Condition) -> String {
    let operator = if condition.negated { "" } else { "!= " };
    let nets = |nets: &[IpNet]| {
        nets.iter()
            .map(|net| net.trunc().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match &condition.subject {
        Subject::Source(list) => format!("{ip} saddr {operator}{{ {} }}", nets(list)),
        Subject::Destination(list) => format!("{ip} daddr {operator}{{ {} }}", nets(list)),
        Subject::InInterface(name) => format!("iifname {operator}\"{name}\""),
    }
}

/// A filter rule in nft syntax (without its verdict's counter and comment).
fn rule_match(rule: &FilterRule) -> String {
    let mut parts = Vec::new();
    let family = |net: &IpNet| {
        if matches!(net, IpNet::V4(_)) {
            "ip"
        } else {
            "ip6"
        }
    };
    if let Some(src) = rule.src {
        parts.push(format!("{} saddr {}", family(&src), src.trunc()));
    }
    if let Some(dst) = rule.dst {
        parts.push(format!("{} daddr {}", family(&dst), dst.trunc()));
    }
    let protocol = match rule.protocol {
        RuleProtocol::Any => None,
        RuleProtocol::Tcp => Some("tcp"),
        RuleProtocol::Udp => Some("udp"),
        RuleProtocol::Sctp => Some("sctp"),
        RuleProtocol::Icmp => Some("icmp"),
        RuleProtocol::Icmpv6 => Some("ipv6-icmp"),
    };
    if let Some(protocol) = protocol {
        parts.push(format!("meta l4proto {protocol}"));
        let range = |range: PortRange| {
            if range.low == range.high {
                range.low.to_string()
            } else {
                format!("{}-{}", range.low, range.high)
            }
        };
        if let Some(sport) = rule.sport {
            parts.push(format!("th sport {}", range(sport)));
        }
        if let Some(dport) = rule.dport {
            parts.push(format!("th dport {}", range(dport)));
        }
    }
    match rule.connstate {
        ConnState::New => parts.push("ct state new".to_owned()),
        ConnState::Established => parts.push("ct state established".to_owned()),
        ConnState::Any => {}
    }
    parts.join(" ")
}

/// A rule's verdict in an attachment's chain. ALLOW returns rather than accepts: an accept
/// would end the hook, and the other side's chain (the receiving container's ingress after
/// the sender's egress) must still judge the packet.
fn verdict(target: Target) -> &'static str {
    match target {
        Target::Allow => "return",
        Target::Drop => "drop",
    }
}

/// The comment that identifies a filter rule: its index and its match, so that CHECK and
/// inspect read the rule back as configured.
fn rule_comment(rule: &FilterRule) -> String {
    let mut text = format!(
        "{} {} {}",
        rule.index,
        verdict(rule.target),
        rule_match(rule)
    );
    text.truncate(COMMENT_MAX);
    text
}

impl Backend for NftablesBackend {
    fn name(&self) -> &'static str {
        "nftables"
    }

    fn setup_endpoint(&mut self, endpoint: &Endpoint) -> Result<(), BackendError> {
        let owner = owner_comment(&endpoint.attachment)?;
        self.ensure_table();
        self.record_pod(&endpoint.host.name, endpoint.pod.as_ref());
        let current: Vec<Element> = self
            .elements_of(&owner, &["attachments"])
            .cloned()
            .collect();
        if current
            .iter()
            .any(|element| element.key_parts == [endpoint.host.name.clone()])
        {
            return Ok(());
        }
        for element in &current {
            if let Some(host_ifname) = element.key_parts.first().cloned() {
                self.record_pod(&host_ifname, None);
            }
        }
        self.delete_elements(&owner, &["attachments"]);
        self.add_element(
            "attachments",
            format!("\"{}\"", endpoint.host.name),
            None,
            &owner,
        );
        Ok(())
    }

    fn teardown_endpoint(&mut self, owner: u64) -> Result<(), BackendError> {
        let Some(text) = self.owner_text(owner) else {
            return Ok(());
        };
        let host_ifnames: Vec<String> = self
            .elements_of(&text, &["attachments"])
            .filter_map(|element| element.key_parts.first().cloned())
            .collect();
        for host_ifname in host_ifnames {
            self.record_pod(&host_ifname, None);
        }
        self.delete_elements(&text, &["attachments"]);
        if !self
            .elements
            .iter()
            .any(|element| element.set == "attachments")
        {
            // The last attachment: the whole table goes, as the eBPF backend's pins do.
            self.script.push(format!("delete table {TABLE}"));
            *self = Self {
                script: std::mem::take(&mut self.script),
                forget: std::mem::take(&mut self.forget),
                ..Self::default()
            };
        }
        Ok(())
    }

    fn check_endpoint(&self, endpoint: &Endpoint) -> Result<(), BackendError> {
        let owner = owner_comment(&endpoint.attachment)?;
        if self
            .elements_of(&owner, &["attachments"])
            .any(|element| element.key_parts == [endpoint.host.name.clone()])
        {
            return Ok(());
        }
        Err(BackendError::CheckFailed(format!(
            "{} is not recorded with interface {} in set attachments of table {TABLE}",
            endpoint.attachment, endpoint.host.name
        )))
    }

    fn setup_port_mappings(
        &mut self,
        endpoint: &Endpoint,
        mappings: &[ResolvedMapping],
    ) -> Result<(), BackendError> {
        let owner = owner_comment(&endpoint.attachment)?;
        self.ensure_table();
        let previous = self.owned_mappings(&owner);
        self.delete_elements(&owner, &PORT_MAPPING_SETS);
        self.delete_condition_rules(&owner);
        for mapping in mappings {
            let (map, key, value) = mapping_element(mapping);
            self.add_element(map, key, Some(value), &owner);
        }
        for rule in condition_rules(mappings, &endpoint.host_ports) {
            self.script.push(format!(
                "insert rule {TABLE} hostports {rule} comment \"{owner}\""
            ));
        }
        if !mappings.is_empty() && !endpoint.host_ports.no_hairpin_snat {
            for subnet in &endpoint.container_networks {
                let set = format!("hairpin{}", family_suffix(subnet.addr()));
                self.add_element(
                    &set,
                    format!("{} . {}", subnet.trunc(), subnet.addr()),
                    None,
                    &owner,
                );
            }
        }
        // Connections of a mapping that is gone or leads elsewhere must not keep going to the
        // old container, nor those a new hostPort met untranslated stay so (the reference
        // portmap's UDP bug): the kernel matches them before any DNAT.
        let changed: Vec<ResolvedMapping> = previous
            .iter()
            .filter(|mapping| !mappings.contains(mapping))
            .chain(
                mappings
                    .iter()
                    .filter(|mapping| !previous.contains(mapping)),
            )
            .copied()
            .collect();
        self.forget.extend(changed);
        Ok(())
    }

    fn teardown_port_mappings(&mut self, owner: u64) -> Result<(), BackendError> {
        let Some(text) = self.owner_text(owner) else {
            return Ok(());
        };
        let owned = self.owned_mappings(&text);
        self.forget.extend(owned);
        self.delete_elements(&text, &PORT_MAPPING_SETS);
        self.delete_condition_rules(&text);
        Ok(())
    }

    fn check_port_mappings(
        &self,
        endpoint: &Endpoint,
        mappings: &[ResolvedMapping],
    ) -> Result<(), BackendError> {
        let owner = owner_comment(&endpoint.attachment)?;
        let installed = self.owned_mappings(&owner);
        for mapping in mappings {
            if !installed.contains(mapping) {
                return Err(BackendError::CheckFailed(format!(
                    "port mapping {} is missing",
                    super::describe_mapping(mapping)
                )));
            }
        }
        super::check_mapping_count(installed.len(), mappings.len())?;
        let wanted = condition_rules(mappings, &endpoint.host_ports).len();
        let present = self
            .rules
            .iter()
            .filter(|rule| rule.chain == "hostports" && rule.comment == owner)
            .count();
        if wanted != present {
            return Err(BackendError::CheckFailed(format!(
                "{present} hostPort condition rules of {} installed, {wanted} configured",
                endpoint.attachment
            )));
        }
        Ok(())
    }

    fn setup_masquerade(
        &mut self,
        endpoint: &Endpoint,
        masquerade: Option<&Masquerade>,
    ) -> Result<(), BackendError> {
        let owner = owner_comment(&endpoint.attachment)?;
        self.ensure_table();
        self.delete_elements(&owner, &MASQUERADE_SETS);
        let Some(masquerade) = masquerade else {
            return Ok(());
        };
        for source in &masquerade.sources {
            let suffix = family_suffix(*source);
            self.add_element(
                &format!("masq_sources{suffix}"),
                source.to_string(),
                None,
                &owner,
            );
            for (net, _) in &masquerade.excludes {
                if net.addr().is_ipv4() == source.is_ipv4() {
                    self.add_element(
                        &format!("masq_excludes{suffix}"),
                        format!("{source} . {}", net.trunc()),
                        None,
                        &owner,
                    );
                }
            }
        }
        Ok(())
    }

    fn teardown_masquerade(&mut self, owner: u64) -> Result<(), BackendError> {
        if let Some(text) = self.owner_text(owner) {
            self.delete_elements(&text, &MASQUERADE_SETS);
        }
        Ok(())
    }

    fn check_masquerade(
        &self,
        endpoint: &Endpoint,
        masquerade: Option<&Masquerade>,
    ) -> Result<(), BackendError> {
        let owner = owner_comment(&endpoint.attachment)?;
        let sources: Vec<&Element> = self
            .elements_of(&owner, &["masq_sources4", "masq_sources6"])
            .collect();
        let expected = masquerade.map_or(0, |masquerade| masquerade.sources.len());
        let all_there = masquerade.is_none_or(|masquerade| {
            masquerade.sources.iter().all(|source| {
                sources
                    .iter()
                    .any(|element| element.key_parts == [source.to_string()])
            })
        });
        if sources.len() != expected || !all_there {
            return Err(BackendError::CheckFailed(format!(
                "the masquerade of {} differs from its configuration",
                endpoint.attachment
            )));
        }
        Ok(())
    }

    fn setup_filter(
        &mut self,
        endpoint: &Endpoint,
        filter: Option<&Filter>,
    ) -> Result<(), BackendError> {
        let owner = owner_comment(&endpoint.attachment)?;
        self.ensure_table();
        let Some(filter) = filter else {
            self.remove_filter_chains(&owner);
            return Ok(());
        };
        let [out_chain, in_chain] = filter_chains(&owner);
        for (chain, direction) in [
            (&out_chain, Direction::Egress),
            (&in_chain, Direction::Ingress),
        ] {
            // Flushing and refilling in one transaction: packets see the old rules or the new.
            if self.chains.contains(chain) {
                self.script.push(format!("flush chain {TABLE} {chain}"));
            } else {
                self.script.push(format!("add chain {TABLE} {chain}"));
                self.chains.push(chain.clone());
            }
            self.rules.retain(|rule| rule.chain != *chain);
            let mut lines = vec![
                // Replies of tracked connections and errors about them pass.
                "ct direction reply return".to_owned(),
                "ct state related return".to_owned(),
                // Link-local control, as the eBPF backend lets it pass.
                "icmpv6 type { nd-router-solicit, nd-router-advert, nd-neighbor-solicit, nd-neighbor-advert, nd-redirect, mld-listener-query, mld-listener-report, mld-listener-done, mld2-listener-report } return".to_owned(),
            ];
            for rule in &filter.rules {
                if rule.direction == direction || rule.direction == Direction::Both {
                    lines.push(format!(
                        "{} counter {} comment \"{}\"",
                        rule_match(rule),
                        verdict(rule.target),
                        rule_comment(rule)
                    ));
                }
            }
            lines.push(format!(
                "counter {} comment \"default\"",
                verdict(filter.default)
            ));
            for line in lines {
                self.script.push(format!("add rule {TABLE} {chain} {line}"));
            }
        }
        self.delete_elements(&owner, &FILTER_MAPS);
        for network in &endpoint.container_networks {
            let addr = network.addr();
            let suffix = family_suffix(addr);
            self.add_element(
                &format!("filter_out{suffix}"),
                addr.to_string(),
                Some(format!("jump {out_chain}")),
                &owner,
            );
            self.add_element(
                &format!("filter_in{suffix}"),
                addr.to_string(),
                Some(format!("jump {in_chain}")),
                &owner,
            );
        }
        Ok(())
    }

    fn teardown_filter(&mut self, owner: u64) -> Result<(), BackendError> {
        if let Some(text) = self.owner_text(owner) {
            self.remove_filter_chains(&text);
        }
        Ok(())
    }

    fn check_filter(
        &self,
        endpoint: &Endpoint,
        filter: Option<&Filter>,
    ) -> Result<(), BackendError> {
        let owner = owner_comment(&endpoint.attachment)?;
        let [out_chain, in_chain] = filter_chains(&owner);
        let installed: Vec<&str> = self
            .rules
            .iter()
            .filter(|rule| rule.chain == out_chain || rule.chain == in_chain)
            .filter(|rule| !rule.comment.is_empty())
            .map(|rule| rule.comment.as_str())
            .collect();
        let expected: Vec<String> = filter
            .map(|filter| {
                let mut comments = Vec::new();
                for direction in [Direction::Egress, Direction::Ingress] {
                    comments.extend(
                        filter
                            .rules
                            .iter()
                            .filter(|rule| {
                                rule.direction == direction || rule.direction == Direction::Both
                            })
                            .map(rule_comment),
                    );
                    comments.push("default".to_owned());
                }
                comments
            })
            .unwrap_or_default();
        let dispatched = self.elements_of(&owner, &FILTER_MAPS).count();
        let wanted_dispatch = filter.map_or(0, |_| endpoint.container_networks.len() * 2);
        if installed != expected || dispatched != wanted_dispatch {
            return Err(BackendError::CheckFailed(format!(
                "the filter of {} differs from its configuration",
                endpoint.attachment
            )));
        }
        Ok(())
    }

    fn filters(&self) -> Result<Vec<(u64, FilterRecord)>, BackendError> {
        let mut records = Vec::new();
        for element in self
            .elements
            .iter()
            .filter(|element| element.set == "attachments")
        {
            let Some(attachment) = parse_owner(&element.comment) else {
                continue;
            };
            let [out_chain, in_chain] = filter_chains(&element.comment);
            // Rules by index, with both chains' counters summed.
            let mut by_index: BTreeMap<u32, (FilterRule, (u64, u64))> = BTreeMap::new();
            let mut default = None;
            let mut default_hits = (0, 0);
            for rule in self
                .rules
                .iter()
                .filter(|rule| rule.chain == out_chain || rule.chain == in_chain)
            {
                let hits = counter(&rule.expr);
                if rule.comment == "default" {
                    default = Some(if has_verdict(&rule.expr, "drop") {
                        Target::Drop
                    } else {
                        Target::Allow
                    });
                    default_hits = (default_hits.0 + hits.0, default_hits.1 + hits.1);
                    continue;
                }
                let Some(index) = rule
                    .comment
                    .split(' ')
                    .next()
                    .and_then(|index| index.parse().ok())
                else {
                    continue;
                };
                let direction = if rule.chain == out_chain {
                    Direction::Egress
                } else {
                    Direction::Ingress
                };
                let Some(parsed) = rule_from_comment(index, &rule.comment, direction) else {
                    continue;
                };
                let entry = by_index.entry(index).or_insert((parsed, (0, 0)));
                if entry.0.direction != direction {
                    entry.0.direction = Direction::Both;
                }
                entry.1 = (entry.1.0 + hits.0, entry.1.1 + hits.1);
            }
            let Some(default) = default else {
                continue;
            };
            let (rules, hits): (Vec<FilterRule>, Vec<(u64, u64)>) = by_index.into_values().unzip();
            records.push((
                attachment.owner_id(),
                FilterRecord {
                    filter: Filter { rules, default },
                    hits,
                    default_hits,
                    flows: 0,
                },
            ));
        }
        Ok(records)
    }

    fn sweep_expired(&mut self) -> Result<(), BackendError> {
        // The kernel's connection tracking expires its own entries.
        Ok(())
    }

    fn refresh_uplinks(&mut self, uplinks: &[Link]) -> Result<(), BackendError> {
        self.ensure_table();
        for uplink in uplinks {
            let known = self.elements.iter().any(|element| {
                element.set == "uplinks" && element.key_parts == [uplink.name.clone()]
            });
            if !known {
                self.add_element("uplinks", format!("\"{}\"", uplink.name), None, "uplink");
            }
        }
        Ok(())
    }

    fn attachments(&self) -> Result<Vec<AttachmentRecord>, BackendError> {
        Ok(self
            .elements
            .iter()
            .filter(|element| element.set == "attachments")
            .filter_map(|element| {
                let attachment = parse_owner(&element.comment)?;
                let host_ifname = element.key_parts.first()?.clone();
                Some(AttachmentRecord {
                    owner: attachment.owner_id(),
                    host_ifindex: netlink::link_by_name(&host_ifname).map_or(0, |link| link.index),
                    attachment,
                    pod: self.pod_of(&host_ifname),
                    host_ifname,
                })
            })
            .collect())
    }

    fn holder_of(
        &self,
        owner: u64,
        mapping: &ResolvedMapping,
    ) -> Result<Option<u64>, BackendError> {
        let held = self.elements.iter().find_map(|element| {
            let installed = mapping_of(element)?;
            let holder = parse_owner(&element.comment)?.owner_id();
            (holder != owner
                && installed.is_ipv4() == mapping.is_ipv4()
                && installed.protocol == mapping.protocol
                && installed.host_port == mapping.host_port
                && match (installed.host_addr, mapping.host_addr) {
                    (Some(a), Some(b)) => a == b,
                    _ => true,
                })
            .then_some(holder)
        });
        Ok(held)
    }

    fn port_mappings(&self) -> Result<Vec<(u64, ResolvedMapping)>, BackendError> {
        Ok(self
            .elements
            .iter()
            .filter_map(|element| {
                Some((
                    parse_owner(&element.comment)?.owner_id(),
                    mapping_of(element)?,
                ))
            })
            .collect())
    }

    fn masquerades(&self) -> Result<Vec<(u64, MasqueradeRecord)>, BackendError> {
        let mut records: Vec<(u64, MasqueradeRecord)> = Vec::new();
        for element in &self.elements {
            let Some(owner) = parse_owner(&element.comment).map(|a| a.owner_id()) else {
                continue;
            };
            let position = match records.iter().position(|(known, _)| *known == owner) {
                Some(position) => position,
                None => {
                    records.push((owner, MasqueradeRecord::default()));
                    records.len() - 1
                }
            };
            let record = &mut records[position].1.masquerade;
            match element.set.as_str() {
                "masq_sources4" | "masq_sources6" => {
                    if let Some(addr) = element.key_parts.first().and_then(|addr| addr.parse().ok())
                    {
                        record.sources.push(addr);
                    }
                }
                "masq_excludes4" | "masq_excludes6" => {
                    let net = element.key_parts.get(1).and_then(|net| {
                        net.parse::<IpNet>()
                            .ok()
                            .or_else(|| net.parse::<IpAddr>().ok().map(IpNet::from))
                    });
                    if let Some(net) = net
                        && !record.excludes.iter().any(|(known, _)| *known == net)
                    {
                        record
                            .excludes
                            .push((net, exclude_reason(&net, &record.sources)));
                    }
                }
                _ => {}
            }
        }
        records.retain(|(_, record)| !record.masquerade.sources.is_empty());
        Ok(records)
    }

    fn counters(&self) -> Result<Vec<(&'static str, u64)>, BackendError> {
        Ok(Vec::new())
    }

    fn uplink_addresses(&self) -> Result<Vec<UplinkAddresses>, BackendError> {
        let addresses = netlink::addresses().unwrap_or_default();
        Ok(self
            .elements
            .iter()
            .filter(|element| element.set == "uplinks")
            .filter_map(|element| netlink::link_by_name(element.key_parts.first()?).ok())
            .map(|link| UplinkAddresses {
                ifindex: link.index,
                v4: addresses.iter().find_map(|(index, addr)| match addr {
                    IpAddr::V4(addr) if *index == link.index => Some(*addr),
                    _ => None,
                }),
                v6: addresses.iter().find_map(|(index, addr)| match addr {
                    IpAddr::V6(addr)
                        if *index == link.index && !super::is_link_local(IpAddr::V6(*addr)) =>
                    {
                        Some(*addr)
                    }
                    _ => None,
                }),
            })
            .collect())
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

/// Why a destination is excluded from masquerade, told from the destination itself.
fn exclude_reason(net: &IpNet, sources: &[IpAddr]) -> super::ExcludeReason {
    let multicast = match net {
        IpNet::V4(net) => net.addr().is_multicast(),
        IpNet::V6(net) => net.addr().is_multicast(),
    };
    if multicast {
        super::ExcludeReason::Multicast
    } else if sources.iter().any(|source| net.contains(source)) {
        super::ExcludeReason::OwnSubnet
    } else {
        super::ExcludeReason::Configured
    }
}

/// A filter rule read back from its comment (`rule_comment`): index, verdict, nft match.
fn rule_from_comment(index: u32, comment: &str, direction: Direction) -> Option<FilterRule> {
    let mut words = comment.split(' ').skip(1);
    let target = match words.next()? {
        "drop" => Target::Drop,
        _ => Target::Allow,
    };
    let mut rule = FilterRule {
        index,
        target,
        src: None,
        dst: None,
        protocol: RuleProtocol::Any,
        sport: None,
        dport: None,
        connstate: ConnState::Any,
        direction,
    };
    let words: Vec<&str> = words.collect();
    let range = |text: &str| {
        let (low, high) = text.split_once('-').unwrap_or((text, text));
        Some(PortRange {
            low: low.parse().ok()?,
            high: high.parse().ok()?,
        })
    };
    for pair in words.windows(3) {
        match (pair[0], pair[1], pair[2]) {
            ("ip" | "ip6", "saddr", net) => rule.src = net.parse().ok(),
            ("ip" | "ip6", "daddr", net) => rule.dst = net.parse().ok(),
            ("meta", "l4proto", protocol) => {
                rule.protocol = match protocol {
                    "tcp" => RuleProtocol::Tcp,
                    "udp" => RuleProtocol::Udp,
                    "sctp" => RuleProtocol::Sctp,
                    "icmp" => RuleProtocol::Icmp,
                    _ => RuleProtocol::Icmpv6,
                };
            }
            ("th", "sport", ports) => rule.sport = range(ports),
            ("th", "dport", ports) => rule.dport = range(ports),
            ("ct", "state", "new") => rule.connstate = ConnState::New,
            ("ct", "state", "established") => rule.connstate = ConnState::Established,
            _ => {}
        }
    }
    Some(rule)
}

/// (packets, bytes) of a rule's counter.
fn counter(expr: &[Value]) -> (u64, u64) {
    expr.iter()
        .find_map(|statement| statement.get("counter"))
        .map_or((0, 0), |counter| {
            (
                counter["packets"].as_u64().unwrap_or(0),
                counter["bytes"].as_u64().unwrap_or(0),
            )
        })
}

fn has_verdict(expr: &[Value], verdict: &str) -> bool {
    expr.iter()
        .any(|statement| statement.get(verdict).is_some())
}

/// Removes the kernel's connection tracking entries towards `mapping`'s hostPort (on its
/// hostIP, or any address), so that the next packet meets the mappings as they are now
/// (`conntrack -D`; best effort: without the tool such entries age out by themselves).
fn forget_connections(mapping: &ResolvedMapping) {
    let family = if mapping.is_ipv4() { "ipv4" } else { "ipv6" };
    let mut command = Command::new("conntrack");
    command
        .args(["-D", "-f", family, "-p", mapping.protocol.as_str()])
        .args(["--orig-port-dst", &mapping.host_port.to_string()]);
    if let Some(addr) = mapping.host_addr {
        command.args(["--orig-dst", &addr.to_string()]);
    }
    let _ = command.stdout(Stdio::null()).stderr(Stdio::null()).status();
}
