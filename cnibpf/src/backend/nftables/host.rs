//! What the nftables backend asks of and changes on the host besides its table: the table's
//! existence and layout, and its rules for a scrape (over netfilter's netlink, no `nft` run), and the interface settings its datapath needs — `nf_call_iptables` on a bridge
//! whose containers are filtered (bridged frames reach the `inet` hooks only through
//! br_netfilter), `route_localnet` on the interface host processes reach containers by when
//! they use 127.0.0.1.

use std::{io, ops::ControlFlow, path::Path};

use serde::Deserialize as _;

use super::{NftablesError, nft::TABLE};
use crate::{
    netlink,
    nfnetlink::{Connection, Request, attribute, attributes},
};

const NFNL_SUBSYS_NFTABLES: u8 = 10;
const NFT_MSG_GETTABLE: u8 = 1;
const NFT_MSG_GETCHAIN: u8 = 4;
const NFT_MSG_GETRULE: u8 = 7;
const NFT_MSG_GETSET: u8 = 10;
pub const NFPROTO_INET: u8 = 1;
pub const NFPROTO_NETDEV: u8 = 5;
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_TABLE_USERDATA: u16 = 6;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_SET_TABLE: u16 = 1;
const NFTA_SET_NAME: u16 = 2;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_RULE_USERDATA: u16 = 7;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_COUNTER_BYTES: u16 = 1;
const NFTA_COUNTER_PACKETS: u16 = 2;
const NFTA_IMMEDIATE_DATA: u16 = 2;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_PAYLOAD_BASE: u16 = 2;
const NFTA_META_KEY: u16 = 2;
const NFT_META_PROTOCOL: u32 = 1;
const NFTA_CMP_OP: u16 = 2;
const NFTA_CMP_DATA: u16 = 3;
const NFT_CMP_EQ: u32 = 0;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_DATA_VALUE: u16 = 1;
/// `NFTNL_UDATA_TABLE_COMMENT` and `NFTNL_UDATA_RULE_COMMENT`, in a table's or rule's user
/// data.
const UDATA_COMMENT: u8 = 0;

/// A rule as one netlink dump of its table gives it: enough to count what it matched and to
/// tell what it is, without `nft`, whose listing fetches every anonymous set's elements one
/// request at a time (four per source-check chain: 0.6 s at 1,000 attachments).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DumpedRule {
    pub chain: String,
    pub comment: Option<String>,
    /// (packets, bytes) of its counter.
    pub counter: Option<(u64, u64)>,
    /// Its verdict's code (`NF_DROP` 0, `NF_ACCEPT` 1, `NFT_RETURN` -5, …).
    pub verdict: Option<i32>,
    /// The header bases its payload expressions read (0 link, 1 network, 2 transport).
    pub payload_bases: Vec<u32>,
    /// It loads `meta protocol`.
    pub reads_protocol: bool,
    /// The values it compares for equality, as bytes (a dependency's `meta protocol == arp`
    /// is `[0x08, 0x06]`).
    pub equal_to: Vec<Vec<u8>>,
}

/// Table `cnibpf` of `family` (`NFPROTO_INET` 1, `NFPROTO_NETDEV` 5) rule by rule, in chain
/// order; empty when there is no table.
pub fn dump_rules(family: u8) -> Result<Vec<DumpedRule>, NftablesError> {
    let mut rules = Vec::new();
    let mut connection = Connection::open().map_err(NftablesError::Netlink)?;
    let asked = connection.exchange(
        Request::new(NFNL_SUBSYS_NFTABLES, NFT_MSG_GETRULE, family, true)
            .string(NFTA_RULE_TABLE, TABLE),
        |_, rule| {
            rules.push(dumped_rule(rule));
            ControlFlow::Continue(())
        },
    );
    match asked {
        Ok(()) => Ok(rules),
        Err(error) if error.raw_os_error() == Some(libc::ENOENT) => Ok(Vec::new()),
        Err(error) => Err(NftablesError::Netlink(error)),
    }
}

/// The attributes of one `NFT_MSG_NEWRULE` read into a [`DumpedRule`]; what it does not
/// understand it leaves out (the scrape only counts).
fn dumped_rule(rule: &[u8]) -> DumpedRule {
    let be32 = |bytes: &[u8]| {
        bytes
            .get(..4)
            .map(|value| u32::from_be_bytes([value[0], value[1], value[2], value[3]]))
    };
    let be64 = |bytes: &[u8]| {
        bytes.get(..8).map(|value| {
            u64::from_be_bytes([
                value[0], value[1], value[2], value[3], value[4], value[5], value[6], value[7],
            ])
        })
    };
    let mut dumped = DumpedRule {
        chain: attribute(rule, NFTA_RULE_CHAIN)
            .map(|name| String::from_utf8_lossy(until_nul(name)).into_owned())
            // fail-closed: a dump's rule always names its chain; one without is no chain's.
            .unwrap_or_default(),
        comment: attribute(rule, NFTA_RULE_USERDATA).and_then(user_data_comment),
        ..DumpedRule::default()
    };
    let Some(expressions) = attribute(rule, NFTA_RULE_EXPRESSIONS) else {
        return dumped;
    };
    for (kind, expression) in attributes(expressions) {
        if kind != NFTA_LIST_ELEM {
            continue;
        }
        let name = attribute(expression, NFTA_EXPR_NAME).map(until_nul);
        // fail-closed: an expression without data has nothing to read.
        let data = attribute(expression, NFTA_EXPR_DATA).unwrap_or_default();
        match name {
            Some(b"counter") => {
                dumped.counter = attribute(data, NFTA_COUNTER_PACKETS)
                    .and_then(be64)
                    .zip(attribute(data, NFTA_COUNTER_BYTES).and_then(be64));
            }
            Some(b"immediate") => {
                let verdict = attribute(data, NFTA_IMMEDIATE_DATA)
                    .and_then(|value| attribute(value, NFTA_DATA_VERDICT))
                    .and_then(|verdict| attribute(verdict, NFTA_VERDICT_CODE))
                    .and_then(be32);
                if let Some(code) = verdict {
                    dumped.verdict = Some(code as i32);
                }
            }
            Some(b"payload") => {
                dumped
                    .payload_bases
                    .extend(attribute(data, NFTA_PAYLOAD_BASE).and_then(be32));
            }
            Some(b"meta") => {
                dumped.reads_protocol |=
                    attribute(data, NFTA_META_KEY).and_then(be32) == Some(NFT_META_PROTOCOL);
            }
            Some(b"cmp") => {
                let equal = attribute(data, NFTA_CMP_OP).and_then(be32) == Some(NFT_CMP_EQ);
                let value = attribute(data, NFTA_CMP_DATA)
                    .and_then(|value| attribute(value, NFTA_DATA_VALUE));
                if let (true, Some(value)) = (equal, value) {
                    dumped.equal_to.push(value.to_vec());
                }
            }
            _ => {}
        }
    }
    dumped
}

/// `bytes` up to its first NUL, as the kernel ends its strings.
fn until_nul(bytes: &[u8]) -> &[u8] {
    match bytes.iter().position(|byte| *byte == 0) {
        Some(end) => &bytes[..end],
        None => bytes,
    }
}

/// The comment of table `inet cnibpf` (its layout), `None` when there is no table. An error
/// when the kernel does not speak nf_tables.
pub fn table_comment() -> io::Result<Option<String>> {
    let mut connection = Connection::open()?;
    let mut comment = None;
    let asked = connection.exchange(
        Request::new(NFNL_SUBSYS_NFTABLES, NFT_MSG_GETTABLE, NFPROTO_INET, false)
            .string(NFTA_TABLE_NAME, TABLE),
        |_, table| {
            comment = Some(
                attribute(table, NFTA_TABLE_USERDATA)
                    .and_then(user_data_comment)
                    // fail-closed: a table without a comment is layout 1's, which had none.
                    .unwrap_or_default(),
            );
            ControlFlow::Continue(())
        },
    );
    match asked {
        Ok(()) => Ok(comment),
        Err(error) if error.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(error) => Err(error),
    }
}

/// The names of the sets of table `inet cnibpf` that start with `prefix` (none without the
/// table): one netlink dump of its few sets.
pub fn sets_named(prefix: &str) -> Result<Vec<String>, NftablesError> {
    let mut names = Vec::new();
    let mut connection = Connection::open().map_err(NftablesError::Netlink)?;
    let asked = connection.exchange(
        Request::new(NFNL_SUBSYS_NFTABLES, NFT_MSG_GETSET, NFPROTO_INET, true)
            .string(NFTA_SET_TABLE, TABLE),
        |_, set| {
            let name = attribute(set, NFTA_SET_NAME).map(until_nul);
            if let Some(name) = name.filter(|name| name.starts_with(prefix.as_bytes())) {
                names.push(String::from_utf8_lossy(name).into_owned());
            }
            ControlFlow::Continue(())
        },
    );
    match asked {
        Ok(()) => Ok(names),
        Err(error) if error.raw_os_error() == Some(libc::ENOENT) => Ok(Vec::new()),
        Err(error) => Err(NftablesError::Netlink(error)),
    }
}

/// Whether an error of a netfilter netlink question means this kernel has no nf_tables at all
/// (no netfilter netlink, or no nf_tables subsystem behind it), rather than "could not ask".
pub fn lacks_nf_tables(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EPROTONOSUPPORT | libc::EAFNOSUPPORT | libc::EOPNOTSUPP)
    )
}

/// Whether table `inet cnibpf` has chain `chain`.
pub fn has_chain(chain: &str) -> Result<bool, NftablesError> {
    exists(
        Request::new(NFNL_SUBSYS_NFTABLES, NFT_MSG_GETCHAIN, NFPROTO_INET, false)
            .string(NFTA_CHAIN_TABLE, TABLE)
            .string(NFTA_CHAIN_NAME, chain),
    )
}

/// Whether table `netdev cnibpf` (the source checks, the masquerade guard) has chain `chain`.
pub fn has_netdev_chain(chain: &str) -> Result<bool, NftablesError> {
    exists(
        Request::new(
            NFNL_SUBSYS_NFTABLES,
            NFT_MSG_GETCHAIN,
            NFPROTO_NETDEV,
            false,
        )
        .string(NFTA_CHAIN_TABLE, TABLE)
        .string(NFTA_CHAIN_NAME, chain),
    )
}

/// Whether table `netdev cnibpf` exists.
pub fn has_netdev_table() -> Result<bool, NftablesError> {
    exists(
        Request::new(
            NFNL_SUBSYS_NFTABLES,
            NFT_MSG_GETTABLE,
            NFPROTO_NETDEV,
            false,
        )
        .string(NFTA_TABLE_NAME, TABLE),
    )
}

/// Whether the object a GET asks for exists.
fn exists(request: Request) -> Result<bool, NftablesError> {
    let mut connection = Connection::open().map_err(NftablesError::Netlink)?;
    match connection.exchange(request, |_, _| ControlFlow::Continue(())) {
        Ok(()) => Ok(true),
        Err(error) if error.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(error) => Err(NftablesError::Netlink(error)),
    }
}

/// The comment in nftnl user data (type, length, value records).
fn user_data_comment(data: &[u8]) -> Option<String> {
    let mut rest = data;
    while rest.len() >= 2 {
        let (kind, length) = (rest[0], usize::from(rest[1]));
        let value = rest.get(2..2 + length)?;
        if kind == UDATA_COMMENT {
            let end = value
                .iter()
                .position(|byte| *byte == 0)
                // fail-closed: a comment without its terminating zero ends with its value.
                .unwrap_or(value.len());
            return Some(String::from_utf8_lossy(&value[..end]).into_owned());
        }
        rest = &rest[2 + length..];
    }
    None
}

/// A chain of the host's own firewall on a hook that traffic to and from containers passes
/// in the stack (iptables-nft's chains included).
#[derive(Debug, serde::Deserialize)]
pub struct HostChain {
    pub family: String,
    pub table: String,
    pub name: String,
    pub hook: String,
    #[serde(skip)]
    pub rules: usize,
}

/// The host's chains on the forward and input hooks that hold rules, cnibpf's table aside;
/// empty where `nft` is not installed.
pub fn firewall_chains() -> Result<Vec<HostChain>, NftablesError> {
    #[derive(serde::Deserialize)]
    struct RuleOf {
        family: String,
        table: String,
        chain: String,
    }
    if !nft_installed() {
        return Ok(Vec::new());
    }
    let output = std::process::Command::new(super::nft::NFT)
        .args(["-j", "list", "ruleset"])
        .output()
        .map_err(NftablesError::Run)?;
    if !output.status.success() {
        return Err(NftablesError::Listing(
            String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        ));
    }
    let unreadable = |error: serde_json::Error| NftablesError::Listing(error.to_string());
    let document: serde_json::Value = serde_json::from_slice(&output.stdout).map_err(unreadable)?;
    // fail-closed: a listing without objects lists no chain.
    let objects = document["nftables"].as_array().cloned().unwrap_or_default();
    let mut chains = Vec::new();
    let mut rules = Vec::new();
    for object in objects {
        if let Some(chain) = object.get("chain") {
            if chain.get("hook").is_some() {
                chains.push(HostChain::deserialize(chain).map_err(unreadable)?);
            }
        } else if let Some(rule) = object.get("rule") {
            rules.push(RuleOf::deserialize(rule).map_err(unreadable)?);
        }
    }
    chains.retain(|chain| {
        ["forward", "input"].contains(&chain.hook.as_str())
            && !(chain.family == "inet" && chain.table == TABLE)
    });
    for chain in &mut chains {
        chain.rules = rules
            .iter()
            .filter(|rule| {
                rule.family == chain.family && rule.table == chain.table && rule.chain == chain.name
            })
            .count();
    }
    chains.retain(|chain| chain.rules > 0);
    Ok(chains)
}

/// Whether `nft` is on `PATH` (looked up, not run).
pub fn nft_installed() -> bool {
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| dir.join(super::nft::NFT).is_file())
    })
}

/// Makes bridge `bridge` hand its bridged IPv4 and IPv6 frames to the IP hooks, loading
/// br_netfilter if it is not; whether cnibpf switched it on (it was off).
pub fn bridge_netfilter_on(bridge: &netlink::Link) -> Result<bool, NftablesError> {
    let loaded = || {
        Path::new(BRIDGE_SYSCTLS)
            .try_exists()
            .map_err(|source| NftablesError::HostSetting {
                action: format!("look for {BRIDGE_SYSCTLS}"),
                source,
            })
    };
    if !loaded()? {
        // fail-closed: whether modprobe worked is asked of the kernel right after.
        let _ = std::process::Command::new("modprobe")
            .arg("br_netfilter")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
    if !loaded()? {
        return Err(NftablesError::HostSetting {
            action: format!(
                "filter traffic between containers on bridge {}: br_netfilter is not available (modprobe br_netfilter)",
                bridge.name
            ),
            source: io::Error::from(io::ErrorKind::NotFound),
        });
    }
    let setting_error = |source: netlink::NetlinkError| NftablesError::HostSetting {
        action: format!("switch nf_call_iptables on bridge {}", bridge.name),
        source: io::Error::other(source.to_string()),
    };
    if netlink::bridge_netfilter(bridge.index).map_err(setting_error)? == (true, true) {
        return Ok(false);
    }
    netlink::set_bridge_netfilter(bridge.index, true).map_err(setting_error)?;
    Ok(true)
}

/// Switches hairpin mode on for bridge port `port` (a container's host-side veth, by name).
///
/// A bridge that hands its frames to the IP hooks (br_netfilter) applies a hostPort's DNAT to a
/// container's frame at the bridge layer, and when the DNAT leads back to the container itself
/// bridges the frame back out of the port it came in by — which a bridge does only in hairpin
/// mode (the reference bridge plugin's `hairpinMode`, kubelet's hairpin-veth). Without it a
/// container cannot reach its own hostPort there. nftables' own bridge family would keep the
/// bridge out of the IP hooks, but filtering between neighbours must be stateful, and bridge
/// conntrack (nf_conntrack_bridge) is not in every kernel (nor in this one).
pub fn hairpin_on(port: &str) -> Result<(), NftablesError> {
    let setting_error = |source: netlink::NetlinkError| NftablesError::HostSetting {
        action: format!("switch hairpin mode on for bridge port {port}"),
        source: io::Error::other(source.to_string()),
    };
    let Some(index) = netlink::index_of(port).map_err(setting_error)? else {
        // Gone with its pod: nothing to switch.
        return Ok(());
    };
    netlink::set_bridge_port_hairpin(index, true).map_err(setting_error)
}

/// Lets interface `name` carry packets from 127.0.0.1 (`route_localnet`); whether cnibpf
/// switched it on.
pub fn route_localnet_on(name: &str) -> Result<bool, NftablesError> {
    let path = route_localnet_path(name);
    let error = |source| NftablesError::HostSetting {
        action: format!("switch route_localnet on interface {name}"),
        source,
    };
    if std::fs::read_to_string(&path).map_err(error)?.trim() == "1" {
        return Ok(false);
    }
    std::fs::write(&path, "1").map_err(error)?;
    Ok(true)
}

/// Present once br_netfilter is loaded.
const BRIDGE_SYSCTLS: &str = "/proc/sys/net/bridge";

fn route_localnet_path(name: &str) -> String {
    format!("/proc/sys/net/ipv4/conf/{name}/route_localnet")
}

/// Switches off what cnibpf switched on, once its table is gone. An interface that is gone
/// meanwhile has nothing left to switch. Every setting is tried; the failures are reported
/// together (the table that listed them is gone: they must be switched off by hand).
pub fn restore(bridges: &[String], localnet: &[String]) -> Result<(), NftablesError> {
    let mut failed = Vec::new();
    for name in bridges {
        let switched = netlink::index_of(name).and_then(|index| match index {
            Some(index) => netlink::set_bridge_netfilter(index, false),
            None => Ok(()),
        });
        if let Err(error) = switched {
            failed.push(format!("nf_call_iptables on bridge {name}: {error}"));
        }
    }
    for name in localnet {
        match std::fs::write(route_localnet_path(name), "0") {
            Err(error) if error.kind() != io::ErrorKind::NotFound => {
                failed.push(format!("route_localnet on interface {name}: {error}"));
            }
            _ => {}
        }
    }
    if failed.is_empty() {
        return Ok(());
    }
    Err(NftablesError::Restore(failed.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_comment_is_read_from_its_user_data() {
        let mut data = vec![UDATA_COMMENT, 16];
        data.extend(b"cnibpf layout 2\0");
        assert_eq!(user_data_comment(&data).as_deref(), Some("cnibpf layout 2"));
        let mut other_first = vec![7, 2, 0, 0];
        other_first.extend(&data);
        assert_eq!(
            user_data_comment(&other_first).as_deref(),
            Some("cnibpf layout 2")
        );
        assert_eq!(user_data_comment(&[0, 9, b'x']), None, "cut short");
    }
}
