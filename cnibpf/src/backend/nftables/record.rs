//! An attachment's record: everything it holds in the shared sets and maps, kept in the table
//! itself as the comments of its own chain `a_<owner id>`, which no packet ever visits. One
//! `nft list chain` reads it back, so ADD and DEL touch only what the attachment owns however
//! many others there are, and the record changes in the same transaction as what it records.
//!
//! One fact per line, each line within nftables' comment limit (long lists are split over
//! lines, consecutive hostPorts written as ranges); a line this build cannot read is an error,
//! never a default.

use std::{fmt::Write as _, net::IpAddr};

use ipnet::IpNet;

use super::COMMENT_MAX;
use crate::model::{ExcludeReason, Masquerade, Pod, Protocol, ResolvedMapping, SourceCheck};

/// What one attachment holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Record {
    /// `<network>/<ifname>/<container id>`, the comment of every element it owns.
    pub owner: String,
    /// Its host-side interface.
    pub host: String,
    pub pod: Option<Pod>,
    /// The container's addresses, with their prefixes.
    pub networks: Vec<IpNet>,
    pub masquerade: Option<Masquerade>,
    /// Hairpin traffic to its hostPorts is masqueraded (`snat` not false).
    pub hairpin: bool,
    pub mappings: Vec<ResolvedMapping>,
    /// Families whose hostPorts carry conditions (chain `c_<owner>`).
    pub conditioned_v4: bool,
    pub conditioned_v6: bool,
    /// It has a filter (chains `f_<owner>_out` and `f_<owner>_in`).
    pub filtered: bool,
    /// Its source check (chain `s_<owner>` of table `netdev cnibpf` when checked).
    pub sources: Sources,
}

/// What an attachment's record says of its source check.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Sources {
    /// Nothing: recorded by a cnibpf without source checks (checked from its next ADD).
    #[default]
    Unrecorded,
    /// `sourceCheck: false`.
    Unchecked,
    /// The addresses its container may send from.
    Checked(SourceCheck),
}

#[derive(Debug, thiserror::Error)]
#[error("line {line:?}: {reason}")]
pub struct RecordError {
    pub line: String,
    pub reason: &'static str,
}

impl Record {
    /// The record as comment lines, each at most [`COMMENT_MAX`] bytes.
    pub fn lines(&self) -> Vec<String> {
        let mut lines = vec![
            format!("owner {}", self.owner),
            format!("host {}", self.host),
        ];
        if let Some(pod) = &self.pod {
            let mut line = format!("pod {pod}");
            truncate(&mut line);
            lines.push(line);
        }
        lines.extend(self.networks.iter().map(|net| format!("network {net}")));
        if let Some(masquerade) = &self.masquerade {
            let sources: Vec<String> = masquerade.sources.iter().map(ToString::to_string).collect();
            chunked(&mut lines, "masquerade", &sources);
            for reason in [
                ExcludeReason::OwnSubnet,
                ExcludeReason::Multicast,
                ExcludeReason::Configured,
            ] {
                let nets: Vec<String> = masquerade
                    .excludes
                    .iter()
                    .filter(|(_, held)| *held == reason)
                    .map(|(net, _)| net.to_string())
                    .collect();
                if !nets.is_empty() {
                    chunked(
                        &mut lines,
                        &format!("exclude {}", reason_word(reason)),
                        &nets,
                    );
                }
            }
        }
        if self.hairpin {
            lines.push("hairpin".to_owned());
        }
        for (family, conditioned) in [(4, self.conditioned_v4), (6, self.conditioned_v6)] {
            if conditioned {
                lines.push(format!("conditions {family}"));
            }
        }
        if self.filtered {
            lines.push("filter".to_owned());
        }
        match &self.sources {
            Sources::Unrecorded => {}
            Sources::Unchecked => lines.push("sources off".to_owned()),
            Sources::Checked(check) => {
                let addresses: Vec<String> =
                    check.addresses.iter().map(ToString::to_string).collect();
                if addresses.is_empty() {
                    lines.push("sources".to_owned());
                }
                chunked(&mut lines, "sources", &addresses);
            }
        }
        for (head, ports) in mapping_groups(&self.mappings) {
            chunked(&mut lines, &head, &ports);
        }
        lines
    }

    /// Reads `lines` back; what no line says stays empty.
    pub fn parse<'a>(lines: impl IntoIterator<Item = &'a str>) -> Result<Self, RecordError> {
        let mut record = Self::default();
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
                    "4" => record.conditioned_v4 = true,
                    "6" => record.conditioned_v6 = true,
                    _ => return Err(bad("conditions of family 4 or 6")),
                },
                "filter" => record.filtered = true,
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
        if record.owner.is_empty() || record.host.is_empty() {
            return Err(RecordError {
                line: String::new(),
                reason: "a record names its owner and host interface",
            });
        }
        Ok(record)
    }
}

fn truncate(line: &mut String) {
    while line.len() > COMMENT_MAX {
        line.pop();
    }
}

/// `head word word …` over as many lines as the words need.
fn chunked(lines: &mut Vec<String>, head: &str, words: &[String]) {
    let mut line = String::new();
    for word in words {
        if !line.is_empty() && line.len() + 1 + word.len() > COMMENT_MAX {
            lines.push(std::mem::take(&mut line));
        }
        if line.is_empty() {
            line.push_str(head);
        }
        line.push(' ');
        line.push_str(word);
    }
    if !line.is_empty() {
        lines.push(line);
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

/// What a line of mappings shares: protocol, hostIP (`None`: any), container address.
type MappingGroup = (Protocol, Option<IpAddr>, IpAddr);

/// Mappings grouped by (protocol, hostIP, container address), each group's ports as
/// `host:container` words, consecutive runs as `a-b:c-d`.
fn mapping_groups(mappings: &[ResolvedMapping]) -> Vec<(String, Vec<String>)> {
    let mut groups: Vec<(MappingGroup, Vec<(u16, u16)>)> = Vec::new();
    for mapping in mappings {
        let key = (mapping.protocol, mapping.host_addr, mapping.container_addr);
        match groups.iter_mut().find(|(held, _)| *held == key) {
            Some((_, ports)) => ports.push((mapping.host_port, mapping.container_port)),
            None => groups.push((key, vec![(mapping.host_port, mapping.container_port)])),
        }
    }
    groups
        .into_iter()
        .map(|((protocol, host_addr, container_addr), mut ports)| {
            ports.sort_unstable();
            let head = format!(
                "map {protocol} {} {container_addr}",
                host_addr.map_or_else(|| "*".to_owned(), |addr| addr.to_string())
            );
            let mut words = Vec::new();
            let mut run: Option<((u16, u16), (u16, u16))> = None;
            for (host, container) in ports {
                run = match run {
                    Some((start, end))
                        if host.checked_sub(1) == Some(end.0)
                            && container.checked_sub(1) == Some(end.1) =>
                    {
                        Some((start, (host, container)))
                    }
                    Some(finished) => {
                        words.push(port_run(finished));
                        Some(((host, container), (host, container)))
                    }
                    None => Some(((host, container), (host, container))),
                };
            }
            words.extend(run.map(port_run));
            (head, words)
        })
        .collect()
}

fn port_run((start, end): ((u16, u16), (u16, u16))) -> String {
    let mut word = String::new();
    if start == end {
        let _ = write!(word, "{}:{}", start.0, start.1);
    } else {
        let _ = write!(word, "{}-{}:{}-{}", start.0, end.0, start.1, end.1);
    }
    word
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

    fn mapping(
        protocol: Protocol,
        host: Option<&str>,
        host_port: u16,
        container: &str,
        container_port: u16,
    ) -> ResolvedMapping {
        ResolvedMapping {
            protocol,
            host_addr: host.map(|addr| addr.parse().expect("literal")),
            host_port,
            container_addr: container.parse().expect("literal"),
            container_port,
        }
    }

    #[test]
    fn a_full_record_reads_back_whole_and_every_line_fits_a_comment() {
        let mut mappings: Vec<ResolvedMapping> = (20_000..21_500)
            .map(|port| mapping(Protocol::Udp, None, port, "10.22.0.2", port))
            .collect();
        mappings.extend((0..300).map(|n| {
            mapping(
                Protocol::Tcp,
                Some("2001:db8:ffff:ffff:ffff:ffff:ffff:fff1"),
                1_000 + 7 * n,
                "fd00:22::2",
                80,
            )
        }));
        mappings.push(mapping(
            Protocol::Sctp,
            Some("203.0.113.1"),
            9,
            "10.22.0.2",
            9,
        ));
        let record = Record {
            owner: format!("{}/eth0/{}", "n".repeat(40), "c".repeat(64)),
            host: "veth0123456789a".to_owned(),
            pod: Some(Pod {
                namespace: "shop".to_owned(),
                name: "web-0".to_owned(),
            }),
            networks: vec![
                "10.22.0.2/16".parse().expect("literal"),
                "fd00:22::2/64".parse().expect("literal"),
            ],
            masquerade: Some(Masquerade {
                sources: vec![
                    "10.22.0.2".parse().expect("literal"),
                    "fd00:22::2".parse().expect("literal"),
                ],
                excludes: (0..40)
                    .map(|n| {
                        (
                            format!("2001:db8:{n:x}::/48").parse().expect("literal"),
                            ExcludeReason::Configured,
                        )
                    })
                    .chain([(
                        "224.0.0.0/4".parse().expect("literal"),
                        ExcludeReason::Multicast,
                    )])
                    .collect(),
            }),
            hairpin: true,
            mappings,
            conditioned_v4: true,
            conditioned_v6: false,
            filtered: true,
            sources: Sources::Checked(SourceCheck::new(
                (0..8)
                    .map(|n| format!("2001:db8:ffff:ffff:ffff:ffff:ffff:{n:x}"))
                    .chain(["10.22.0.2".to_owned(), "fe80::1".to_owned()])
                    .map(|text| text.parse().expect("literal")),
            )),
        };
        let lines = record.lines();
        assert!(
            lines.iter().all(|line| line.len() <= COMMENT_MAX),
            "{lines:#?}"
        );
        assert!(
            lines
                .iter()
                .any(|line| line.ends_with(" 20000-21499:20000-21499")),
            "a port range is one word"
        );
        let mut read = Record::parse(lines.iter().map(String::as_str)).expect("readable");
        read.mappings
            .sort_by_key(|m| (m.protocol, m.host_addr, m.host_port));
        let mut expected = record.clone();
        expected
            .mappings
            .sort_by_key(|m| (m.protocol, m.host_addr, m.host_port));
        expected
            .masquerade
            .as_mut()
            .expect("set")
            .excludes
            .sort_by_key(|(_, reason)| *reason as u32);
        read.masquerade
            .as_mut()
            .expect("set")
            .excludes
            .sort_by_key(|(_, reason)| *reason as u32);
        assert_eq!(read, expected);
    }

    #[test]
    fn each_source_check_state_reads_back_as_itself() {
        for sources in [
            Sources::Unrecorded,
            Sources::Unchecked,
            // Without addresses, still a check: everything is dropped.
            Sources::Checked(SourceCheck::default()),
        ] {
            let record = Record {
                owner: "n/eth0/c".to_owned(),
                host: "veth1".to_owned(),
                sources: sources.clone(),
                ..Record::default()
            };
            let read = Record::parse(record.lines().iter().map(String::as_str)).expect("readable");
            assert_eq!(read.sources, sources);
        }
    }

    #[test]
    fn an_unreadable_line_is_an_error_not_a_default() {
        let error = Record::parse(["owner n/eth0/c", "host veth1", "maps tcp * 10.0.0.2 1:1"])
            .expect_err("unknown line");
        assert_eq!(error.reason, "unknown record line");
        assert!(
            Record::parse(["owner n/eth0/c", "host veth1", "map tcp * 10.0.0.2 5-1:5-1"]).is_err()
        );
        assert!(Record::parse(["host veth1"]).is_err(), "no owner");
    }
}
