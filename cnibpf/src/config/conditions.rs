//! The reference portmap's `conditionsV4` / `conditionsV6`: matches that gate the DNAT of an
//! attachment's hostPorts, for traffic from outside, from containers (hairpin) and from host
//! processes alike. They come in the reference's two syntaxes — iptables arguments, one flag or
//! value per element (`["!", "-s", "192.0.2.0/24"]`), or nft expressions, split or not
//! (`["ip", "saddr", "192.0.2.0/24"]`, `["ip daddr != 192.0.2.0/24"]`) — told apart as the
//! reference tells them: a first element starting with `-` or `!` is iptables.
//!
//! cnibpf understands the forms people write to narrow who reaches a hostPort: source,
//! destination and input interface, each negatable, with address lists (`-s a,b`, `{ a, b }`).
//! Anything else is refused (code 101) rather than ignored: a condition left out would expose
//! the port to clients the reference keeps out.

use std::net::IpAddr;

use ipnet::IpNet;

use cnibpf_common::portmap::conditions::MAX_TERMS;

use super::{ConfigError, ifname_problem};
pub use crate::model::conditions::{Condition, Conditions, Subject};

/// Parses `conditionsV4` (`ipv4`) or `conditionsV6` at `key`.
pub fn parse(key: &str, elements: &[String], ipv4: bool) -> Result<Conditions, ConfigError> {
    let Some(first) = elements.first() else {
        return Ok(Vec::new());
    };
    let conditions = if first.starts_with('-') || first.starts_with('!') {
        parse_iptables(key, elements)?
    } else {
        parse_nft(key, elements)?
    };
    let terms: usize = conditions
        .iter()
        .map(|condition| match &condition.subject {
            Subject::Source(nets) | Subject::Destination(nets) => nets.len(),
            Subject::InInterface(_) => 1,
        })
        .sum();
    if terms > MAX_TERMS {
        return Err(ConfigError::invalid(
            key,
            format!("{terms} addresses and interfaces; at most {MAX_TERMS} are supported"),
        ));
    }
    for condition in &conditions {
        let nets = match &condition.subject {
            Subject::Source(nets) | Subject::Destination(nets) => nets,
            Subject::InInterface(_) => continue,
        };
        if let Some(other) = nets.iter().find(|net| matches!(net, IpNet::V4(_)) != ipv4) {
            return Err(ConfigError::invalid(
                key,
                format!(
                    "{other} is not an IPv{} address: {key} applies to IPv{} hostPorts",
                    if ipv4 { 4 } else { 6 },
                    if ipv4 { 4 } else { 6 },
                ),
            ));
        }
    }
    Ok(conditions)
}

fn unsupported(key: &str, form: &str, syntax: &str) -> ConfigError {
    ConfigError::NotSupported {
        key: key.to_owned(),
        reason: format!(
            "{form:?} is not a condition cnibpf can enforce; it supports {syntax}. Refused rather than ignored: the hostPort would be open to clients the condition keeps out"
        ),
    }
}

const IPTABLES_FORMS: &str = "[!] -s/--source, [!] -d/--destination and [!] -i/--in-interface";
const NFT_FORMS: &str = "ip/ip6 saddr/daddr [!=] <address or { list }> and iifname/iif [!=] <name>";

/// iptables arguments, one flag or value per element, as the reference appends them to its
/// rule: `[!] <flag> <value>` repeated.
fn parse_iptables(key: &str, elements: &[String]) -> Result<Conditions, ConfigError> {
    let mut conditions = Vec::new();
    let mut tokens = elements.iter().map(String::as_str);
    while let Some(mut token) = tokens.next() {
        if token.contains(char::is_whitespace) {
            return Err(ConfigError::invalid(
                key,
                format!(
                    "{token:?}: each iptables flag and value is an element of its own, e.g. [\"-s\", \"192.0.2.0/24\"]"
                ),
            ));
        }
        let negated = token == "!";
        if negated {
            token = tokens.next().ok_or_else(|| {
                ConfigError::invalid(key, "\"!\" at the end: it must precede a match")
            })?;
        }
        let flag = token;
        let mut value = || {
            tokens
                .next()
                .ok_or_else(|| ConfigError::invalid(key, format!("{flag:?} needs a value")))
        };
        let subject = match flag {
            "-s" | "--source" | "--src" => Subject::Source(address_list(key, value()?)?),
            "-d" | "--destination" | "--dst" => Subject::Destination(address_list(key, value()?)?),
            "-i" | "--in-interface" => Subject::InInterface(interface(key, value()?)?),
            other => return Err(unsupported(key, other, IPTABLES_FORMS)),
        };
        if negated
            && matches!(&subject, Subject::Source(nets) | Subject::Destination(nets) if nets.len() > 1)
        {
            // iptables itself refuses this: it would expand to one rule per address.
            return Err(ConfigError::invalid(
                key,
                "\"!\" cannot be used with a list of addresses",
            ));
        }
        conditions.push(Condition { negated, subject });
    }
    Ok(conditions)
}

/// An iptables address list: `a[/p][,b[/p]…]`.
fn address_list(key: &str, text: &str) -> Result<Vec<IpNet>, ConfigError> {
    text.split(',').map(|part| address(key, part)).collect()
}

fn address(key: &str, text: &str) -> Result<IpNet, ConfigError> {
    let text = text.trim();
    if let Ok(net) = text.parse::<IpNet>() {
        return Ok(net.trunc());
    }
    text.parse::<IpAddr>().map(IpNet::from).map_err(|_| {
        ConfigError::invalid(key, format!("expected an address or CIDR, got {text:?}"))
    })
}

fn interface(key: &str, text: &str) -> Result<String, ConfigError> {
    let name = text.trim_matches('"');
    if name.ends_with('+') || name.contains('*') {
        return Err(ConfigError::NotSupported {
            key: key.to_owned(),
            reason: format!(
                "interface wildcard {name:?}: cnibpf matches input interfaces by exact name"
            ),
        });
    }
    match ifname_problem(name) {
        Some(problem) => Err(ConfigError::invalid(
            key,
            format!("interface name {name:?} {problem}"),
        )),
        None => Ok(name.to_owned()),
    }
}

/// nft expressions: the elements joined by spaces are the text the reference splices into its
/// rule. Each clause is `ip|ip6 saddr|daddr [==|!=] value` or `[meta] iifname|iif [==|!=] name`.
fn parse_nft(key: &str, elements: &[String]) -> Result<Conditions, ConfigError> {
    let text = elements.join(" ");
    let tokens = nft_tokens(&text);
    let mut conditions = Vec::new();
    let mut position = 0;
    let next = |position: &mut usize| {
        let token = tokens.get(*position).cloned();
        *position += 1;
        token
    };
    while let Some(mut word) = next(&mut position) {
        if word == "meta" {
            word = next(&mut position).unwrap_or_default();
        }
        let field = match word.as_str() {
            "ip" | "ip6" => {
                let field = next(&mut position).unwrap_or_default();
                match field.as_str() {
                    "saddr" | "daddr" => Some((word.clone(), field)),
                    _ => return Err(unsupported(key, &format!("{word} {field}"), NFT_FORMS)),
                }
            }
            "iifname" | "iif" => None,
            other => return Err(unsupported(key, other, NFT_FORMS)),
        };
        let mut negated = false;
        let mut value = next(&mut position)
            .ok_or_else(|| ConfigError::invalid(key, format!("{word:?} needs a value")))?;
        if value == "!=" || value == "==" {
            negated = value == "!=";
            value = next(&mut position)
                .ok_or_else(|| ConfigError::invalid(key, format!("{word:?} needs a value")))?;
        }
        let mut values = Vec::new();
        if value == "{" {
            loop {
                let item = next(&mut position)
                    .ok_or_else(|| ConfigError::invalid(key, "a set \"{ … }\" is not closed"))?;
                match item.as_str() {
                    "}" => break,
                    "," => {}
                    _ => values.push(item),
                }
            }
        } else {
            values.push(value);
        }
        let subject = match field {
            Some((family, direction)) => {
                let nets = values
                    .iter()
                    .map(|value| address(key, value))
                    .collect::<Result<Vec<_>, _>>()?;
                if let Some(net) = nets
                    .iter()
                    .find(|net| matches!(net, IpNet::V4(_)) != (family == "ip"))
                {
                    return Err(ConfigError::invalid(
                        key,
                        format!("{family} {direction} cannot match {net}"),
                    ));
                }
                if direction == "saddr" {
                    Subject::Source(nets)
                } else {
                    Subject::Destination(nets)
                }
            }
            None => match values.as_slice() {
                [name] => Subject::InInterface(interface(key, name)?),
                _ => return Err(unsupported(key, &format!("{word} {{ … }}"), NFT_FORMS)),
            },
        };
        conditions.push(Condition { negated, subject });
    }
    Ok(conditions)
}

/// nft words: braces and commas stand alone; quoted names keep their quotes off.
fn nft_tokens(text: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    let mut word = String::new();
    for c in text.chars() {
        match c {
            '{' | '}' | ',' => {
                if !word.is_empty() {
                    tokens.push(std::mem::take(&mut word));
                }
                tokens.push(c.to_string());
            }
            '"' => {}
            c if c.is_whitespace() => {
                if !word.is_empty() {
                    tokens.push(std::mem::take(&mut word));
                }
            }
            c => word.push(c),
        }
    }
    if !word.is_empty() {
        tokens.push(word);
    }
    tokens
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(list: &[&str]) -> Vec<String> {
        list.iter().map(|word| (*word).to_owned()).collect()
    }

    fn net(text: &str) -> IpNet {
        text.parse().expect("literal")
    }

    #[test]
    fn iptables_forms() {
        let parsed = parse(
            "conditionsV4",
            &words(&[
                "-s",
                "192.0.2.0/24,198.51.100.7",
                "!",
                "-d",
                "10.0.0.1",
                "-i",
                "eth0",
            ]),
            true,
        )
        .expect("valid");
        assert_eq!(
            parsed,
            [
                Condition {
                    negated: false,
                    subject: Subject::Source(vec![net("192.0.2.0/24"), net("198.51.100.7/32")])
                },
                Condition {
                    negated: true,
                    subject: Subject::Destination(vec![net("10.0.0.1/32")])
                },
                Condition {
                    negated: false,
                    subject: Subject::InInterface("eth0".to_owned())
                },
            ]
        );
        assert_eq!(parsed[1].to_string(), "destination not in 10.0.0.1/32");
    }

    #[test]
    fn nft_forms_split_or_joined() {
        let split = parse(
            "conditionsV6",
            &words(&[
                "ip6",
                "saddr",
                "!=",
                "{",
                "fc00::/7,",
                "2001:db8::1",
                "}",
                "iifname",
                "\"eth0\"",
            ]),
            false,
        )
        .expect("valid");
        let joined = parse(
            "conditionsV6",
            &words(&["ip6 saddr != { fc00::/7, 2001:db8::1 } meta iifname == \"eth0\""]),
            false,
        )
        .expect("valid");
        assert_eq!(split, joined);
        assert_eq!(
            split[0],
            Condition {
                negated: true,
                subject: Subject::Source(vec![net("fc00::/7"), net("2001:db8::1/128")])
            }
        );
        assert_eq!(split[1].subject, Subject::InInterface("eth0".to_owned()));
    }

    #[test]
    fn other_matches_are_refused_not_ignored() {
        for elements in [
            words(&["-m", "set", "--match-set", "allowed", "src"]),
            words(&["-p", "tcp"]),
            words(&["tcp", "dport", "80"]),
            words(&["ip", "protocol", "tcp"]),
            words(&["-i", "eth+"]),
        ] {
            let error = parse("conditionsV4", &elements, true).expect_err("unsupported");
            assert_eq!(error.code(), crate::code::NOT_SUPPORTED, "{elements:?}");
        }
    }

    #[test]
    fn mistakes_are_invalid() {
        for (elements, ipv4) in [
            (words(&["-s 192.0.2.0/24"]), true),
            (words(&["-s"]), true),
            (words(&["!", "-s", "1.2.3.4,5.6.7.8"]), true),
            (words(&["-s", "2001:db8::/32"]), true),
            (words(&["ip", "saddr", "192.0.2.0/24"]), false),
            (words(&["ip", "saddr", "{", "1.2.3.4"]), true),
            (words(&["-s", "not-an-address"]), true),
        ] {
            let error = parse("conditionsV4", &elements, ipv4).expect_err("invalid");
            assert_eq!(
                error.code(),
                crate::code::INVALID_CONFIG,
                "{elements:?}: {error}"
            );
        }
        assert_eq!(parse("conditionsV4", &[], true).expect("empty"), Vec::new());
    }
}
