//! Files no reader ever sees half of: written beside their place and renamed over it.

use std::{
    fs,
    io::{self, Write as _},
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
};

/// Puts `content` at `path` by renaming a synced temporary file of the same directory over
/// it: a reader sees the old file or the new one, whole; a process holding the old one open
/// keeps it.
pub fn replace(path: &Path, content: &[u8], mode: u32) -> io::Result<()> {
    // fail-closed: an Option of the path, not an error.
    let directory = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        // fail-closed: an Option of the path, as above.
        .unwrap_or_default();
    let temporary = directory.join(format!(
        "{}{}.tmp",
        temporary_prefix(&name),
        std::process::id()
    ));
    let written = (|| {
        let mut file = fs::File::create(&temporary)?;
        file.write_all(content)?;
        file.set_permissions(fs::Permissions::from_mode(mode))?;
        file.sync_all()?;
        fs::rename(&temporary, path)?;
        fs::File::open(directory)?.sync_all()
    })();
    // fail-closed: the write's own error is the one reported; a temporary left behind is a
    // dot file, which no reader of `path` opens.
    if written.is_err() {
        // fail-closed: as above.
        let _ = fs::remove_file(&temporary);
    }
    written
}

/// What the names of `replace`'s temporaries for a file named `name` start with.
fn temporary_prefix(name: &str) -> String {
    format!(".{name}.")
}

/// Removes the temporaries `replace` left beside `path` when their writer was killed between
/// creating one and renaming it over `path` (a runtime's timeout kills plugins); what it
/// removed. Only for a file whose every writer holds one lock, which the caller holds: no
/// temporary of a live writer can be there.
pub fn reap_temporaries(path: &Path) -> io::Result<Vec<PathBuf>> {
    let (Some(directory), Some(name)) = (path.parent(), path.file_name()) else {
        return Ok(Vec::new());
    };
    let prefix = temporary_prefix(&name.to_string_lossy());
    let entries = match fs::read_dir(directory) {
        Ok(entries) => entries,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) => return Err(error),
    };
    let mut reaped = Vec::new();
    for entry in entries {
        let file_name = entry?.file_name();
        let file_name = file_name.to_string_lossy();
        let Some(writer) = file_name
            .strip_prefix(&prefix)
            .and_then(|rest| rest.strip_suffix(".tmp"))
        else {
            continue;
        };
        if writer.is_empty() || !writer.bytes().all(|byte| byte.is_ascii_digit()) {
            continue;
        }
        let temporary = directory.join(file_name.as_ref());
        match fs::remove_file(&temporary) {
            Ok(()) => reaped.push(temporary),
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(error),
        }
    }
    Ok(reaped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_killed_writers_temporaries_are_reaped_and_nothing_else() {
        let directory = std::env::temp_dir().join(format!("cnibpf-reap-{}", std::process::id()));
        fs::create_dir_all(&directory).expect("directory");
        let path = directory.join("x.nftables.json");
        replace(&path, b"{}\n", 0o600).expect("written");
        for other in [
            ".x.nftables.json.4242.tmp",
            ".x.nftables.json.17.tmp",
            ".x.nftables.json.abc.tmp",
            ".y.nftables.json.4242.tmp",
            "x.nftables.json.4242.tmp",
        ] {
            fs::write(directory.join(other), b"").expect("temporary");
        }
        let mut reaped = reap_temporaries(&path).expect("reaped");
        reaped.sort();
        assert_eq!(
            reaped,
            [
                directory.join(".x.nftables.json.17.tmp"),
                directory.join(".x.nftables.json.4242.tmp")
            ]
        );
        let mut left: Vec<String> = fs::read_dir(&directory)
            .expect("list")
            .map(|entry| {
                entry
                    .expect("entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                ".x.nftables.json.abc.tmp",
                ".y.nftables.json.4242.tmp",
                "x.nftables.json",
                "x.nftables.json.4242.tmp"
            ]
        );
        fs::remove_dir_all(&directory).expect("cleaned up");
    }
}
