//! The datapath's own pinned programs on one crafted segment each, timed by the kernel
//! (`BPF_PROG_TEST_RUN`) one run per call, so that every run meets the segment as sent (a run
//! rewrites it in place): what a path costs with its maps hot and its segment uncloned, to set
//! beside what the same path costs in traffic. The median of single runs, less that of a
//! program that does nothing (the test run's own clock reads). Each case names how its segment
//! leaves the program, checked on a run before the timed ones: a figure is only taken of the
//! path it is named for.

use std::{ffi::CString, net::Ipv4Addr, os::fd::OwnedFd, path::Path};

use anyhow::{Context as _, Result, bail};
use cnibpf_tests::{
    packet,
    raw_bpf::{bpf, instruction, load_classifier, owned},
};

use super::{
    median,
    prices::{SK_BUFF_IFINDEX_OFF, SK_BUFF_SIZE, test_run},
};

/// Single runs per case, in `PASSES` passes.
pub const RUNS: usize = 4_000;
const PASSES: usize = 8;
const BPF_OBJ_GET: libc::c_long = 7;

/// An IPv4 address and port.
pub type Endpoint = (Ipv4Addr, u16);

/// A segment to run a program on: where it runs, the segment's addresses and ports, and theirs
/// as the program leaves them.
#[derive(Clone)]
pub struct Case {
    pub name: String,
    /// The pinned program's name under `programs/`.
    pub program: &'static str,
    /// The host namespace's interface it runs on.
    pub interface: String,
    pub source: Endpoint,
    pub destination: Endpoint,
    /// Source and destination of the segment as it leaves the program, and its verdict.
    pub leaves: (Endpoint, Endpoint),
    pub verdict: i32,
    /// A program the segment runs through first, unchecked, on the uplink: where the build
    /// opens the segment's connection when it is not `program` (a masqueraded connection's
    /// first packet crosses the host stack, and the uplink's egress masquerades it; builds
    /// before 0.6.0 take a test run's packet there for the host's own and leave it alone).
    pub opened_by: Option<&'static str>,
    /// Whether the segment opens a connection: a SYN, from a port of its own on every run
    /// (counting up from `source`'s, which the check's run takes), so that no run meets the
    /// state an earlier one left.
    pub opens: bool,
    /// A program on the uplink's egress the segment goes on to, timed with `program`, when
    /// `program` leaves it to the host stack untouched: where a build masquerades a
    /// connection's first packet (this one behind the host stack, 0.5.1 at the container's
    /// veth), so that the figure is the whole path's in either.
    pub then: Option<&'static str>,
}

/// A case ready to run: its programs, contexts and segment, and whether it runs through
/// `then` too.
struct Prepared {
    program: OwnedFd,
    context: [u8; SK_BUFF_SIZE],
    then: Option<OwnedFd>,
    uplink: [u8; SK_BUFF_SIZE],
    /// The segment of every run, or of the check's run only for a case that opens its
    /// connection (see [`Case::opens`]).
    segment: Vec<u8>,
}

impl Prepared {
    /// The case's time on its segment of `run` (see [`Case::opens`]).
    fn run(&self, case: &Case, run: u16) -> Result<f64> {
        let fresh;
        let sent = if case.opens {
            fresh = segment(case, run);
            &fresh
        } else {
            &self.segment
        };
        let first = test_run(&self.program, sent, 1, Some(&self.context))?;
        let Some(then) = &self.then else {
            return Ok(f64::from(first.duration_ns));
        };
        let second = test_run(then, &first.output, 1, Some(&self.uplink))?;
        Ok(f64::from(first.duration_ns) + f64::from(second.duration_ns))
    }

    /// Test runs a run of the case takes: two where it goes on to `then`.
    fn test_runs(&self) -> f64 {
        if self.then.is_some() { 2.0 } else { 1.0 }
    }
}

/// Verdicts: sent on by the program itself, or left to the host stack.
pub const REDIRECTED: i32 = 7;
pub const TO_THE_STACK: i32 = -1;

/// Each case's program time on its segment, net of the test run's own. Run in the host
/// namespace the programs are hooked in, on CPU 0 (the kernel runs a test on the caller's
/// CPU: a thread the scheduler moved between runs would mix two CPUs' caches and clocks).
/// Every case is checked once in order (a reply's case after the one that opened its
/// connection), then timed in passes that take turns between the cases and the empty
/// program, so that a slow spell of the machine falls on all of them alike.
pub fn times(pin_path: &Path, cases: &[Case]) -> Result<Vec<f64>> {
    let mut first_cpu = nix::sched::CpuSet::new();
    first_cpu.set(0)?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &first_cpu)
        .context("pin the test runs to CPU 0")?;
    let nothing = load_classifier(&[instruction(0xb7, 0, 0, 0, 0), instruction(0x95, 0, 0, 0, 0)])
        .context("load a program that does nothing")?;
    let runs = cases
        .iter()
        .map(|case| prepared(pin_path, case))
        .collect::<Result<Vec<_>>>()?;
    let empty_segment = tcp_segment(cases[0].source, cases[0].destination, packet::ACK);
    let mut samples = vec![Vec::with_capacity(RUNS); cases.len() + 1];
    let per_pass = RUNS / PASSES;
    for pass in 0..PASSES {
        for _ in 0..per_pass {
            samples[0].push(f64::from(
                test_run(&nothing, &empty_segment, 1, None)?.duration_ns,
            ));
        }
        for ((prepared, case), samples) in runs.iter().zip(cases).zip(&mut samples[1..]) {
            for index in 0..per_pass {
                // Run 0 is the check's; the timed ones count on from there.
                let run =
                    u16::try_from(pass * per_pass + index + 1).expect("runs fit a port range");
                samples.push(prepared.run(case, run)?);
            }
        }
    }
    let mut medians = samples.into_iter().map(median);
    let overhead = medians.next().unwrap_or(0.0);
    Ok(medians
        .zip(&runs)
        .map(|(time, prepared)| (time - overhead * prepared.test_runs()).max(0.0))
        .collect())
}

/// A case's pinned programs and contexts, checked by one run (on the segment of run 0) to
/// leave as the case says it does (which also opens the case's connection).
fn prepared(pin_path: &Path, case: &Case) -> Result<Prepared> {
    let program = pinned_program(&pin_path.join("programs").join(case.program))?;
    let context = on_interface(&case.interface)?;
    let uplink = on_interface(cnibpf_tests::topology::UPLINK)?;
    let segment = segment(case, 0);
    if let Some(opener) = case.opened_by {
        let opener = pinned_program(&pin_path.join("programs").join(opener))?;
        test_run(&opener, &segment, 1, Some(&uplink))?;
    }
    let mut run = test_run(&program, &segment, 1, Some(&context))?;
    let mut then = None;
    if let Some(next) = case.then
        && run.verdict == TO_THE_STACK
        && ends(&run.output) == ends(&segment)
    {
        let next = pinned_program(&pin_path.join("programs").join(next))?;
        run = test_run(&next, &run.output, 1, Some(&uplink))?;
        then = Some(next);
    }
    let (verdict, left) = (run.verdict, run.output);
    // What the uplink's egress masquerades goes on out of it: no redirect.
    let expected = if then.is_some() {
        TO_THE_STACK
    } else {
        case.verdict
    };
    if ends(&left) != Some(case.leaves) || verdict != expected {
        bail!(
            "{}: the segment left {} as {:?} with verdict {verdict}, not as {:?} with {}: the \
             path measured would not be the one named",
            case.name,
            case.program,
            ends(&left),
            case.leaves,
            expected,
        );
    }
    Ok(Prepared {
        program,
        context,
        then,
        uplink,
        segment,
    })
}

/// A test run's context on the host interface `name`.
fn on_interface(name: &str) -> Result<[u8; SK_BUFF_SIZE]> {
    let mut context = [0u8; SK_BUFF_SIZE];
    let ifindex =
        nix::net::if_::if_nametoindex(name).with_context(|| format!("no interface {name}"))?;
    context[SK_BUFF_IFINDEX_OFF..SK_BUFF_IFINDEX_OFF + 4].copy_from_slice(&ifindex.to_ne_bytes());
    Ok(context)
}

/// The case's segment on its `run`: an ACK of its connection, or, for a case that opens one,
/// a SYN from the `run`-th port after its own.
fn segment(case: &Case, run: u16) -> Vec<u8> {
    if !case.opens {
        return tcp_segment(case.source, case.destination, packet::ACK);
    }
    let (address, port) = case.source;
    tcp_segment((address, port + run), case.destination, packet::SYN)
}

/// Source and destination of an Ethernet frame's IPv4 TCP segment.
fn ends(frame: &[u8]) -> Option<(Endpoint, Endpoint)> {
    let ip = frame.get(14..34)?;
    let header = usize::from(ip[0] & 0x0f) * 4;
    let tcp = frame.get(14 + header..14 + header + 4)?;
    let address = |at: usize| Ipv4Addr::new(ip[at], ip[at + 1], ip[at + 2], ip[at + 3]);
    Some((
        (address(12), u16::from_be_bytes([tcp[0], tcp[1]])),
        (address(16), u16::from_be_bytes([tcp[2], tcp[3]])),
    ))
}

fn pinned_program(path: &Path) -> Result<OwnedFd> {
    let name = CString::new(path.as_os_str().as_encoded_bytes())?;
    let mut attr = [0u8; 128];
    attr[0..8].copy_from_slice(&(name.as_ptr() as u64).to_ne_bytes());
    let fd = bpf(BPF_OBJ_GET, &mut attr).with_context(|| format!("open {}", path.display()))?;
    Ok(owned(fd)?)
}

/// An Ethernet frame with an IPv4 TCP segment (`flags`, no payload) from `source` to
/// `destination`, its checksums right.
fn tcp_segment(source: (Ipv4Addr, u16), destination: (Ipv4Addr, u16), flags: u8) -> Vec<u8> {
    let segment = packet::tcp(
        source.0.into(),
        destination.0.into(),
        source.1,
        destination.1,
        flags,
        &[],
    );
    let datagram = packet::ipv4(
        source.0,
        destination.0,
        packet::TCP,
        &[],
        (false, 0),
        &segment,
    );
    packet::ethernet(
        [2, 0, 0, 0, 0, 1],
        [2, 0, 0, 0, 0, 2],
        packet::ETH_P_IP,
        &datagram,
    )
}
