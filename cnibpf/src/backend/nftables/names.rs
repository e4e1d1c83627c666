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

pub(super) fn guard_chain(owner: u64) -> String {
    format!("g_{owner:016x}")
}

pub(super) fn filter_chains(owner: u64) -> [String; 2] {
    [format!("f_{owner:016x}_out"), format!("f_{owner:016x}_in")]
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
