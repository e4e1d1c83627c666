//! `cargo xtask bench hot`: every path of the eBPF datapath on one crafted segment, its maps
//! hot (`BPF_PROG_TEST_RUN`, see `isolated`), and the instructions of every program the kernel
//! loaded — for this build beside the last release and any older commit asked for, each in
//! its own simulated host, in about a minute. The figures that do not drift with the machine's
//! load: `packets` takes them too, beside what the same paths cost in traffic.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use cnibpf_tests::{
    SimHost,
    topology::{HOST_UPLINK_ADDR, OUTSIDE_ADDR, UPLINK},
};
use serde_json::{Value, json};

use super::{
    Progress,
    chart::{self, BarPanel},
    in_turn, instructions,
    isolated::{self, Case, Endpoint},
    median,
    packets::{CONTAINER_PORT, FILTERED_SERVERS, HOST_PORT, HOST_SERVER, MASQUERADED_SERVER, Node},
};

/// Rounds, alternating between the builds: one build measured after another would carry the
/// machine's drift (its clock, its caches) into the ratio.
const ROUNDS: usize = 7;

/// A build of cnibpf to measure.
pub struct Build {
    pub label: String,
    pub binary: PathBuf,
}

/// The builds a comparison runs, this build last: the commits in `older` (built once into
/// the release cache, `cnibpf_tests::history`), then the last release `releases.toml` lists
/// (once: an `older` commit naming it, in full or abbreviated, is that row).
pub fn builds(progress: &Progress, older: &[String]) -> Result<Vec<Build>> {
    let release = cnibpf_tests::history::released_commits()
        .pop()
        .context("releases.toml lists no release")?;
    let is_release = |commit: &str| release.starts_with(commit) || commit.starts_with(&release);
    let mut builds = Vec::new();
    for commit in older.iter().filter(|commit| !is_release(commit)) {
        progress.step(&format!(
            "building cnibpf of {commit} (once per machine, into the release cache)"
        ));
        builds.push(Build {
            label: commit.clone(),
            binary: cnibpf_tests::history::cnibpf_of(commit),
        });
    }
    progress.step(&format!(
        "building cnibpf of {release}, the last release (once per machine, into the release cache)"
    ));
    builds.push(Build {
        label: format!("{release} (last release)"),
        binary: cnibpf_tests::history::cnibpf_of(&release),
    });
    builds.push(Build {
        label: format!("this build ({})", super::this_commit()?),
        binary: cnibpf_tests::topology::cnibpf_binary(),
    });
    Ok(builds)
}

/// One simulated host per build (masqueraded, hostPort and filtered containers), named after
/// `prefix` and the build's position.
pub fn nodes(builds: &[Build], prefix: &str) -> Result<Vec<Node>> {
    let mut nodes = Vec::new();
    for (index, build) in builds.iter().enumerate() {
        // SAFETY: the bench runs one thread that reads the environment, this one.
        unsafe { std::env::set_var("CNIBPF_BIN", &build.binary) };
        nodes.push(Node::new(SimHost::new(
            &format!("{prefix}{index}"),
            json!({ "backend": "ebpf", "ipMasq": true }),
        ))?);
    }
    // SAFETY: as above; the DELs when the hosts are dropped run this build.
    unsafe { std::env::set_var("CNIBPF_BIN", cnibpf_tests::topology::cnibpf_binary()) };
    Ok(nodes)
}

/// A figure derived from the cases' times, and its target (ns).
struct HotPath {
    name: &'static str,
    target: Option<f64>,
    of: fn(&[f64]) -> f64,
    /// A difference of two cases' times (taken within each round); else one case's time.
    difference: bool,
}

/// The cases of [`cases`] by position.
const MASQUERADE: usize = 0;
const MASQUERADE_REPLY: usize = 1;
const DNAT: usize = 2;
const DNAT_REPLY: usize = 3;
const HAIRPIN: usize = 4;
const FILTERED: [usize; 2] = [5, 6];
const MISS_VETH: usize = 7;
const MISS_UPLINK: usize = 8;
const MASQUERADE_OPENS: usize = 9;
const DNAT_OPENS: usize = 10;

const PATHS: [HotPath; 11] = [
    HotPath {
        name: "masquerade: a container's segment out (from_container)",
        target: Some(250.0),
        of: |times| times[MASQUERADE],
        difference: false,
    },
    HotPath {
        name: "masquerade: its reply (uplink_ingress)",
        target: Some(300.0),
        of: |times| times[MASQUERADE_REPLY],
        difference: false,
    },
    HotPath {
        name: "hostPort DNAT: a segment from outside (uplink_ingress)",
        target: Some(300.0),
        of: |times| times[DNAT],
        difference: false,
    },
    HotPath {
        name: "hostPort DNAT: the container's reply (from_container)",
        target: Some(300.0),
        of: |times| times[DNAT_REPLY],
        difference: false,
    },
    HotPath {
        name: "hairpin: a container's segment to another's hostPort (from_container)",
        target: None,
        of: |times| times[HAIRPIN],
        difference: false,
    },
    HotPath {
        name: "filter of 1 rule: over the same masqueraded segment unfiltered",
        target: Some(60.0),
        of: |times| times[FILTERED[0]] - times[MASQUERADE],
        difference: true,
    },
    HotPath {
        name: "filter of 256 rules: over the same masqueraded segment unfiltered",
        target: Some(60.0),
        of: |times| times[FILTERED[1]] - times[MASQUERADE],
        difference: true,
    },
    HotPath {
        name: "a container's segment for a host process, every lookup missing (from_container)",
        target: None,
        of: |times| times[MISS_VETH],
        difference: false,
    },
    HotPath {
        name: "an outside segment for a host process, every lookup missing (uplink_ingress)",
        target: None,
        of: |times| times[MISS_UPLINK],
        difference: false,
    },
    HotPath {
        name: "masquerade: a connection's first segment (SYN) out, from_container and, behind the host stack, uplink_egress",
        target: None,
        of: |times| times[MASQUERADE_OPENS],
        difference: false,
    },
    HotPath {
        name: "hostPort DNAT: a connection's first segment (SYN) from outside (uplink_ingress)",
        target: None,
        of: |times| times[DNAT_OPENS],
        difference: false,
    },
];

/// The first source port of a round's connection-opening cases: each of their runs opens its
/// connection from a port of its own (below the established cases' 40,000s), no round
/// reusing another's.
fn opening_ports(round: usize) -> u16 {
    let per_round = u16::try_from(isolated::RUNS + 1).expect("runs fit a port range");
    10_000 + per_round * u16::try_from(round).expect("rounds are few")
}

/// The crafted segments of [`PATHS`], on `node`'s interfaces, in the order of the constants
/// above, for `round`. A reply's case follows the case that opened its connection.
fn cases(node: &Node, round: usize) -> Vec<Case> {
    let masqueraded_addr = node.masqueraded.address;
    let served = node.host_port.address;
    let veth = node.sim.host_interface(&node.masqueraded);
    let on = |name: &str,
              program,
              interface: &str,
              sent: (Endpoint, Endpoint),
              leaves: (Endpoint, Endpoint)| Case {
        name: name.to_owned(),
        program,
        interface: interface.to_owned(),
        source: sent.0,
        destination: sent.1,
        verdict: if leaves == sent {
            isolated::TO_THE_STACK
        } else {
            isolated::REDIRECTED
        },
        leaves,
        opened_by: None,
        opens: false,
        then: None,
    };
    // A masqueraded connection is opened where the build opens it: its first packet at the
    // uplink's egress, behind the host stack.
    let masqueraded = |case: Case| Case {
        opened_by: Some("uplink_egress"),
        ..case
    };
    let mut cases = vec![
        masqueraded(on(
            "masquerade",
            "from_container",
            &veth,
            (
                (masqueraded_addr, 40_003),
                (OUTSIDE_ADDR, MASQUERADED_SERVER),
            ),
            (
                (HOST_UPLINK_ADDR, 40_003),
                (OUTSIDE_ADDR, MASQUERADED_SERVER),
            ),
        )),
        on(
            "masquerade reply",
            "uplink_ingress",
            UPLINK,
            (
                (OUTSIDE_ADDR, MASQUERADED_SERVER),
                (HOST_UPLINK_ADDR, 40_003),
            ),
            (
                (OUTSIDE_ADDR, MASQUERADED_SERVER),
                (masqueraded_addr, 40_003),
            ),
        ),
        on(
            "DNAT",
            "uplink_ingress",
            UPLINK,
            ((OUTSIDE_ADDR, 40_001), (HOST_UPLINK_ADDR, HOST_PORT)),
            ((OUTSIDE_ADDR, 40_001), (served, CONTAINER_PORT)),
        ),
        on(
            "DNAT reply",
            "from_container",
            &node.sim.host_interface(&node.host_port),
            ((served, CONTAINER_PORT), (OUTSIDE_ADDR, 40_001)),
            ((HOST_UPLINK_ADDR, HOST_PORT), (OUTSIDE_ADDR, 40_001)),
        ),
        on(
            "hairpin",
            "from_container",
            &veth,
            ((masqueraded_addr, 40_006), (HOST_UPLINK_ADDR, HOST_PORT)),
            ((masqueraded_addr, 40_006), (served, CONTAINER_PORT)),
        ),
    ];
    // A filtered container's connection: the first run walks the rules, the others take the
    // verdict kept with the connection.
    for ((container, server), source_port) in node
        .filtered
        .iter()
        .zip(FILTERED_SERVERS)
        .zip([40_004, 40_005])
    {
        cases.push(masqueraded(on(
            "filtered masquerade",
            "from_container",
            &node.sim.host_interface(container),
            ((container.address, source_port), (OUTSIDE_ADDR, server)),
            ((HOST_UPLINK_ADDR, source_port), (OUTSIDE_ADDR, server)),
        )));
    }
    let unchanged = |sent: (Endpoint, Endpoint)| (sent, sent);
    let (veth_miss, veth_sent) =
        unchanged(((masqueraded_addr, 40_002), (HOST_UPLINK_ADDR, HOST_SERVER)));
    cases.push(on("miss", "from_container", &veth, veth_miss, veth_sent));
    let (uplink_miss, uplink_sent) =
        unchanged(((OUTSIDE_ADDR, 40_000), (HOST_UPLINK_ADDR, HOST_SERVER)));
    cases.push(on(
        "miss",
        "uplink_ingress",
        UPLINK,
        uplink_miss,
        uplink_sent,
    ));
    let port = opening_ports(round);
    cases.push(Case {
        opens: true,
        then: Some("uplink_egress"),
        ..on(
            "masquerade opens",
            "from_container",
            &veth,
            ((masqueraded_addr, port), (OUTSIDE_ADDR, MASQUERADED_SERVER)),
            ((HOST_UPLINK_ADDR, port), (OUTSIDE_ADDR, MASQUERADED_SERVER)),
        )
    });
    cases.push(Case {
        opens: true,
        ..on(
            "DNAT opens",
            "uplink_ingress",
            UPLINK,
            ((OUTSIDE_ADDR, port), (HOST_UPLINK_ADDR, HOST_PORT)),
            ((OUTSIDE_ADDR, port), (served, CONTAINER_PORT)),
        )
    });
    cases
}

/// Each build's figures of [`PATHS`] (ns), in the order of `nodes`, over [`ROUNDS`] rounds
/// alternating between the builds, each build first in turn: a path's least time of any round
/// (what the machine's other work, which only ever adds time, left of it), a difference's
/// median.
pub fn path_times(nodes: &[Node]) -> Result<Vec<Vec<f64>>> {
    let mut rounds: Vec<Vec<Vec<f64>>> = vec![Vec::new(); nodes.len()];
    for round in 0..ROUNDS {
        for index in in_turn(round + 1, nodes.len()) {
            let node = &nodes[index];
            let cases = cases(node, round);
            let pin_path = node.sim.pin_path.clone();
            let times = node
                .sim
                .host
                .run(move || isolated::times(&pin_path, &cases))?;
            rounds[index].push(PATHS.iter().map(|path| (path.of)(&times)).collect());
        }
    }
    Ok(rounds
        .into_iter()
        .map(|rounds| {
            PATHS
                .iter()
                .enumerate()
                .map(|(index, path)| {
                    let figures = rounds.iter().map(|round| round[index]);
                    if path.difference {
                        median(figures.collect())
                    } else {
                        figures.fold(f64::INFINITY, f64::min)
                    }
                })
                .collect()
        })
        .collect())
}

/// A table row across builds: what, its unit, each build's figure, its target.
pub struct Compared {
    pub what: String,
    pub unit: &'static str,
    pub values: Vec<f64>,
    pub target: Option<f64>,
}

/// The hot paths and instruction counts as rows across `builds`.
pub fn compared(times: &[Vec<f64>], counts: &[Vec<(String, u64)>]) -> Vec<Compared> {
    let mut rows: Vec<Compared> = PATHS
        .iter()
        .enumerate()
        .map(|(index, path)| Compared {
            what: path.name.to_owned(),
            unit: "ns",
            values: times.iter().map(|build| build[index]).collect(),
            target: path.target,
        })
        .collect();
    rows.extend(instructions::rows(counts));
    rows
}

/// Writes `<name>.md` (printed too) and `<name>.json`: one column per build, this build's
/// figure judged against its target.
pub fn write_compared(
    out_dir: &Path,
    name: &str,
    title: &str,
    builds: &[Build],
    rows: &[Compared],
    notes: &[String],
) -> Result<PathBuf> {
    let mut table = format!("# {title}\n\n| figure |");
    for build in builds {
        write!(table, " {} |", build.label)?;
    }
    table.push_str(" target |\n|---|");
    table.push_str(&"---:|".repeat(builds.len() + 1));
    table.push('\n');
    for row in rows {
        write!(table, "| {} |", row.what)?;
        for value in &row.values {
            write!(table, " {} |", figure(*value, row.unit))?;
        }
        let verdict = match (row.target, row.values.last()) {
            (Some(target), Some(value)) if *value <= target => {
                format!("≤ {} (met)", figure(target, row.unit))
            }
            (Some(target), Some(_)) => format!("≤ {} (**not met**)", figure(target, row.unit)),
            _ => "—".to_owned(),
        };
        writeln!(table, " {verdict} |")?;
    }
    let json: Vec<Value> = rows
        .iter()
        .map(|row| {
            json!({
                "figure": row.what,
                "unit": row.unit,
                "target": row.target,
                "builds": builds.iter().zip(&row.values)
                    .map(|(build, value)| json!({ "build": build.label, "value": value }))
                    .collect::<Vec<_>>(),
            })
        })
        .collect();
    super::save(out_dir, name, table, notes, &json)
}

fn figure(value: f64, unit: &str) -> String {
    if value.is_nan() {
        return "—".to_owned();
    }
    let rounded = value.round() as i64;
    let digits = rounded.unsigned_abs().to_string();
    let mut grouped = String::new();
    for (index, digit) in digits.chars().enumerate() {
        if index > 0 && (digits.len() - index).is_multiple_of(3) {
            grouped.push(',');
        }
        grouped.push(digit);
    }
    let sign = if rounded < 0 { "−" } else { "" };
    format!("{sign}{grouped} {unit}")
}

/// How the hot figures and instruction counts are taken.
pub fn notes() -> Vec<String> {
    vec![format!(
        "Hot paths: each build's pinned programs run by the kernel on one IPv4 TCP segment per path, \
         on the interface they are hooked to (BPF_PROG_TEST_RUN, one run per call so that each run \
         meets the segment as sent; the median of 4,000 runs, taken in 8 passes that take turns \
         between the paths and a program that does nothing, less the latter's; of {ROUNDS} \
         rounds alternating between the builds, each first in turn, the least (the machine's other work only ever \
         adds time), and for a difference of two paths the median of its rounds; the test runs \
         pinned to one CPU). Each segment's \
         addresses and ports as the program leaves them are checked before it is timed. A reply's \
         segment runs after the segment that opened its connection; a filtered container's \
         connection was allowed by its first run (filterDefault DROP, its ALLOW after rules that \
         differ from it only in the destination port). A connection's first segment (SYN) \
         comes from a source port of its own on every run, so that each meets no state: what \
         opening a connection costs (new entries in connections and the translations, the port \
         claim, the node's conntrack and sockets asked); a masqueraded one runs \
         from_container, then, where that leaves it to the host stack untouched (this build: \
         the host stack's netfilter sees a first packet), uplink_egress on it, both times \
         together — in a test run the node's conntrack has no entry for it, where on a node it \
         has one, so that this build asks conntrack twice where a node's packet asks once. \
         Instructions: bytes_xlated / 8 of every \
         program pinned under the instance's programs/ (`bpftool prog show`); by function, this \
         build's four TC programs listed by `bpftool prog dump xlated`, each function from its \
         first instruction to the next one's, summed over the programs that carry a copy."
    )]
}

/// `cargo xtask bench hot`.
pub fn run(out_dir: &Path, older: &[String]) -> Result<()> {
    let progress = Progress::new();
    let builds = builds(&progress, older)?;
    progress.step("one simulated host per build: masqueraded, hostPort and filtered containers");
    let nodes = nodes(&builds, "bench-hot")?;
    if nodes.len() != builds.len() {
        bail!("a host per build");
    }
    progress.step("each build's programs on one crafted segment per path (BPF_PROG_TEST_RUN)");
    let times = path_times(&nodes)?;
    let counts = nodes
        .iter()
        .map(instructions::by_program)
        .collect::<Result<Vec<_>>>()?;
    let mut rows = compared(&times, &counts);
    rows.extend(instructions::by_function_rows(
        nodes.last().context("a host per build")?,
        builds.len(),
    )?);
    let report = write_compared(
        out_dir,
        "hot",
        "cnibpf bench: each path hot, and the programs' instructions, by build",
        &builds,
        &rows,
        &notes(),
    )?;
    chart::bars(
        &out_dir.join("hot.png"),
        "cnibpf eBPF datapath: program time per path, one crafted segment, caches hot (ns)",
        &builds
            .iter()
            .zip(&times)
            .map(|(build, times)| BarPanel {
                title: build.label.as_str(),
                y_label: "ns",
                bars: [
                    "masq",
                    "masq reply",
                    "DNAT",
                    "DNAT reply",
                    "hairpin",
                    "+1 rule",
                    "+256 rules",
                    "miss, veth",
                    "miss, uplink",
                ]
                .iter()
                .zip(times)
                .map(|(label, time)| ((*label).to_owned(), *time))
                .collect(),
                reference: Some(300.0),
            })
            .collect::<Vec<_>>(),
    )?;
    progress.step(&format!("report: {} and hot.png", report.display()));
    Ok(())
}
