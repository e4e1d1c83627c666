//! What ships to a Kubernetes node: the image podman builds from `deploy/Containerfile` (the
//! statically linked cnibpf alone) installs into and uninstalls from the host directories it
//! is given, and the manifests are valid objects of the Kubernetes API, checked offline
//! against its schemas.

use std::path::{Path, PathBuf};

use cnibpf_tests::{SimHost, podman::Podman};
use serde_json::{Value, json};

fn repository() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lives in the workspace")
}

/// The binary `cargo xtask image` puts in the image (`cargo xtask test` builds it first).
fn static_binary() -> PathBuf {
    let path = repository()
        .join("target/static")
        .join(format!("{}-unknown-linux-gnu", std::env::consts::ARCH))
        .join("release/cnibpf");
    assert!(
        path.exists(),
        "{} not found: cargo xtask image (or cargo xtask test) builds it",
        path.display()
    );
    path
}

fn flannel() -> Value {
    json!({ "name": "cbr0", "cniVersion": "0.3.1", "plugins": [
        { "type": "flannel", "delegate": { "hairpinMode": true, "isDefaultGateway": true } },
        { "type": "portmap", "capabilities": { "portMappings": true } },
    ]})
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|error| panic!("read {}: {error}", path.display()));
    serde_json::from_str(&text)
        .unwrap_or_else(|error| panic!("{} ({error}):\n{text}", path.display()))
}

#[test]
fn the_image_installs_into_the_host_dirs_and_uninstalls_from_them() {
    let sim = SimHost::new("img", json!({}));
    let podman = Podman::new(&sim);
    let context = sim.work_dir.join("image");
    std::fs::create_dir_all(&context).expect("image context");
    std::fs::copy(static_binary(), context.join("cnibpf")).expect("copy the static binary");
    let containerfile = repository().join("deploy/Containerfile");
    let built = podman.run(&[
        "build",
        "--tag",
        "localhost/cnibpf:test",
        "--file",
        &containerfile.display().to_string(),
        &context.display().to_string(),
    ]);
    assert!(built.status.success(), "podman build: {built:?}");

    let node = sim.work_dir.join("node");
    let (conf_dir, bin_dir) = (node.join("etc/cni/net.d"), node.join("opt/cni/bin"));
    for dir in [&conf_dir, &bin_dir] {
        std::fs::create_dir_all(dir).expect("host dir");
    }
    let primary = conf_dir.join("10-flannel.conflist");
    std::fs::write(&primary, flannel().to_string()).expect("the primary network");
    let mounts = [
        format!("{}:/host/etc/cni/net.d", conf_dir.display()),
        format!("{}:/host/opt/cni/bin", bin_dir.display()),
    ];
    let run = |args: &[&str]| {
        let mut command = vec!["run", "--rm", "--network", "none"];
        for mount in &mounts {
            command.extend(["--volume", mount]);
        }
        command.push("localhost/cnibpf:test");
        command.extend(args);
        podman.run(&command)
    };

    // The image's default command: install, which refuses to chain after portmap.
    let refused = run(&[]);
    assert!(
        !refused.status.success()
            && String::from_utf8_lossy(&refused.stderr).contains("--replace-portmap"),
        "{refused:?}"
    );
    assert_eq!(read_json(&primary), flannel(), "untouched");

    let host_dirs = [
        "--conf-dir",
        "/host/etc/cni/net.d",
        "--bin-dir",
        "/host/opt/cni/bin",
    ];
    let installed = run(&[&["install", "--replace-portmap"][..], &host_dirs].concat());
    assert!(installed.status.success(), "install: {installed:?}");
    let chained = read_json(&primary);
    assert_eq!(chained["plugins"][1]["type"], "cnibpf", "{chained:#}");
    assert_eq!(
        std::fs::read(bin_dir.join("cnibpf")).expect("the installed binary"),
        std::fs::read(static_binary()).expect("the static binary"),
        "the image's binary is on the host"
    );
    let version = std::process::Command::new(bin_dir.join("cnibpf"))
        .arg("--version")
        .output()
        .expect("run the installed binary on the host");
    assert!(version.status.success(), "{version:?}");

    let removed = run(&[&["uninstall"][..], &host_dirs].concat());
    assert!(removed.status.success(), "uninstall: {removed:?}");
    assert_eq!(read_json(&primary), flannel(), "restored");
    assert!(!bin_dir.join("cnibpf").exists(), "binary removed");
}

#[test]
fn the_manifests_are_valid_kubernetes_objects_and_name_the_image_xtask_builds() {
    let tools = std::env::var_os("CNIBPF_TOOLS_DIR").map_or_else(
        || Path::new(&std::env::var_os("HOME").expect("HOME")).join(".local/share/cnibpf-tools"),
        PathBuf::from,
    );
    let validator = tools.join("kubernetes-validate/bin/kubernetes-validate");
    let manifests = ["deploy/cnibpf.yaml", "deploy/cnibpf-uninstall.yaml"];
    let output = std::process::Command::new(&validator)
        .arg("--strict")
        .args(manifests.map(|manifest| repository().join(manifest)))
        .output()
        .unwrap_or_else(|error| {
            panic!(
                "run {} (scripts/bootstrap.sh installs it): {error}",
                validator.display()
            )
        });
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{report}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for resource in [
        "configmap/cnibpf-entry",
        "daemonset/cnibpf ",
        "daemonset/cnibpf-uninstall",
    ] {
        assert!(report.contains(resource), "{resource} validated: {report}");
    }
    let image = format!("image: localhost/cnibpf:{}", env!("CARGO_PKG_VERSION"));
    for manifest in manifests {
        let text = std::fs::read_to_string(repository().join(manifest)).expect("manifest");
        assert!(text.contains(&image), "{manifest} runs {image}");
    }
    let daemonset = std::fs::read_to_string(repository().join(manifests[0])).expect("manifest");
    for arg in ["- --watch", "- --reclaim-every=", "- --replace-portmap"] {
        assert!(daemonset.contains(arg), "the DaemonSet runs install {arg}");
    }
}
