//! The records of layout 3 (and of layout 2 tables migrated to it), kept in the table as the
//! comments of each attachment's chain `a_<owner>` (one fact per line), read for the
//! migration to this layout.

use std::net::IpAddr;

use crate::{
    backend::nftables::record::{Record, Sources},
    model::{ExcludeReason, Masquerade, Pod, Protocol, ResolvedMapping, SourceCheck},
};

/// A record of layout 3: what this layout records, but for the filter's rules and the
/// hostPort conditions, which only their chains held.
#[derive(Debug, Default)]
pub struct CommentRecord {
    pub record: Record,
    /// It had a filter (chains `f_<owner>_out` and `f_<owner>_in`).
    pub filtered: bool,
    /// Its hostPorts of a family had conditions (chain `c_<owner>`).
    pub conditioned_v4: bool,
    pub conditioned_v6: bool,
}

#[derive(Debug, thiserror::Error)]
#[error("line {line:?}: {reason}")]
pub struct RecordError {
    pub line: String,
    pub reason: &'static str,
}

impl CommentRecord {
    /// Reads `lines` back; what no line says stays empty.
    pub fn parse<'a>(lines: impl IntoIterator<Item = &'a str>) -> Result<Self, RecordError> {
        let mut read = Self::default();
        let record = &mut read.record;
        for line in lines {
            let bad = |reason| RecordError {
                line: line.to_owned(),
                reason,
            };
            let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
            match word {
                "owner" => record.owner = rest.to_owned(),
                "host" => record.host = rest.to_owned(),
                "pod" => {
                    let (namespace, name) = rest
                        .split_once('/')
                        .ok_or_else(|| bad("a pod is namespace/name"))?;
                    record.pod = Some(Pod {
                        namespace: namespace.to_owned(),
                        name: name.to_owned(),
                    });
                }
                "network" => record
                    .networks
                    .push(rest.parse().map_err(|_| bad("not a network"))?),
                "masquerade" => {
                    let masquerade = record.masquerade.get_or_insert_with(Masquerade::default);
                    for word in rest.split(' ') {
                        masquerade
                            .sources
                            .push(word.parse().map_err(|_| bad("not an address"))?);
                    }
                }
                "exclude" => {
                    let (reason, nets) = rest
                        .split_once(' ')
                        .ok_or_else(|| bad("exclude <reason> <nets>"))?;
                    let reason =
                        reason_of(reason).ok_or_else(|| bad("unknown exclusion reason"))?;
                    let masquerade = record.masquerade.get_or_insert_with(Masquerade::default);
                    for word in nets.split(' ') {
                        masquerade
                            .excludes
                            .push((word.parse().map_err(|_| bad("not a network"))?, reason));
                    }
                }
                "hairpin" => record.hairpin = true,
                "conditions" => match rest {
                    "4" => read.conditioned_v4 = true,
                    "6" => read.conditioned_v6 = true,
                    _ => return Err(bad("conditions of family 4 or 6")),
                },
                "filter" => read.filtered = true,
                "sources" if rest == "off" => record.sources = Sources::Unchecked,
                "sources" => {
                    if !matches!(record.sources, Sources::Checked(_)) {
                        record.sources = Sources::Checked(SourceCheck::default());
                    }
                    if let Sources::Checked(check) = &mut record.sources {
                        for word in rest.split(' ').filter(|word| !word.is_empty()) {
                            check
                                .addresses
                                .push(word.parse().map_err(|_| bad("not an address"))?);
                        }
                    }
                }
                "map" => record.mappings.extend(
                    parse_mappings(rest)
                        .ok_or_else(|| bad("map <proto> <hostIP|*> <container> <ports>"))?,
                ),
                _ => return Err(bad("unknown record line")),
            }
        }
        if read.record.owner.is_empty() || read.record.host.is_empty() {
            return Err(RecordError {
                line: String::new(),
                reason: "a record names its owner and host interface",
            });
        }
        Ok(read)
    }
}

fn reason_word(reason: ExcludeReason) -> &'static str {
    match reason {
        ExcludeReason::OwnSubnet => "own",
        ExcludeReason::Multicast => "multicast",
        ExcludeReason::Configured => "configured",
    }
}

fn reason_of(word: &str) -> Option<ExcludeReason> {
    [
        ExcludeReason::OwnSubnet,
        ExcludeReason::Multicast,
        ExcludeReason::Configured,
    ]
    .into_iter()
    .find(|reason| reason_word(*reason) == word)
}

/// `<proto> <hostIP|*> <container> <ports…>` back into mappings.
fn parse_mappings(text: &str) -> Option<Vec<ResolvedMapping>> {
    let mut words = text.split(' ');
    let protocol: Protocol = words.next()?.parse().ok()?;
    let host_addr = match words.next()? {
        "*" => None,
        addr => Some(addr.parse().ok()?),
    };
    let container_addr: IpAddr = words.next()?.parse().ok()?;
    let mut mappings = Vec::new();
    for word in words {
        let (hosts, containers) = word.split_once(':')?;
        let range = |text: &str| -> Option<(u16, u16)> {
            match text.split_once('-') {
                Some((low, high)) => Some((low.parse().ok()?, high.parse().ok()?)),
                None => {
                    let port = text.parse().ok()?;
                    Some((port, port))
                }
            }
        };
        let (host_low, host_high) = range(hosts)?;
        let (container_low, container_high) = range(containers)?;
        if host_high < host_low
            || host_high - host_low != container_high.checked_sub(container_low)?
        {
            return None;
        }
        for offset in 0..=host_high - host_low {
            mappings.push(ResolvedMapping {
                protocol,
                host_addr,
                host_port: host_low + offset,
                container_addr,
                container_port: container_low + offset,
            });
        }
    }
    Some(mappings)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_of_layout_3_reads_whole() {
        let read = CommentRecord::parse([
            "owner net/eth0/c0ffee",
            "host veth1",
            "pod shop/web-0",
            "network 10.22.0.2/16",
            "masquerade 10.22.0.2",
            "exclude own 10.22.0.0/16",
            "exclude multicast 224.0.0.0/4",
            "hairpin",
            "conditions 4",
            "filter",
            "sources 10.22.0.2 fe80::1",
            "map tcp * 10.22.0.2 8080-8081:80-81 9000:90",
        ])
        .expect("readable");
        assert!(read.filtered && read.conditioned_v4 && !read.conditioned_v6);
        let record = read.record;
        assert_eq!(record.owner, "net/eth0/c0ffee");
        assert_eq!(record.mappings.len(), 3);
        assert_eq!(record.mappings[1].container_port, 81);
        assert_eq!(
            record.masquerade.expect("masqueraded").excludes[1].1,
            ExcludeReason::Multicast
        );
        assert!(matches!(record.sources, Sources::Checked(check) if check.addresses.len() == 2));
        assert!(record.hairpin);
    }

    #[test]
    fn an_unreadable_line_is_an_error_not_a_default() {
        let error =
            CommentRecord::parse(["owner n/eth0/c", "host veth1", "maps tcp * 10.0.0.2 1:1"])
                .expect_err("unknown line");
        assert_eq!(error.reason, "unknown record line");
        assert!(
            CommentRecord::parse(["owner n/eth0/c", "host veth1", "map tcp * 10.0.0.2 5-1:5-1"])
                .is_err()
        );
        assert!(CommentRecord::parse(["host veth1"]).is_err(), "no owner");
    }
}
