//! Typed nft objects (the `nftables` crate's JSON schema) for what this backend writes and
//! reads, and the runs of `nft` that apply a batch and list one object.

use std::{
    borrow::Cow,
    io::Write as _,
    net::IpAddr,
    process::{Command, Stdio},
};

use ipnet::IpNet;
use nftables::{
    batch::Batch,
    expr::{Elem, Expression, Meta, MetaKey, NamedExpression, Payload, PayloadField, Prefix},
    schema::{Chain, Element, NfListObject, Rule},
    stmt::{Counter, JumpTarget, Match, Operator, Statement},
    types::NfFamily,
};
use serde::Deserialize as _;
use serde_json::Value;

use super::NftablesError;

pub const NFT: &str = "nft";
/// The table, in family `inet`.
pub const TABLE: &str = "cnibpf";
pub const FAMILY: NfFamily = NfFamily::INet;
/// The family of the table of the same name that holds what hooks on one interface: the
/// source checks and the masquerade guard.
pub const NETDEV: NfFamily = NfFamily::NetDev;

/// A string expression (an address, a protocol name, an interface name).
pub fn text(value: impl ToString) -> Expression<'static> {
    Expression::String(Cow::Owned(value.to_string()))
}

pub fn number(value: u16) -> Expression<'static> {
    Expression::Number(u32::from(value))
}

/// An address, or a network as a prefix (a host route as its address, as nft lists it).
pub fn network(net: IpNet) -> Expression<'static> {
    let net = net.trunc();
    if net.prefix_len() == net.max_prefix_len() {
        return text(net.addr());
    }
    Expression::Named(NamedExpression::Prefix(Prefix {
        addr: Box::new(text(net.addr())),
        len: u32::from(net.prefix_len()),
    }))
}

pub fn concat(parts: Vec<Expression<'static>>) -> Expression<'static> {
    Expression::Named(NamedExpression::Concat(parts))
}

/// A header field: `ip saddr`, `th dport`, ...
pub fn payload(protocol: &'static str, field: &'static str) -> Expression<'static> {
    Expression::Named(NamedExpression::Payload(Payload::PayloadField(
        PayloadField {
            protocol: protocol.into(),
            field: field.into(),
        },
    )))
}

pub fn meta(key: MetaKey) -> Expression<'static> {
    Expression::Named(NamedExpression::Meta(Meta { key }))
}

/// The address field of `addr`'s family: `ip saddr` or `ip6 saddr` for `field` "saddr".
pub fn address_field(ipv4: bool, field: &'static str) -> Expression<'static> {
    payload(if ipv4 { "ip" } else { "ip6" }, field)
}

pub fn matches(
    left: Expression<'static>,
    operator: Operator,
    right: Expression<'static>,
) -> Statement<'static> {
    Statement::Match(Match {
        left,
        right,
        op: operator,
    })
}

/// A set or map element carrying the owner's text in its comment.
pub fn owned(key: Expression<'static>, owner: &str) -> Expression<'static> {
    Expression::Named(NamedExpression::Elem(Elem {
        val: Box::new(key),
        comment: Some(Cow::Owned(owner.to_owned())),
        ..Elem::default()
    }))
}

/// A map element: `key : value`.
pub fn mapping(key: Expression<'static>, value: Expression<'static>) -> Expression<'static> {
    Expression::List(vec![key, value])
}

/// A verdict-map value: `jump <chain>` or `goto <chain>`.
pub fn jump(chain: &str, goto: bool) -> Expression<'static> {
    let target = JumpTarget {
        target: Cow::Owned(chain.to_owned()),
    };
    Expression::Verdict(if goto {
        nftables::expr::Verdict::Goto(target)
    } else {
        nftables::expr::Verdict::Jump(target)
    })
}

pub fn chain_of(name: &str) -> Chain<'static> {
    Chain {
        family: FAMILY,
        table: TABLE.into(),
        name: Cow::Owned(name.to_owned()),
        ..Chain::default()
    }
}

pub fn chain(name: &str) -> NfListObject<'static> {
    NfListObject::Chain(chain_of(name))
}

pub fn rule(
    chain: &str,
    expr: Vec<Statement<'static>>,
    comment: Option<String>,
) -> NfListObject<'static> {
    NfListObject::Rule(Rule {
        family: FAMILY,
        table: TABLE.into(),
        chain: Cow::Owned(chain.to_owned()),
        expr: Cow::Owned(expr),
        comment: comment.map(Cow::Owned),
        ..Rule::default()
    })
}

pub fn elements(set: &str, elements: Vec<Expression<'static>>) -> NfListObject<'static> {
    NfListObject::Element(Element {
        family: FAMILY,
        table: TABLE.into(),
        name: Cow::Owned(set.to_owned()),
        elem: Cow::Owned(elements),
    })
}

/// `object` (a chain, rule or element of table `inet cnibpf`) in table `netdev cnibpf`.
pub fn in_netdev(object: NfListObject<'static>) -> NfListObject<'static> {
    match object {
        NfListObject::Chain(chain) => NfListObject::Chain(Chain {
            family: NETDEV,
            ..chain
        }),
        NfListObject::Rule(rule) => NfListObject::Rule(Rule {
            family: NETDEV,
            ..rule
        }),
        NfListObject::Element(element) => NfListObject::Element(Element {
            family: NETDEV,
            ..element
        }),
        other => other,
    }
}

/// Applies `batch` in one transaction (`nft -j -f -`).
pub fn apply(batch: Batch<'static>) -> Result<(), NftablesError> {
    apply_parts(vec![commands(batch)?])
}

/// Applies `first` (commands as nft's JSON has them), then `batch`, in one transaction.
pub fn apply_after(first: Vec<Value>, batch: Batch<'static>) -> Result<(), NftablesError> {
    apply_parts(vec![first, commands(batch)?])
}

/// The commands of `batch` as nft's JSON has them.
pub fn commands(batch: Batch<'static>) -> Result<Vec<Value>, NftablesError> {
    let document = serde_json::to_value(batch.to_nftables())
        .map_err(|error| NftablesError::Encode(error.to_string()))?;
    // fail-closed: a document the crate made without commands has none.
    Ok(document["nftables"].as_array().cloned().unwrap_or_default())
}

/// Applies the commands of every part, in order, in one transaction; nothing to apply is no
/// run of `nft`.
pub fn apply_parts(parts: Vec<Vec<Value>>) -> Result<(), NftablesError> {
    let commands: Vec<Value> = parts.into_iter().flatten().collect();
    if commands.is_empty() {
        return Ok(());
    }
    let payload = serde_json::to_vec(&serde_json::json!({ "nftables": commands }))
        .map_err(|error| NftablesError::Encode(error.to_string()))?;
    run_script(&["-j", "-f", "-"], &payload)
}

/// Runs `nft <args>` with `input` on stdin.
pub fn run_script(args: &[&str], input: &[u8]) -> Result<(), NftablesError> {
    let mut child = Command::new(NFT)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(NftablesError::Run)?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(input).map_err(NftablesError::Run)?;
    }
    let output = child.wait_with_output().map_err(NftablesError::Run)?;
    if output.status.success() {
        Ok(())
    } else {
        Err(NftablesError::Refused(
            String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        ))
    }
}

/// One object of a listing: a set or map (its elements), a chain, a rule.
#[derive(Debug)]
pub enum Listed {
    Set(ListedSet),
    Chain(String),
    Rule(Rule<'static>),
}

/// A set or map as listed: its name and elements (`[key, value]` pairs for a map). Read with
/// a type of our own: the crate's set schema knows no `verdict` data type and nft 1.0.6 lists
/// a map's concatenated data type as one string.
#[derive(Debug, serde::Deserialize)]
pub struct ListedSet {
    pub name: String,
    #[serde(default)]
    pub elem: Vec<Expression<'static>>,
}

#[derive(serde::Deserialize)]
struct ListedChain {
    name: String,
}

/// `nft -j list <what…>`, typed: `None` when the object does not exist.
pub fn list(what: &[&str]) -> Result<Option<Vec<Listed>>, NftablesError> {
    let output = Command::new(NFT)
        .arg("-j")
        .arg("list")
        .args(what)
        .stdin(Stdio::null())
        .output()
        .map_err(NftablesError::Run)?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        if stderr.contains("No such file or directory") {
            return Ok(None);
        }
        return Err(NftablesError::Listing(stderr.trim().to_owned()));
    }
    let unreadable = |error: serde_json::Error| NftablesError::Listing(error.to_string());
    let document: Value = serde_json::from_slice(&output.stdout).map_err(unreadable)?;
    let mut objects = Vec::new();
    for object in document["nftables"].as_array().into_iter().flatten() {
        if let Some(set) = object.get("set").or_else(|| object.get("map")) {
            objects.push(Listed::Set(
                ListedSet::deserialize(set).map_err(unreadable)?,
            ));
        } else if let Some(chain) = object.get("chain") {
            objects.push(Listed::Chain(
                ListedChain::deserialize(chain).map_err(unreadable)?.name,
            ));
        } else if let Some(rule) = object.get("rule") {
            objects.push(Listed::Rule(Rule::deserialize(rule).map_err(unreadable)?));
        }
    }
    Ok(Some(objects))
}

/// An address read back from a listing.
pub fn address_of(expression: &Expression<'_>) -> Option<IpAddr> {
    match expression {
        // fail-closed: decoding a listing; text that is no address is none.
        Expression::String(text) => text.parse().ok(),
        _ => None,
    }
}

/// A network read back from a listing: a prefix, or an address as its host route.
pub fn network_of(expression: &Expression<'_>) -> Option<IpNet> {
    match expression {
        Expression::Named(NamedExpression::Prefix(prefix)) => {
            // fail-closed: as above, for a prefix.
            IpNet::new(address_of(&prefix.addr)?, u8::try_from(prefix.len).ok()?).ok()
        }
        other => address_of(other).map(IpNet::from),
    }
}

/// A port read back from a listing.
pub fn port_of(expression: &Expression<'_>) -> Option<u16> {
    match expression {
        // fail-closed: as above, for a port.
        Expression::Number(number) => u16::try_from(*number).ok(),
        _ => None,
    }
}

/// The (packets, bytes) of a listed rule's counter, if it has one.
pub fn counter_of(statements: &[Statement<'_>]) -> Option<(u64, u64)> {
    statements.iter().find_map(|statement| match statement {
        Statement::Counter(Counter::Anonymous(Some(counter))) => Some((
            // fail-closed: a counter nft lists without values has counted nothing.
            counter.packets.unwrap_or(0) as u64,
            // fail-closed: as above.
            counter.bytes.unwrap_or(0) as u64,
        )),
        _ => None,
    })
}
