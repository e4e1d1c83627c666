//! `cargo xtask modules`: the module graph of the eBPF and userspace crates, read from their
//! `use` statements and `crate::`/`super::` paths, with a check that no module depends on one
//! that depends back on it. Edges join siblings (the children of the nearest common ancestor):
//! a module using its parent or its own child is containment, not a dependency. Also the
//! length check of `cargo xtask lint`.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::Path,
};

use anyhow::{Context as _, Result, bail};

/// A module path below the crate root (`["backend", "ebpf", "pins"]`).
type ModulePath = Vec<String>;

pub fn run(print: bool) -> Result<()> {
    let mut cycles = Vec::new();
    for (name, root) in [("cnibpf-ebpf", "cnibpf-ebpf/src"), ("cnibpf", "cnibpf/src")] {
        let graph = graph_of(Path::new(root))?;
        if print {
            println!("{name}:");
            for (from, to) in &graph {
                println!("  {} -> {}", display(from), display_set(to));
            }
        }
        cycles.extend(
            find_cycles(&graph)
                .into_iter()
                .map(|cycle| format!("{name}: {}", cycle.join(" -> "))),
        );
    }
    if !cycles.is_empty() {
        bail!("module import cycles:\n  {}", cycles.join("\n  "));
    }
    if print {
        println!("no cycles");
    }
    Ok(())
}

fn display(path: &[String]) -> String {
    if path.is_empty() {
        "(crate root)".to_owned()
    } else {
        path.join("::")
    }
}

fn display_set(set: &BTreeSet<ModulePath>) -> String {
    set.iter()
        .map(|path| display(path))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Every module's sibling dependencies.
fn graph_of(root: &Path) -> Result<BTreeMap<ModulePath, BTreeSet<ModulePath>>> {
    let mut references = BTreeMap::new();
    for file in rust_files(root)? {
        let module = module_of(root, &file);
        let text = fs::read_to_string(&file).with_context(|| format!("{}", file.display()))?;
        let found = referenced_paths(&strip_tests(&strip_comments(&text)), &module);
        references.insert(module, found);
    }
    let modules: BTreeSet<ModulePath> = references.keys().cloned().collect();
    let mut graph: BTreeMap<ModulePath, BTreeSet<ModulePath>> = BTreeMap::new();
    for (module, found) in references {
        for target in found {
            // A path names items below its module: the longest prefix that is a module.
            let Some(target) = (0..=target.len())
                .rev()
                .map(|length| target[..length].to_vec())
                .find(|prefix| modules.contains(prefix))
            else {
                continue;
            };
            if let Some((from, to)) = sibling_edge(&module, &target) {
                graph.entry(from).or_default().insert(to);
            }
        }
        graph.entry(module).or_default();
    }
    Ok(graph)
}

/// The longest a source file may grow: past it, a file holds more than one concern and is
/// split by them (a module directory).
const MAX_FILE_LINES: usize = 600;

/// Fails on a source file of the workspace longer than [`MAX_FILE_LINES`].
pub fn check_lengths() -> Result<()> {
    let root = crate::workspace_root();
    let mut long = Vec::new();
    for dir in [
        "cnibpf/src",
        "cnibpf-ebpf/src",
        "cnibpf-common/src",
        "xtask/src",
        "tests",
    ] {
        for file in rust_files(&root.join(dir))? {
            let text = fs::read_to_string(&file).with_context(|| format!("{}", file.display()))?;
            let lines = text.lines().count();
            if lines > MAX_FILE_LINES {
                let relative = file
                    .strip_prefix(&root)
                    .unwrap_or(&file)
                    .display()
                    .to_string();
                long.push(format!("{relative}: {lines} lines"));
            }
        }
    }
    if !long.is_empty() {
        bail!(
            "source files over {MAX_FILE_LINES} lines; split each by its concerns:\n  {}",
            long.join("\n  ")
        );
    }
    Ok(())
}

pub fn rust_files(dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).with_context(|| format!("{}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            files.extend(rust_files(&path)?);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// `src/backend/ebpf/mod.rs` is `backend::ebpf`; `src/main.rs` the root (empty).
fn module_of(root: &Path, file: &Path) -> ModulePath {
    let relative = file.strip_prefix(root).unwrap_or(file);
    let mut parts: Vec<String> = relative
        .with_extension("")
        .iter()
        .map(|part| part.to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "main" | "lib")
    ) {
        parts.pop();
    }
    parts
}

fn strip_comments(text: &str) -> String {
    text.lines()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The text before the first `#[cfg(test)]`: tests may reach anywhere.
fn strip_tests(text: &str) -> String {
    match text.find("#[cfg(test)]") {
        Some(at) => text[..at].to_owned(),
        None => text.to_owned(),
    }
}

/// The absolute module paths `text` (in `module`) refers to through `crate::`, `super::` or
/// `self::`, with `use` trees expanded.
fn referenced_paths(text: &str, module: &[String]) -> Vec<ModulePath> {
    let mut paths = Vec::new();
    let mut rest = text;
    // `use` statements: expand their trees.
    while let Some(at) = find_use(rest) {
        let statement = &rest[at + 4..];
        let end = statement.find(';').unwrap_or(statement.len());
        for path in expand_tree(statement[..end].trim()) {
            paths.extend(resolve(&path, module));
        }
        rest = &statement[end..];
    }
    // Inline paths (`crate::netlink::link_by_index(...)`).
    for word in text.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')) {
        if word.starts_with("crate::") || word.starts_with("super::") {
            let path: Vec<String> = word.split("::").map(str::to_owned).collect();
            paths.extend(resolve(&path, module));
        }
    }
    paths
}

fn find_use(text: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(at) = text[from..].find("use ") {
        let at = from + at;
        let before = text[..at].chars().last();
        if before.is_none_or(|c| c.is_whitespace() || c == ';' || c == '{' || c == '}') {
            return Some(at);
        }
        from = at + 4;
    }
    None
}

/// `a::{b, c::{d, e}}` → `a::b`, `a::c::d`, `a::c::e`.
fn expand_tree(tree: &str) -> Vec<Vec<String>> {
    // Renames (`X as Y`) go: the item still lives where X does.
    let mut words: Vec<&str> = Vec::new();
    let mut tokens = tree.split_whitespace().peekable();
    while let Some(token) = tokens.next() {
        if token == "as" {
            // Keep what follows the new name (`,` or `}`).
            let renamed = tokens.next().unwrap_or_default();
            words.push(renamed.trim_start_matches(|c: char| c.is_alphanumeric() || c == '_'));
        } else {
            words.push(token);
        }
    }
    let tree: String = words.concat();
    let mut out = Vec::new();
    expand(&tree, &mut Vec::new(), &mut out);
    out
}

fn expand(tree: &str, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    for item in split_top_level(tree) {
        match item.find('{') {
            Some(open) => {
                let head = item[..open].trim_end_matches("::");
                let inner = &item[open + 1..item.len().saturating_sub(1)];
                let pushed: Vec<String> = head
                    .split("::")
                    .filter(|part| !part.is_empty())
                    .map(str::to_owned)
                    .collect();
                let depth = prefix.len();
                prefix.extend(pushed);
                expand(inner, prefix, out);
                prefix.truncate(depth);
            }
            None => {
                let mut path = prefix.clone();
                path.extend(
                    item.split("::")
                        .filter(|part| !part.is_empty())
                        .map(str::to_owned),
                );
                out.push(path);
            }
        }
    }
}

/// Splits on commas outside braces.
fn split_top_level(tree: &str) -> Vec<&str> {
    let (mut items, mut depth, mut start) = (Vec::new(), 0, 0);
    for (at, c) in tree.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&tree[start..at]);
                start = at + 1;
            }
            _ => {}
        }
    }
    items.push(&tree[start..]);
    items.into_iter().filter(|item| !item.is_empty()).collect()
}

/// The module a path in `module` points into (its last segment may be an item; the edge
/// computation only needs the modules above it, and a leaf module is kept whole).
fn resolve(path: &[String], module: &[String]) -> Option<ModulePath> {
    let (first, rest) = path.split_first()?;
    let mut base: Vec<String> = match first.as_str() {
        "crate" => Vec::new(),
        "self" => module.to_vec(),
        "super" => {
            let mut base = module.to_vec();
            base.pop();
            let mut rest = rest;
            while rest.first().map(String::as_str) == Some("super") {
                base.pop();
                rest = &rest[1..];
            }
            base.extend(rest.iter().cloned());
            return Some(base);
        }
        _ => return None,
    };
    base.extend(rest.iter().cloned());
    Some(base)
}

/// The edge between the children of the nearest common ancestor of `from` and `to`, if
/// neither contains the other.
fn sibling_edge(from: &[String], to: &[String]) -> Option<(ModulePath, ModulePath)> {
    let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
    if common >= from.len() || common >= to.len() {
        return None;
    }
    Some((from[..=common].to_vec(), to[..=common].to_vec()))
}

/// Cycles among the modules of `graph`.
fn find_cycles(graph: &BTreeMap<ModulePath, BTreeSet<ModulePath>>) -> Vec<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Visiting,
        Done,
    }
    fn visit(
        node: &ModulePath,
        graph: &BTreeMap<ModulePath, BTreeSet<ModulePath>>,
        marks: &mut BTreeMap<ModulePath, Mark>,
        stack: &mut Vec<ModulePath>,
        cycles: &mut Vec<Vec<String>>,
    ) {
        match marks.get(node) {
            Some(Mark::Done) => return,
            Some(Mark::Visiting) => {
                let start = stack.iter().position(|entry| entry == node).unwrap_or(0);
                let mut cycle: Vec<String> = stack[start..].iter().map(|m| display(m)).collect();
                cycle.push(display(node));
                cycles.push(cycle);
                return;
            }
            None => {}
        }
        marks.insert(node.clone(), Mark::Visiting);
        stack.push(node.clone());
        for next in graph.get(node).into_iter().flatten() {
            visit(next, graph, marks, stack, cycles);
        }
        stack.pop();
        marks.insert(node.clone(), Mark::Done);
    }
    let mut marks = BTreeMap::new();
    let mut cycles = Vec::new();
    for node in graph.keys() {
        visit(node, graph, &mut marks, &mut Vec::new(), &mut cycles);
    }
    cycles
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(text: &str) -> ModulePath {
        text.split("::")
            .filter(|part| !part.is_empty())
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn use_trees_expand_and_resolve_relative_to_the_module() {
        let module = path("backend::ebpf::portmap");
        let found = referenced_paths(
            "use super::{EbpfBackend, batch::entries};\nuse crate::{model::{Protocol, ResolvedMapping as R}, netlink};\nlet x = crate::paths::PinLayout::new();",
            &module,
        );
        for expected in [
            "backend::ebpf::EbpfBackend",
            "backend::ebpf::batch::entries",
            "model::Protocol",
            "model::ResolvedMapping",
            "netlink",
            "paths::PinLayout::new",
        ] {
            assert!(found.contains(&path(expected)), "{expected} in {found:?}");
        }
    }

    #[test]
    fn edges_join_siblings_and_cycles_are_found() {
        assert_eq!(
            sibling_edge(
                &path("backend::ebpf::pins"),
                &path("backend::ebpf::endpoint")
            ),
            Some((path("backend::ebpf::pins"), path("backend::ebpf::endpoint")))
        );
        assert_eq!(
            sibling_edge(&path("backend::ebpf::pins"), &path("model::mapping")),
            Some((path("backend"), path("model")))
        );
        assert_eq!(
            sibling_edge(&path("backend::ebpf"), &path("backend::ebpf::pins")),
            None
        );
        let mut graph = BTreeMap::new();
        graph.insert(path("a"), BTreeSet::from([path("b")]));
        graph.insert(path("b"), BTreeSet::from([path("a")]));
        graph.insert(path("c"), BTreeSet::from([path("a")]));
        assert_eq!(find_cycles(&graph), [vec!["a", "b", "a"]]);
    }
}
