//! The fail-closed check of `cargo xtask lint`: in the userspace modules that talk to the
//! kernel, every construct that can turn an error into a value — `.ok()`, `unwrap_or*`,
//! `map_or*`, `is_err()`, `is_ok*`, `Err(_)`, `let _ =`, `if let Ok` / `let Ok`,
//! `filter_map(Result::ok)`, `Path::exists` — carries a `fail-closed:` comment saying why that
//! reading is right (only the kernel's own "not found" may mean absent), on its line or in
//! the comment lines directly above it. New code that swallows an error fails the lint until
//! it either propagates the error or says why it need not.

use std::fs;

use anyhow::{Context as _, Result, bail};

/// What a reviewer must have looked at.
const PATTERNS: [&str; 14] = [
    ".ok()",
    ".unwrap_or(",
    ".unwrap_or_default()",
    ".unwrap_or_else(",
    ".map_or(",
    ".map_or_else(",
    ".is_err()",
    ".is_ok()",
    ".is_ok_and(",
    "Err(_)",
    "let _ =",
    "let Ok(",
    "Result::ok",
    ".exists()",
];

/// The marker of a reviewed site.
const MARKER: &str = "fail-closed:";

/// Modules of pure logic (parsing, formatting, planning): no kernel, file or process result
/// passes through them.
const PURE: [&str; 11] = [
    "config/",
    "model/",
    "cni/args.rs",
    "cni/error.rs",
    "cni/result.rs",
    "install/chain.rs",
    "backend/error.rs",
    "backend/nftables/record.rs",
    "backend/nftables/compat/comments.rs",
    "code.rs",
    "fuzz.rs",
];

pub fn run() -> Result<()> {
    let root = crate::workspace_root().join("cnibpf/src");
    let mut unreviewed = Vec::new();
    for file in crate::modules::rust_files(&root)? {
        let relative = file
            .strip_prefix(&root)
            .unwrap_or(&file)
            .to_string_lossy()
            .into_owned();
        if is_pure(&relative) {
            continue;
        }
        let text = fs::read_to_string(&file).with_context(|| format!("{}", file.display()))?;
        for (line, pattern) in unreviewed_sites(&text) {
            unreviewed.push(format!("cnibpf/src/{relative}:{line}: {pattern}"));
        }
    }
    if !unreviewed.is_empty() {
        bail!(
            "{} place(s) may read an error as a value without saying why; propagate the error, or add a `// {MARKER} <why>` comment (see docs/configuration.md, Failure semantics):\n  {}",
            unreviewed.len(),
            unreviewed.join("\n  ")
        );
    }
    eprintln!("    fail-closed: every error-swallowing construct is reviewed");
    Ok(())
}

/// (line number, pattern) of every flagged construct without a marker, before the file's
/// tests.
fn unreviewed_sites(text: &str) -> Vec<(usize, &'static str)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    for (index, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]") {
            break;
        }
        if trimmed.starts_with("//") {
            continue;
        }
        let code = match line.find("//") {
            Some(at) if !line[..at].contains('"') => &line[..at],
            _ => line,
        };
        let Some(pattern) = PATTERNS.into_iter().find(|pattern| code.contains(pattern)) else {
            continue;
        };
        // A method chain split over lines is one statement: its comment sits above its head
        // (or on any of its lines).
        let mut head = index;
        while head > 0 && lines[head].trim_start().starts_with('.') {
            head -= 1;
        }
        let on_the_chain = lines[head..=index].iter().any(|line| line.contains(MARKER));
        let commented_above = lines[..head]
            .iter()
            .rev()
            .take_while(|above| above.trim_start().starts_with("//"))
            .any(|above| above.contains(MARKER));
        if !on_the_chain && !commented_above {
            found.push((index + 1, pattern));
        }
    }
    found
}

/// Whether the file at `relative` (to `cnibpf/src`) is pure logic.
fn is_pure(relative: &str) -> bool {
    PURE.iter().any(|pure| relative.starts_with(pure))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreviewed_swallow_is_found_and_a_reviewed_one_is_not() {
        let text = "\
fn a() {
    let x = map.get(&k).ok();
    // fail-closed: ENOENT only, see above.
    let y = thing().unwrap_or_default();
    let z = other().is_err(); // fail-closed: the caller retries.
    // a comment that says nothing
    let _ = write();
    // fail-closed: a chain split by rustfmt keeps its comment above its head.
    let w = thing
        .first()
        .unwrap_or(&0);
}
#[cfg(test)]
mod tests {
    fn t() { let _ = x.ok(); }
}
";
        assert_eq!(
            unreviewed_sites(text),
            vec![(2, ".ok()"), (7, "let _ =")],
            "tests and reviewed sites are not reported"
        );
    }

    #[test]
    fn pure_modules_are_not_read() {
        assert!(is_pure("config/mod.rs"));
        assert!(!is_pure("backend/mod.rs"));
    }
}
