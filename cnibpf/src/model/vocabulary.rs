//! The words of the configuration, written once: each vocabulary enum parses its spellings
//! (case-insensitively, as the reference plugins accept them) with `FromStr` and prints its
//! canonical one with `Display`. Config, both backends, inspect and monitor use these.

use std::{fmt, str::FromStr};

use cnibpf_common::{PROTO_ICMP, PROTO_ICMPV6, PROTO_SCTP, PROTO_TCP, PROTO_UDP};

/// A word that is none of a vocabulary's: what was expected, for the error message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownWord {
    pub expected: &'static str,
}

/// Declares a vocabulary enum: its variants with their canonical spelling, parsed
/// case-insensitively, and the phrase that lists them in error messages.
macro_rules! vocabulary {
    ($(#[$meta:meta])* $name:ident, $expected:literal, { $($variant:ident => $word:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum $name {
            $($variant),+
        }

        impl $name {
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];

            /// The canonical spelling.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $word),+
                }
            }
        }

        impl FromStr for $name {
            type Err = UnknownWord;

            fn from_str(text: &str) -> Result<Self, UnknownWord> {
                Self::ALL
                    .iter()
                    .copied()
                    .find(|known| known.as_str().eq_ignore_ascii_case(text))
                    .ok_or(UnknownWord { expected: $expected })
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
                text.parse().map_err(|unknown: UnknownWord| {
                    serde::de::Error::custom(format!("{text:?} is none of {}", unknown.expected))
                })
            }
        }
    };
}

vocabulary!(
    /// `backend`: which datapath serves the configuration.
    BackendChoice, "\"auto\", \"ebpf\" or \"nftables\"", {
        Auto => "auto",
        Ebpf => "ebpf",
        Nftables => "nftables",
    }
);

vocabulary!(
    /// The protocol of a port mapping.
    Protocol, "\"tcp\", \"udp\" or \"sctp\"", {
        Tcp => "tcp",
        Udp => "udp",
        Sctp => "sctp",
    }
);

vocabulary!(
    /// A filter rule's verdict, and `filterDefault` (which is not REJECT).
    Target, "\"ALLOW\", \"DROP\" or \"REJECT\"", {
        Allow => "ALLOW",
        Drop => "DROP",
        Reject => "REJECT",
    }
);

vocabulary!(
    /// The protocol a filter rule matches.
    RuleProtocol, "tcp, udp, sctp, icmp, icmpv6 or any", {
        Any => "any",
        Tcp => "tcp",
        Udp => "udp",
        Sctp => "sctp",
        Icmp => "icmp",
        Icmpv6 => "icmpv6",
    }
);

vocabulary!(
    /// Which packets of a connection a filter rule matches.
    ConnState, "new, established or any", {
        New => "new",
        Established => "established",
        Any => "any",
    }
);

vocabulary!(
    /// Which way a filter rule applies: towards the container, from it, or both.
    Direction, "ingress, egress or both", {
        Ingress => "ingress",
        Egress => "egress",
        Both => "both",
    }
);

vocabulary!(
    /// What a filter rule does to an attachment's rules (the CNI filter proposal's `action`):
    /// `insert` and `append` add it, `delete` removes the rule at its index.
    RuleAction, "insert, append or delete", {
        Insert => "insert",
        Append => "append",
        Delete => "delete",
    }
);

impl Protocol {
    /// The IANA protocol number, as map keys and nft carry it.
    pub fn number(self) -> u8 {
        match self {
            Self::Tcp => PROTO_TCP,
            Self::Udp => PROTO_UDP,
            Self::Sctp => PROTO_SCTP,
        }
    }

    pub fn from_number(number: u8) -> Option<Self> {
        Self::ALL
            .iter()
            .copied()
            .find(|protocol| protocol.number() == number)
    }
}

impl RuleProtocol {
    /// The IANA protocol number; `None` for `any`.
    pub fn number(self) -> Option<u8> {
        match self {
            Self::Any => None,
            Self::Tcp => Some(PROTO_TCP),
            Self::Udp => Some(PROTO_UDP),
            Self::Sctp => Some(PROTO_SCTP),
            Self::Icmp => Some(PROTO_ICMP),
            Self::Icmpv6 => Some(PROTO_ICMPV6),
        }
    }

    pub fn from_number(number: Option<u8>) -> Option<Self> {
        Self::ALL
            .iter()
            .copied()
            .find(|protocol| protocol.number() == number)
    }

    /// Whether rules of this protocol may name ports.
    pub fn has_ports(self) -> bool {
        matches!(self, Self::Tcp | Self::Udp | Self::Sctp)
    }
}

/// The name of an IANA protocol number as people write it (`tcp`, `icmpv6`, or the number).
pub fn protocol_name(number: u8) -> String {
    RuleProtocol::from_number(Some(number))
        .map_or_else(|| number.to_string(), |protocol| protocol.to_string())
}

/// An inclusive port range; a single port is a range of one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PortRange {
    pub low: u16,
    pub high: u16,
}

/// Why a port range does not parse.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortRangeError {
    /// Not a port 1-65535 or `low-high`.
    Malformed,
    /// `low` is above `high`.
    Empty { low: u16, high: u16 },
}

impl PortRange {
    pub const fn single(port: u16) -> Self {
        Self {
            low: port,
            high: port,
        }
    }
}

impl FromStr for PortRange {
    type Err = PortRangeError;

    fn from_str(text: &str) -> Result<Self, PortRangeError> {
        let port = |text: &str| {
            text.trim()
                .parse::<u16>()
                .ok()
                .filter(|port| *port != 0)
                .ok_or(PortRangeError::Malformed)
        };
        let range = match text.split_once('-') {
            None => Self::single(port(text)?),
            Some((low, high)) => Self {
                low: port(low)?,
                high: port(high)?,
            },
        };
        if range.low > range.high {
            return Err(PortRangeError::Empty {
                low: range.low,
                high: range.high,
            });
        }
        Ok(range)
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.low == self.high {
            write!(f, "{}", self.low)
        } else {
            write!(f, "{}-{}", self.low, self.high)
        }
    }
}

/// As written in a configuration: `"80"` or `"1000-2000"`.
impl serde::Serialize for PortRange {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for PortRange {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        text.parse()
            .map_err(|_| serde::de::Error::custom(format!("{text:?} is not a port range")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_parse_in_any_case_and_print_canonically() {
        assert_eq!("TCP".parse(), Ok(Protocol::Tcp));
        assert_eq!("Drop".parse(), Ok(Target::Drop));
        assert_eq!("ICMPv6".parse(), Ok(RuleProtocol::Icmpv6));
        assert_eq!("Established".parse(), Ok(ConnState::Established));
        assert_eq!("EGRESS".parse(), Ok(Direction::Egress));
        assert_eq!("nfTables".parse(), Ok(BackendChoice::Nftables));
        assert_eq!(Target::Allow.to_string(), "ALLOW");
        assert_eq!(RuleProtocol::Icmpv6.to_string(), "icmpv6");
        for protocol in Protocol::ALL {
            assert_eq!(protocol.to_string().parse(), Ok(*protocol));
            assert_eq!(Protocol::from_number(protocol.number()), Some(*protocol));
        }
        for protocol in RuleProtocol::ALL {
            assert_eq!(
                RuleProtocol::from_number(protocol.number()),
                Some(*protocol)
            );
        }
    }

    #[test]
    fn unknown_words_say_what_was_expected() {
        assert_eq!(
            "gre".parse::<RuleProtocol>(),
            Err(UnknownWord {
                expected: "tcp, udp, sctp, icmp, icmpv6 or any"
            })
        );
        assert!("related".parse::<ConnState>().is_err());
        assert!("".parse::<Target>().is_err());
    }

    #[test]
    fn port_ranges() {
        assert_eq!("80".parse(), Ok(PortRange::single(80)));
        assert_eq!(
            " 1000 - 2000".parse(),
            Ok(PortRange {
                low: 1000,
                high: 2000
            })
        );
        assert_eq!(
            "90-80".parse::<PortRange>(),
            Err(PortRangeError::Empty { low: 90, high: 80 })
        );
        for bad in ["0", "65536", "abc", "1-", "-5", "1-2-3"] {
            assert_eq!(
                bad.parse::<PortRange>(),
                Err(PortRangeError::Malformed),
                "{bad}"
            );
        }
        assert_eq!(PortRange::single(53).to_string(), "53");
        assert_eq!(PortRange { low: 1, high: 9 }.to_string(), "1-9");
    }

    #[test]
    fn words_and_ranges_round_trip_through_json() {
        let json = serde_json::to_string(&(Target::Drop, PortRange { low: 1, high: 9 }))
            .expect("serialisable");
        assert_eq!(json, r#"["DROP","1-9"]"#);
        assert_eq!(
            serde_json::from_str::<(Target, PortRange)>(&json).expect("readable"),
            (Target::Drop, PortRange { low: 1, high: 9 })
        );
        assert!(serde_json::from_str::<Target>(r#""ACCEPT""#).is_err());
        assert!(serde_json::from_str::<PortRange>(r#""9-1""#).is_err());
    }

    #[test]
    fn protocol_names() {
        assert_eq!(protocol_name(6), "tcp");
        assert_eq!(protocol_name(58), "icmpv6");
        assert_eq!(protocol_name(47), "47");
    }
}
