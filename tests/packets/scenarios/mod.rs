//! The datapath's semantics as tables of scenarios. A scenario is one readable row: frames run
//! one after the other through the pinned programs of a live attachment (`BPF_PROG_TEST_RUN`),
//! each with what must come out — the verdict, where the frame goes (addresses and ports, the
//! quoted packet of an ICMP error, every checksum verified here), and the state it leaves (its
//! connection's parts, the drop reason counted, the filter rule counted, or no state at all).
//! The map state a scenario starts from is what a real ADD of its area's configuration wrote.
//!
//! Each area (a file) is one test with one simulated host: its scenarios run in order, each on
//! ports of its own, and every row that fails is reported, not only the first.

use std::net::IpAddr;

use cnibpf_common::drops::DropReason;

use super::{DROP, NEXT, REDIRECT};

mod bench;
mod conditions;
mod craft;
mod dnat;
mod filter;
mod headers;
mod masquerade;
mod read;
mod sources;

pub use bench::Bench;
pub use craft::{Body, Packet, Peer, v4, v6};
use read::{connection_key, ends_of};

/// A port in an expectation.
#[derive(Clone, Copy, Debug)]
pub enum Port {
    Is(u16),
    /// Any port but this one (a masquerade port collision).
    Not(u16),
}

/// The frame of a step: a crafted packet, or bytes a row makes itself (malformed ones).
#[derive(Clone, Copy, Debug)]
pub enum Frame {
    Ip(Packet),
    Custom(fn(&Bench) -> Vec<u8>),
}

/// The hook a frame runs through, on the interface it is attached to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hook {
    /// The container's veth, what the container sends (c1's, or c2's for [`Peer::C2`]).
    FromContainer,
    /// The container's veth, what is sent to it.
    ToContainer,
    UplinkIngress,
    /// The uplink, what the host stack forwards out of it (a container's packet the stack
    /// forwarded: the frame as the container sent it). `BPF_PROG_TEST_RUN` gives the packet a
    /// socket of no protocol, which the hook takes for nobody's; what it does to the host's
    /// own traffic is shown by live traffic (the `kubernetes` suite).
    UplinkEgress,
}

/// What must come out of a step.
#[derive(Clone, Copy, Debug)]
pub enum Expect {
    /// Sent on (redirected, to the container or out of the uplink) rewritten to these ends;
    /// for an ICMP error, the destination's port is the source port of the packet it quotes.
    Redirected(End, End),
    /// Passed on unchanged.
    Untouched,
    /// Passed on (to the host stack, or out of the interface) rewritten to these ends.
    Rewritten(End, End),
    /// Dropped, and counted with this reason.
    Dropped(DropReason),
}

/// One end of a packet: a peer and its port.
pub type End = (Peer, Port);

/// The state a step leaves besides its drop counter.
#[derive(Clone, Copy, Debug)]
pub enum Then {
    /// Nothing more is checked.
    Nothing,
    /// The step's connection (found by its container's side) holds exactly these parts.
    Parts(u8),
    /// No connection was made or removed.
    NoState,
    /// The filter rule at this position counted the packet.
    Rule(usize),
}

/// One frame through one hook.
#[derive(Clone, Copy, Debug)]
pub struct Step {
    pub hook: Hook,
    pub frame: Frame,
    pub expect: Expect,
    pub then: Then,
}

/// A row of a table.
#[derive(Debug)]
pub struct Scenario {
    pub name: &'static str,
    pub steps: &'static [Step],
}

pub const fn step(hook: Hook, packet: Packet, expect: Expect, then: Then) -> Step {
    Step {
        hook,
        frame: Frame::Ip(packet),
        expect,
        then,
    }
}

/// A `Redirected` or `Passed` end.
pub const fn at(peer: Peer, port: u16) -> End {
    (peer, Port::Is(port))
}

/// The packet `frame` holds, as the area's addresses name it: for messages.
fn describe(bench: &Bench, frame: &Frame) -> String {
    match frame {
        Frame::Ip(packet) => format!("{packet:?}"),
        Frame::Custom(make) => format!("{} crafted bytes", make(bench).len()),
    }
}

/// Runs every scenario of `table` on `bench`: panics naming each failing row and why.
pub fn run(bench: &Bench, table: &[Scenario]) {
    let mut failures = Vec::new();
    for scenario in table {
        for (index, step) in scenario.steps.iter().enumerate() {
            if let Err(why) = run_step(bench, step) {
                failures.push(format!(
                    "{} (step {}, {:?} {}): {why}",
                    scenario.name,
                    index + 1,
                    step.hook,
                    describe(bench, &step.frame)
                ));
                break;
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} scenarios failed:\n{}",
        failures.len(),
        table.len(),
        failures.join("\n")
    );
}

fn run_step(bench: &Bench, step: &Step) -> Result<(), String> {
    let (frame, c2) = match step.frame {
        Frame::Ip(packet) => (
            bench.frame(step.hook, &packet),
            packet.src == Peer::C2 || (step.hook == Hook::ToContainer && packet.dst == Peer::C2),
        ),
        Frame::Custom(make) => (make(bench), false),
    };
    let before = Counters::read(bench, step);
    let (verdict, out) = bench
        .run(step.hook, c2, &frame)
        .ok_or("the kernel refused the run")?;
    match step.expect {
        Expect::Untouched if verdict != NEXT => {
            Err(format!("verdict {verdict}, expected it passed on"))
        }
        Expect::Untouched if out != frame => Err("passed on changed".to_owned()),
        Expect::Untouched => Ok(()),
        Expect::Dropped(reason) if verdict != DROP => {
            Err(format!("verdict {verdict}, expected a drop ({reason:?})"))
        }
        Expect::Dropped(reason) => match bench.drops(reason) - before.drops {
            1 => Ok(()),
            counted => Err(format!("{reason:?} counted {counted} times, expected once")),
        },
        Expect::Redirected(..) if verdict != REDIRECT => Err(format!(
            "verdict {verdict}, expected {REDIRECT} (redirected)"
        )),
        Expect::Redirected(src, dst) => check_ends(bench, step, &out, src, dst),
        Expect::Rewritten(..) if verdict != NEXT => {
            Err(format!("verdict {verdict}, expected it passed on"))
        }
        Expect::Rewritten(src, dst) => check_ends(bench, step, &out, src, dst),
    }?;
    check_then(bench, step, &frame, &out, &before)
}

/// Whether `out` goes from `src` to `dst`, every checksum valid; an ICMP error's ports are
/// its quote's, which must be the packet the other way.
fn check_ends(bench: &Bench, step: &Step, out: &[u8], src: End, dst: End) -> Result<(), String> {
    let ends = ends_of(out).map_err(|error| format!("{error}: {out:02x?}"))?;
    let v6 = ends.src.is_ipv6();
    let ports = ends.ports;
    check_end(
        bench,
        "source",
        ends.src,
        ports.map(|(port, _)| port),
        src,
        v6,
    )?;
    check_end(
        bench,
        "destination",
        ends.dst,
        ports.map(|(_, port)| port),
        dst,
        v6,
    )?;
    let is_error = matches!(
        step.frame,
        Frame::Ip(Packet {
            body: Body::Unreachable(_) | Body::TooBig(..),
            ..
        })
    );
    let Some(quoted) = &ends.quoted else {
        return if is_error {
            Err("the ICMP error lost its quote".to_owned())
        } else {
            Ok(())
        };
    };
    if quoted.src != ends.dst {
        return Err(format!(
            "quotes a packet from {}, sent to {}",
            quoted.src, ends.dst
        ));
    }
    match (quoted.ports, dst) {
        (Some((quoted_sport, _)), (_, Port::Is(port))) if quoted_sport != port => Err(format!(
            "quotes port {quoted_sport}, the error goes to {port}"
        )),
        _ => Ok(()),
    }
}

fn check_end(
    bench: &Bench,
    what: &str,
    address: IpAddr,
    port: Option<u16>,
    (peer, expected): End,
    v6: bool,
) -> Result<(), String> {
    let wanted = bench.address(peer, v6);
    if address != wanted {
        return Err(format!("{what} {address}, expected {peer:?} ({wanted})"));
    }
    match (port, expected) {
        (None, _) => Ok(()),
        (Some(port), Port::Is(wanted)) if port == wanted => Ok(()),
        (Some(port), Port::Not(other)) if port != other => Ok(()),
        (Some(port), expected) => Err(format!("{what} port {port}, expected {expected:?}")),
    }
}

/// The counters a step's [`Then`] and [`Expect`] compare, before it runs.
struct Counters {
    drops: u64,
    connections: usize,
    rule: u64,
}

impl Counters {
    fn read(bench: &Bench, step: &Step) -> Self {
        Self {
            drops: match step.expect {
                Expect::Dropped(reason) => bench.drops(reason),
                _ => 0,
            },
            connections: bench.sim.connections().len(),
            rule: match step.then {
                Then::Rule(position) => bench.sim.filter_rule_packets(position),
                _ => 0,
            },
        }
    }
}

fn check_then(
    bench: &Bench,
    step: &Step,
    frame: &[u8],
    out: &[u8],
    before: &Counters,
) -> Result<(), String> {
    match step.then {
        Then::Nothing => Ok(()),
        Then::NoState => {
            let now = bench.sim.connections().len();
            if now == before.connections {
                Ok(())
            } else {
                Err(format!(
                    "made state: {} connections, {now} after",
                    before.connections
                ))
            }
        }
        Then::Rule(position) => {
            let counted = bench.sim.filter_rule_packets(position) - before.rule;
            if counted == 1 {
                Ok(())
            } else {
                Err(format!(
                    "rule at {position} counted {counted} packets, expected 1"
                ))
            }
        }
        Then::Parts(parts) => {
            let key = connection_key(bench, frame, out)
                .ok_or("no container side to find its connection by")?;
            let found = bench.connection(&key).map(|connection| connection.parts);
            if found == Some(parts) {
                Ok(())
            } else {
                Err(format!(
                    "its connection has parts {found:?}, expected {parts}: {key:?}"
                ))
            }
        }
    }
}
