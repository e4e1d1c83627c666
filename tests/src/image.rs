//! A container image made here, without a registry: Debian's busybox-static with its applets,
//! a passwd, and a page for httpd to serve — as a root filesystem directory (podman's
//! `--rootfs`) and as a docker-archive tarball (`ctr images import`).

use std::{io::Write as _, path::Path, process::Command};

use sha2::{Digest as _, Sha256};

/// What the image's httpd serves at `/`.
pub const PAGE: &str = "hello from busybox\n";
const BUSYBOX: &str = "/bin/busybox";

/// A file of the image: path, mode, contents.
type ImageFile = (&'static str, u32, Vec<u8>);

/// The files of the image, and the applets (symlinks to busybox).
fn contents() -> (Vec<ImageFile>, Vec<String>) {
    let busybox = std::fs::read(BUSYBOX)
        .unwrap_or_else(|error| panic!("{BUSYBOX} (Debian's busybox-static): {error}"));
    let output = Command::new(BUSYBOX)
        .arg("--list")
        .output()
        .expect("busybox --list");
    let applets = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|applet| *applet != "busybox")
        .map(str::to_owned)
        .collect();
    let files = vec![
        ("bin/busybox", 0o755, busybox),
        (
            "etc/passwd",
            0o644,
            b"root:x:0:0:root:/root:/bin/sh\n".to_vec(),
        ),
        ("etc/group", 0o644, b"root:x:0:\n".to_vec()),
        ("www/index.html", 0o644, PAGE.as_bytes().to_vec()),
    ];
    (files, applets)
}

const DIRECTORIES: [(&str, u32); 8] = [
    ("bin", 0o755),
    ("etc", 0o755),
    ("proc", 0o755),
    ("sys", 0o755),
    ("dev", 0o755),
    ("root", 0o755),
    ("www", 0o755),
    ("tmp", 0o1777),
];

/// The image as a root filesystem in `dir` (created).
pub fn write_rootfs(dir: &Path) {
    use std::os::unix::fs::PermissionsExt as _;
    let (files, applets) = contents();
    for (name, mode) in DIRECTORIES {
        let path = dir.join(name);
        std::fs::create_dir_all(&path).expect("rootfs directory");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("mode");
    }
    for (name, mode, data) in files {
        let path = dir.join(name);
        std::fs::write(&path, data).expect("rootfs file");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("mode");
    }
    for applet in applets {
        let _ = std::os::unix::fs::symlink("busybox", dir.join("bin").join(applet));
    }
}

/// The image as a docker-archive tarball at `out`, tagged `tag`, whose default command sleeps
/// (so it also serves as the pod sandbox image).
pub fn write_docker_archive(out: &Path, tag: &str) {
    let (files, applets) = contents();
    let header = |kind: tar::EntryType, mode: u32, size: u64| {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_size(size);
        header.set_mtime(0);
        header
    };
    let mut layer = tar::Builder::new(Vec::new());
    for (name, mode) in DIRECTORIES {
        layer
            .append_data(
                &mut header(tar::EntryType::Directory, mode, 0),
                format!("{name}/"),
                std::io::empty(),
            )
            .expect("layer directory");
    }
    for (name, mode, data) in &files {
        layer
            .append_data(
                &mut header(tar::EntryType::Regular, *mode, data.len() as u64),
                name,
                data.as_slice(),
            )
            .expect("layer file");
    }
    for applet in applets {
        layer
            .append_link(
                &mut header(tar::EntryType::Symlink, 0o777, 0),
                format!("bin/{applet}"),
                "busybox",
            )
            .expect("layer symlink");
    }
    let layer = layer.into_inner().expect("layer");
    let layer_digest = format!("{:x}", Sha256::digest(&layer));
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z",
        "config": { "Env": ["PATH=/bin"], "Entrypoint": ["/bin/sleep"], "Cmd": ["infinity"], "WorkingDir": "/" },
        "rootfs": { "type": "layers", "diff_ids": [format!("sha256:{layer_digest}")] },
    })
    .to_string();
    let config_digest = format!("{:x}", Sha256::digest(config.as_bytes()));
    let manifest = serde_json::json!([{
        "Config": format!("{config_digest}.json"),
        "RepoTags": [tag],
        "Layers": [format!("{layer_digest}/layer.tar")],
    }])
    .to_string();
    let file = std::fs::File::create(out)
        .unwrap_or_else(|error| panic!("create {}: {error}", out.display()));
    let mut archive = tar::Builder::new(file);
    for (name, data) in [
        ("manifest.json".to_owned(), manifest.into_bytes()),
        (format!("{config_digest}.json"), config.into_bytes()),
        (format!("{layer_digest}/layer.tar"), layer),
    ] {
        archive
            .append_data(
                &mut header(tar::EntryType::Regular, 0o644, data.len() as u64),
                name,
                data.as_slice(),
            )
            .expect("archive entry");
    }
    archive
        .into_inner()
        .expect("archive")
        .flush()
        .expect("flush archive");
}
