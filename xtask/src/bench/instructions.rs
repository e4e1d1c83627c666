//! The programs' instructions as the kernel translated them: by program, for every build, and
//! by function, for this build's four TC programs — where they go, so that a change aimed at
//! them knows its target.

use std::process::Command;

use anyhow::{Context as _, Result, bail};
use serde_json::Value;

use super::{hot::Compared, packets::Node};

/// The four TC programs, whose instructions the budget counts apart.
const TC_PROGRAMS: [&str; 4] = [
    "from_container",
    "to_container",
    "uplink_ingress",
    "uplink_egress",
];
/// Instruction budgets: the TC programs together, and everything `cnibpf load` loads.
const TC_INSTRUCTIONS_TARGET: u64 = 16_000;
const ALL_INSTRUCTIONS_TARGET: u64 = 17_700;
/// How many of the functions with the most instructions the breakdown shows.
const FUNCTIONS_SHOWN: usize = 15;

/// Instructions of every program a node's build loaded, by name, sorted by name.
pub fn by_program(node: &Node) -> Result<Vec<(String, u64)>> {
    let programs = node.sim.pin_path.join("programs");
    let mut counts = Vec::new();
    for entry in
        std::fs::read_dir(&programs).with_context(|| format!("list {}", programs.display()))?
    {
        let path = entry?.path();
        let shown: Value = serde_json::from_slice(&bpftool(&["--json", "prog", "show"], &path)?)
            .with_context(|| format!("bpftool prog show {}", path.display()))?;
        let bytes = shown["bytes_xlated"]
            .as_u64()
            .with_context(|| format!("no bytes_xlated for {}", path.display()))?;
        let name = path
            .file_name()
            .context("a program's pin has a name")?
            .to_string_lossy()
            .into_owned();
        counts.push((name, bytes / 8));
    }
    counts.sort();
    Ok(counts)
}

/// The rows of the totals (against their budgets) and of each program, across builds.
pub fn rows(counts: &[Vec<(String, u64)>]) -> Vec<Compared> {
    let total = |build: &[(String, u64)], tc_only: bool| {
        build
            .iter()
            .filter(|(name, _)| !tc_only || TC_PROGRAMS.contains(&name.as_str()))
            .map(|(_, count)| *count)
            .sum::<u64>() as f64
    };
    let mut rows = vec![
        Compared {
            what: "instructions of the four TC programs".to_owned(),
            unit: "insns",
            values: counts.iter().map(|build| total(build, true)).collect(),
            target: Some(TC_INSTRUCTIONS_TARGET as f64),
        },
        Compared {
            what: "instructions of every program `cnibpf load` loads".to_owned(),
            unit: "insns",
            values: counts.iter().map(|build| total(build, false)).collect(),
            target: Some(ALL_INSTRUCTIONS_TARGET as f64),
        },
    ];
    let this_build = counts.last().map(Vec::as_slice).unwrap_or_default();
    for (program, _) in this_build {
        rows.push(Compared {
            what: format!("instructions of {program}"),
            unit: "insns",
            values: counts
                .iter()
                .map(|build| {
                    build
                        .iter()
                        .find(|(name, _)| name == program)
                        .map_or(f64::NAN, |(_, count)| *count as f64)
                })
                .collect(),
            target: None,
        });
    }
    rows
}

/// The functions of this build's TC programs with the most instructions (summed over the
/// programs that carry a copy), one row each, the figure in the last of `builds` columns.
pub fn by_function_rows(this_build: &Node, builds: usize) -> Result<Vec<Compared>> {
    let mut functions: Vec<(String, u64, usize)> = Vec::new();
    for program in TC_PROGRAMS {
        let path = this_build.sim.pin_path.join("programs").join(program);
        let dump = String::from_utf8(bpftool(&["prog", "dump", "xlated"], &path)?)?;
        for (name, count) in functions_of(&dump)? {
            match functions.iter_mut().find(|(known, ..)| *known == name) {
                Some((_, total, programs)) => {
                    *total += count;
                    *programs += 1;
                }
                None => functions.push((name, count, 1)),
            }
        }
    }
    functions.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok(functions
        .into_iter()
        .take(FUNCTIONS_SHOWN)
        .map(|(name, count, programs)| Compared {
            what: format!("instructions in `{name}` ({programs} copies in the TC programs)"),
            unit: "insns",
            values: (1..=builds)
                .map(|column| {
                    if column == builds {
                        count as f64
                    } else {
                        f64::NAN
                    }
                })
                .collect(),
            target: None,
        })
        .collect())
}

/// Each function of a `bpftool prog dump xlated` listing and its instructions: from its
/// first instruction's index to the next function's (a 64-bit immediate load counts two).
fn functions_of(dump: &str) -> Result<Vec<(String, u64)>> {
    let mut starts: Vec<(String, u64)> = Vec::new();
    let mut pending: Option<String> = None;
    let mut end = 0;
    for line in dump.lines() {
        if let Some((index, rest)) = line.trim_start().split_once(": (") {
            let Ok(index) = index.parse::<u64>() else {
                continue;
            };
            if let Some(name) = pending.take() {
                starts.push((name, index));
            }
            end = index + if rest.starts_with("18)") { 2 } else { 1 };
        } else if !line.starts_with([';', ' ']) && line.ends_with("):") {
            let head = line.split('(').next().unwrap_or_default();
            let name = head
                .split_whitespace()
                .last()
                .context("a function's name")?;
            pending = Some(name.to_owned());
        }
    }
    if starts.is_empty() {
        bail!("no function in the listing");
    }
    let ends = starts.iter().skip(1).map(|(_, start)| *start).chain([end]);
    Ok(starts
        .iter()
        .zip(ends.collect::<Vec<_>>())
        .map(|((name, start), end)| (name.clone(), end - start))
        .collect())
}

fn bpftool(args: &[&str], pinned: &std::path::Path) -> Result<Vec<u8>> {
    let output = Command::new("bpftool")
        .args(args)
        .arg("pinned")
        .arg(pinned)
        .output()
        .context("run bpftool")?;
    if !output.status.success() {
        bail!(
            "bpftool {} pinned {}: {}",
            args.join(" "),
            pinned.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(output.stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_function_runs_to_the_next_and_wide_loads_count_twice() {
        let dump = "\
int main(struct __sk_buff * ctx):
; fn main() {
   0: (b7) r0 = 0
   1: (18) r1 = 0xffff
   3: (85) call pc+1
   4: (95) exit
bool helper(u32 x):
   5: (b7) r0 = 1
   6: (95) exit
";
        assert_eq!(
            functions_of(dump).unwrap(),
            [("main".to_owned(), 5), ("helper".to_owned(), 2)]
        );
    }
}
