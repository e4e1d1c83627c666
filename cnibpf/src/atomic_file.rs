//! Files no reader ever sees half of: written beside their place and renamed over it.

use std::{
    fs,
    io::{self, Write as _},
    os::unix::fs::PermissionsExt as _,
    path::Path,
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
    let temporary = directory.join(format!(".{name}.{}.tmp", std::process::id()));
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
