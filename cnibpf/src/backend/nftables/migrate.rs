//! Layout 2 → 3 in place, under the instance lock, with every attachment's traffic flowing.
//!
//! Layout 3 replaced the interval sets of hairpin and masquerade (`hairpin4/6`,
//! `masq_sources4/6`, `masq_excludes4/6`: the kernel scanned every element of them on each
//! change) by a NAT chain per attachment behind the hash maps `nat4/6`, and moved what passes
//! every filter from each filter chain into the hook chains. The records (`a_` chains), the
//! hostPort maps, the filter chains' rules and their counters stay as they are. Connection
//! tracking keeps each connection's translation, so no connection notices.
//!
//! Three steps, each safe to repeat after a crash: the new shared objects; each attachment's
//! NAT chain and dispatch, from its record (both only add: the old rules still run); then one
//! transaction that rewrites the hook chains, drops what the filter chains no longer need and
//! the old sets, and adds the marker chain `layout_3`. nftables keeps a table's comment from
//! its creation, so the marker, not the comment, says that a `cnibpf layout 2` table holds
//! layout 3.

use nftables::batch::Batch;

use super::{HOOK_RULES, LAYOUT_3_OBJECTS, NftablesError, elements, listing::Listing, nft};
use crate::{backend::BackendError, journal};

/// The comment of a table of the layout this one migrates from.
pub const PREVIOUS: &str = "cnibpf layout 2";
/// The chain a migrated table carries.
pub const MARKER: &str = "layout_3";

/// The hook chains layout 3 rewrote.
const HOOK_CHAINS: [&str; 4] = ["postrouting", "forward", "input", "local_out"];
/// The sets layout 3 no longer has.
const OLD_SETS: [&str; 6] = [
    "hairpin4",
    "hairpin6",
    "masq_sources4",
    "masq_sources6",
    "masq_excludes4",
    "masq_excludes6",
];

/// Migrates table `inet cnibpf` of layout 2 (unmarked) to layout 3.
pub fn migrate() -> Result<(), BackendError> {
    nft::run_script(&["-f", "-"], LAYOUT_3_OBJECTS.as_bytes())?;
    journal::note(journal::Change::Migrated(format!(
        "nftables {PREVIOUS}: layout 3's shared maps added"
    )));
    // fail-closed: `read` kept the errors; no table lists nothing.
    let listing = Listing::read()?.unwrap_or_default();
    let mut additions = Batch::new();
    for (owner, record) in listing.records()? {
        elements::add_nat(&mut additions, owner, &record);
    }
    nft::apply(additions)?;
    journal::note(journal::Change::Migrated(
        "attachments' NAT dispatch added".to_owned(),
    ));
    nft::run_script(&["-f", "-"], switch(&listing)?.as_bytes())?;
    journal::note(journal::Change::Migrated(
        "hook chains switched to layout 3".to_owned(),
    ));
    Ok(())
}

/// The transaction that puts layout 3 in force over `listing` (a layout 2 table).
fn switch(listing: &Listing) -> Result<String, NftablesError> {
    let mut script = String::new();
    for chain in HOOK_CHAINS {
        script.push_str(&format!("flush chain inet cnibpf {chain}\n"));
    }
    script.push_str(HOOK_RULES);
    // Layout 2's filter chains began with what passes every filter, the only rules there
    // without a comment.
    for chain in listing.chain_names().filter(|name| name.starts_with("f_")) {
        for rule in listing.rules(chain) {
            if rule.comment.is_some() {
                continue;
            }
            let handle = rule.handle.ok_or_else(|| NftablesError::Rule {
                chain: chain.to_owned(),
                reason: "a rule is listed without its handle".to_owned(),
            })?;
            script.push_str(&format!(
                "delete rule inet cnibpf {chain} handle {handle}\n"
            ));
        }
    }
    for set in OLD_SETS {
        script.push_str(&format!("delete set inet cnibpf {set}\n"));
    }
    script.push_str(&format!("add chain inet cnibpf {MARKER}\n"));
    Ok(script)
}
