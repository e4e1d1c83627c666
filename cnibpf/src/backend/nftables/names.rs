//! Names in the table: an attachment's chains, and the owner comment that names it.

use super::{COMMENT_MAX, NftablesError};
use crate::model::Attachment;

/// The text form of an attachment kept in comments; refused when it does not fit one.
pub(super) fn owner_comment(attachment: &Attachment) -> Result<String, NftablesError> {
    let text = format!(
        "{}/{}/{}",
        attachment.network, attachment.ifname, attachment.container_id
    );
    if text.len() > COMMENT_MAX {
        return Err(NftablesError::OwnerTooLong(text));
    }
    Ok(text)
}

pub(super) fn parse_owner(comment: &str) -> Option<Attachment> {
    let mut parts = comment.splitn(3, '/');
    let (network, ifname, container_id) = (parts.next()?, parts.next()?, parts.next()?);
    Some(Attachment::new(network, container_id, ifname))
}

/// The suffix of an address's family in set names: `4` or `6`.
pub(super) fn family_suffix(ipv4: bool) -> char {
    if ipv4 { '4' } else { '6' }
}

/// The chains of an attachment: its conditions, its NAT, its masquerade guard, its filter (out,
/// in).
pub(super) fn conditions_chain(owner: u64) -> String {
    format!("c_{owner:016x}")
}

pub(super) fn nat_chain(owner: u64) -> String {
    format!("n_{owner:016x}")
}

/// The start of the name of an attachment's masquerade guard chain (in table `netdev cnibpf`).
pub(super) const GUARD_CHAIN_PREFIX: &str = "g_";

pub(super) fn guard_chain(owner: u64) -> String {
    format!("{GUARD_CHAIN_PREFIX}{owner:016x}")
}

pub(super) fn filter_chains(owner: u64) -> [String; 2] {
    [format!("f_{owner:016x}_out"), format!("f_{owner:016x}_in")]
}

/// The chain an attachment's REJECT rules jump to: it answers within the attachment's limit.
pub(super) fn reject_chain(owner: u64) -> String {
    format!("r_{owner:016x}")
}

/// The chain a `log` rule's new connections jump to, of one direction's filter chain (`out`
/// or `in`, as that chain's name ends): it logs them within its limit.
pub(super) fn log_chain(filter_chain: &str, index: u32) -> String {
    format!("l_{}_{index}", filter_chain.trim_start_matches("f_"))
}

/// The set of network `network`'s member addresses of a family: `net4_<network>`.
pub(super) fn member_set(network: &str, ipv4: bool) -> String {
    format!("net{}_{network}", family_suffix(ipv4))
}

/// The comment of a filter rule's nft rule: `rule <index>` (`log <index>` for its log rule),
/// with ` ip` or ` ip6` when the rule is written once per family (it names a network and no
/// address).
pub(super) fn rule_comment(kind: RuleComment, index: u32, family: Option<bool>) -> String {
    let kind = match kind {
        RuleComment::Rule => "rule",
        RuleComment::Log => "log",
    };
    match family {
        None => format!("{kind} {index}"),
        Some(true) => format!("{kind} {index} ip"),
        Some(false) => format!("{kind} {index} ip6"),
    }
}

/// What a filter chain's nft rule is, by its comment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RuleComment {
    Rule,
    Log,
}

/// A comment [`rule_comment`] wrote, read back: what it is, its index and family.
pub(super) fn parse_rule_comment(comment: &str) -> Option<(RuleComment, u32, Option<bool>)> {
    let mut words = comment.split(' ');
    let kind = match words.next()? {
        "rule" => RuleComment::Rule,
        "log" => RuleComment::Log,
        _ => return None,
    };
    // fail-closed: decoding a comment; one that does not parse is none of ours.
    let index = words.next()?.parse().ok()?;
    let family = match words.next() {
        None => None,
        Some("ip") => Some(true),
        Some("ip6") => Some(false),
        Some(_) => return None,
    };
    words.next().is_none().then_some((kind, index, family))
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

    #[test]
    fn rule_comments_round_trip() {
        for kind in [RuleComment::Rule, RuleComment::Log] {
            for family in [None, Some(true), Some(false)] {
                let comment = rule_comment(kind, 42, family);
                assert_eq!(parse_rule_comment(&comment), Some((kind, 42, family)));
            }
        }
        assert_eq!(rule_comment(RuleComment::Log, 7, Some(false)), "log 7 ip6");
        for other in ["default", "rule", "rule x", "rule 1 ip7", "rule 1 ip extra"] {
            assert_eq!(parse_rule_comment(other), None, "{other}");
        }
        assert_eq!(
            log_chain("f_00000000000000ab_in", 10),
            "l_00000000000000ab_in_10"
        );
    }
}
