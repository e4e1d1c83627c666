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
    static_binary_for(&format!("{}-unknown-linux-gnu", std::env::consts::ARCH))
}

/// [`static_binary`] of Rust target `target`.
fn static_binary_for(target: &str) -> PathBuf {
    let path = repository()
        .join("target/static")
        .join(target)
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
        if args.first() == Some(&"uninstall") {
            // As the uninstall manifest grants: reading (and removing) the datapath.
            command.extend(["--cap-add", "BPF,NET_ADMIN,SYS_ADMIN"]);
        }
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
    assert_eq!(
        read_json(&primary),
        flannel(),
        "the primary's file is not written"
    );
    let own_file = conf_dir.join("10-flannel.cnibpf.conflist");
    let chained = read_json(&own_file);
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
    assert_eq!(read_json(&primary), flannel(), "as it was");
    assert!(!own_file.exists(), "cnibpf's conflist removed");
    assert!(!bin_dir.join("cnibpf").exists(), "binary removed");

    // The DaemonSet's init container: bpffs mounted inside a privileged container on a
    // volume with shared propagation (Kubernetes' Bidirectional) appears on the host, where
    // the plugin pins; run again, it finds it there.
    let host_bpffs = node.join("sys/fs/bpf");
    std::fs::create_dir_all(&host_bpffs).expect("host bpffs dir");
    let shared = SharedMount::new(&host_bpffs);
    let mount = format!(
        "type=bind,src={},dst=/sys/fs/bpf,bind-propagation=rshared",
        shared.path.display()
    );
    let init = |expect: &str| {
        let output = podman.run(&[
            "run",
            "--rm",
            "--privileged",
            "--network",
            "none",
            "--mount",
            &mount,
            "localhost/cnibpf:test",
            "mount-bpffs",
            "--path=/sys/fs/bpf",
        ]);
        let said = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success() && said.contains(expect),
            "mount-bpffs ({expect}): {output:?}"
        );
    };
    init("mounted bpffs on /sys/fs/bpf");
    assert_eq!(
        filesystem_type(&shared.path),
        "bpf_fs",
        "the host sees the bpffs the container mounted"
    );
    init("is a bpffs already");
}

/// `path` bind-mounted on itself with shared propagation (what kubelet makes of a hostPath
/// with Bidirectional propagation), unmounted with whatever was mounted under it on drop.
struct SharedMount {
    path: PathBuf,
}

impl SharedMount {
    fn new(path: &Path) -> Self {
        // What an interrupted earlier run left would be bound over again, and with shared
        // propagation every bind doubles the mounts there.
        assert!(Self::unmount_all(path), "{} stays mounted", path.display());
        for args in [
            vec!["--bind", &*path.to_string_lossy(), &*path.to_string_lossy()],
            vec!["--make-rshared", &*path.to_string_lossy()],
        ] {
            let output = std::process::Command::new("mount")
                .args(&args)
                .output()
                .expect("run mount");
            assert!(output.status.success(), "mount {args:?}: {output:?}");
        }
        Self {
            path: path.to_owned(),
        }
    }
}

impl SharedMount {
    /// Every mount at `path`: made private first (unmounting a shared mount leaves the copies
    /// propagation made to its peers), then detached until nothing is mounted there. Whether
    /// that was reached.
    fn unmount_all(path: &Path) -> bool {
        for _ in 0..64 {
            let mounted = std::process::Command::new("mountpoint")
                .arg("-q")
                .arg(path)
                .status()
                .is_ok_and(|status| status.success());
            if !mounted {
                return true;
            }
            let _ = std::process::Command::new("mount")
                .arg("--make-rprivate")
                .arg(path)
                .status();
            let _ = std::process::Command::new("umount")
                .args(["--recursive", "--lazy"])
                .arg(path)
                .status();
        }
        false
    }
}

impl Drop for SharedMount {
    fn drop(&mut self) {
        if !Self::unmount_all(&self.path) {
            eprintln!("{} stays mounted", self.path.display());
        }
    }
}

/// The type of the filesystem `path` is on, as `stat -f` names it.
fn filesystem_type(path: &Path) -> String {
    let output = std::process::Command::new("stat")
        .args(["-f", "-c", "%T"])
        .arg(path)
        .output()
        .expect("run stat");
    assert!(
        output.status.success(),
        "stat -f {}: {output:?}",
        path.display()
    );
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// `kubernetes-validate --strict` over `manifests` (the API's schemas, offline): its report.
fn validate(manifests: &[PathBuf]) -> String {
    let validator = cnibpf_tests::tools_dir().join("kubernetes-validate/bin/kubernetes-validate");
    let output = std::process::Command::new(&validator)
        .arg("--strict")
        .args(manifests)
        .output()
        .unwrap_or_else(|error| {
            panic!(
                "run {} (scripts/bootstrap.sh installs it): {error}",
                validator.display()
            )
        });
    let report = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{report}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    report
}

const DAEMONSET: &str = "deploy/base/cnibpf.yaml";
const UNINSTALL: &str = "deploy/cnibpf-uninstall.yaml";

#[test]
fn the_manifests_are_valid_kubernetes_objects_and_name_the_image_xtask_builds() {
    let manifests = [DAEMONSET, UNINSTALL];
    let report = validate(&manifests.map(|manifest| repository().join(manifest)));
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
    let daemonset = std::fs::read_to_string(repository().join(DAEMONSET)).expect("manifest");
    for arg in [
        "- --watch",
        "- --reclaim-every=$(RECLAIM_EVERY)",
        "- --replace-portmap",
    ] {
        assert!(daemonset.contains(arg), "the DaemonSet runs install {arg}");
    }
}

/// The node's confinement lifted and its mounts in place, as Cilium's agent has them: the
/// runtime's AppArmor profile and SELinux's container_t off (each container), bpffs mounted
/// for the host by a privileged init container with Bidirectional propagation and seen by
/// the installer, Linux nodes only, no service account token.
#[test]
fn the_daemonset_runs_unconfined_with_bpffs_propagated_to_the_host() {
    let text = std::fs::read_to_string(repository().join(DAEMONSET)).expect("manifest");
    let documents: Vec<Value> = text
        .split("\n---\n")
        .map(|document| {
            serde_yaml_ng::from_str(document).unwrap_or_else(|error| panic!("YAML: {error}"))
        })
        .collect();
    let daemonset = documents
        .iter()
        .find(|document| document["kind"] == "DaemonSet")
        .expect("the DaemonSet");
    let pod = &daemonset["spec"]["template"]["spec"];
    assert_eq!(pod["nodeSelector"]["kubernetes.io/os"], "linux");
    assert_eq!(pod["automountServiceAccountToken"], false);
    let init = &pod["initContainers"][0];
    assert_eq!(init["args"], json!(["mount-bpffs", "--path=/sys/fs/bpf"]));
    assert_eq!(init["securityContext"]["privileged"], true);
    let bpffs_mount = |container: &Value| {
        container["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|mount| mount["mountPath"] == "/sys/fs/bpf")
            .cloned()
            .unwrap_or_else(|| panic!("{} mounts /sys/fs/bpf", container["name"]))
    };
    assert_eq!(bpffs_mount(init)["mountPropagation"], "Bidirectional");
    let installer = &pod["containers"][0];
    assert_eq!(
        bpffs_mount(installer)["mountPropagation"],
        "HostToContainer"
    );
    for container in [init, installer] {
        let context = &container["securityContext"];
        assert_eq!(
            (
                &context["appArmorProfile"]["type"],
                &context["seLinuxOptions"]["type"]
            ),
            (&json!("Unconfined"), &json!("spc_t")),
            "{}",
            container["name"]
        );
    }
    assert_eq!(installer["securityContext"]["privileged"], false);
}

/// The kustomize base renders the manifest as it is, and the example overlay sets the image,
/// the entry and the reclaim period; both stay valid objects.
#[test]
fn kustomize_renders_the_base_and_an_overlay() {
    let kubectl = std::process::Command::new("kubectl")
        .args(["version", "--client"])
        .output();
    if !kubectl.is_ok_and(|output| output.status.success()) {
        cnibpf_tests::skip(
            "no kubectl on this machine (Debian 12 does not package it; the development image has it)",
        );
        return;
    }
    let work = std::env::temp_dir().join(format!("cnibpf-kustomize-{}", std::process::id()));
    std::fs::create_dir_all(&work).expect("work dir");
    let render = |kustomization: &str| {
        let output = std::process::Command::new("kubectl")
            .arg("kustomize")
            .arg(repository().join(kustomization))
            .output()
            .expect("run kubectl kustomize");
        assert!(
            output.status.success(),
            "kubectl kustomize {kustomization}: {output:?}"
        );
        let rendered = work.join(format!("{}.yaml", kustomization.replace('/', "-")));
        std::fs::write(&rendered, &output.stdout).expect("write the rendering");
        let report = validate(std::slice::from_ref(&rendered));
        assert!(
            report.contains("daemonset/cnibpf ") && report.contains("configmap/cnibpf-entry"),
            "{report}"
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let base = render("deploy/base");
    assert!(base.contains("image: localhost/cnibpf:"), "{base}");
    assert!(base.contains("reclaim-every: 5m"), "{base}");
    let overlay = render("deploy/overlays/example");
    assert_eq!(
        overlay
            .matches("image: registry.example.com/cnibpf:0.6.0")
            .count(),
        2,
        "both containers run the overlay's image: {overlay}"
    );
    assert!(!overlay.contains("localhost/cnibpf"), "{overlay}");
    assert!(overlay.contains("reclaim-every: 10m"), "{overlay}");
    assert!(
        overlay.contains("\"ipMasq\": true"),
        "the overlay's entry: {overlay}"
    );
    let _ = std::fs::remove_dir_all(&work);
}

/// The node image for both architectures: `deploy/build-image.sh` (what `./dev image` runs)
/// makes one manifest list of amd64 and arm64 offline, and the arm64 binary — an AArch64 ELF,
/// cross-compiled — runs under qemu-user-static: `--version`, and a configuration parsed and
/// refused with the key that is wrong.
#[test]
fn the_image_is_built_for_amd64_and_arm64_and_the_arm64_binary_runs() {
    let arm64 = static_binary_for("aarch64-unknown-linux-gnu");
    let header = std::fs::read(&arm64).expect("the arm64 binary");
    const EM_AARCH64: u16 = 183;
    assert_eq!(
        (&header[..4], u16::from_le_bytes([header[18], header[19]])),
        (&b"\x7fELF"[..], EM_AARCH64),
        "an AArch64 ELF"
    );
    let version = std::process::Command::new("qemu-aarch64-static")
        .arg(&arm64)
        .arg("--version")
        .env_remove("CNI_COMMAND")
        .output()
        .expect("run qemu-aarch64-static (scripts/bootstrap.sh installs it)");
    let said = String::from_utf8_lossy(&version.stdout);
    assert!(
        version.status.success()
            && said.starts_with(&format!("cnibpf {} (commit ", env!("CARGO_PKG_VERSION"))),
        "{version:?}"
    );
    let mut refused = std::process::Command::new("qemu-aarch64-static")
        .arg(&arm64)
        .env("CNI_COMMAND", "ADD")
        .env("CNI_CONTAINERID", "arm64")
        .env("CNI_NETNS", "/proc/self/ns/net")
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/opt/cni/bin")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run the arm64 plugin");
    std::io::Write::write_all(
        &mut refused.stdin.take().expect("stdin"),
        json!({ "cniVersion": "1.0.0", "name": "n", "type": "cnibpf",
            "filter": [{ "index": "ten", "target": "DROP" }] })
        .to_string()
        .as_bytes(),
    )
    .expect("write the configuration");
    let refused = refused.wait_with_output().expect("wait for the plugin");
    let answer: Value = serde_json::from_slice(&refused.stdout)
        .unwrap_or_else(|error| panic!("a CNI error ({error}): {refused:?}"));
    assert_eq!(answer["code"], 7, "{answer}");
    assert!(
        answer["msg"]
            .as_str()
            .is_some_and(|msg| msg.contains("filter[0].index")),
        "{answer}"
    );

    let sim = SimHost::new("img-arch", json!({}));
    let podman = Podman::new(&sim);
    let tag = "localhost/cnibpf:arch-test";
    let built = std::process::Command::new(repository().join("deploy/build-image.sh"))
        .arg(tag)
        .arg(static_binary_for("x86_64-unknown-linux-gnu"))
        .arg(&arm64)
        .envs(podman.environment())
        .output()
        .expect("run deploy/build-image.sh");
    assert!(built.status.success(), "{built:?}");
    let inspected = podman.run(&["manifest", "inspect", tag]);
    assert!(inspected.status.success(), "{inspected:?}");
    let manifest: Value = serde_json::from_slice(&inspected.stdout).expect("the manifest list");
    let mut architectures: Vec<&str> = manifest["manifests"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|entry| entry["platform"]["architecture"].as_str())
        .collect();
    architectures.sort_unstable();
    assert_eq!(architectures, ["amd64", "arm64"], "{manifest:#}");
}

/// What the installer's pod is charged for beyond the maps: its own process, a few MiB.
const INSTALLER_OWN: u64 = 8 << 20;

/// The installer's memory request covers the maps `install --load` creates — the kernel charges
/// them to its pod — at the default sizes (the base) and at the example overlay's, with room for
/// its own few MiB: each datapath is loaded and measured here.
#[test]
fn the_memory_requests_cover_the_maps_the_installer_creates() {
    let request = |path: &str| -> u64 {
        let text = std::fs::read_to_string(repository().join(path)).expect("manifest");
        let documents = text.split("\n---\n").map(|document| {
            serde_yaml_ng::from_str::<Value>(document)
                .unwrap_or_else(|error| panic!("{path}: YAML: {error}"))
        });
        let memory = documents
            .filter(|document| document["kind"] == "DaemonSet")
            .flat_map(|daemonset| {
                daemonset["spec"]["template"]["spec"]["containers"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .find(|container| container["name"] == "install")
            .and_then(|container| {
                container["resources"]["requests"]["memory"]
                    .as_str()
                    .map(str::to_owned)
            })
            .unwrap_or_else(|| panic!("{path}: no memory request of the install container"));
        let mebibytes: u64 = memory
            .strip_suffix("Mi")
            .and_then(|number| number.parse().ok())
            .unwrap_or_else(|| panic!("{path}: memory {memory:?} is not in Mi"));
        mebibytes << 20
    };
    let entry: Value = serde_json::from_str(
        &std::fs::read_to_string(repository().join("deploy/overlays/example/entry.json"))
            .expect("the overlay's entry"),
    )
    .expect("the overlay's entry is JSON");
    let flows = entry["maxFlows"].to_string();
    let sim = SimHost::new("dmem", json!({ "backend": "ebpf" }));
    let pin_path = sim.pin_path.display().to_string();
    for (case, sizes, request) in [
        ("the base, default sizes", vec![], request(DAEMONSET)),
        (
            "the example overlay",
            vec!["--max-flows", flows.as_str()],
            request("deploy/overlays/example/memory.yaml"),
        ),
    ] {
        let mut args = vec!["load", "--backend", "ebpf", "--pin-path", &pin_path];
        args.extend(sizes);
        let output = sim.cnibpf(&args);
        assert!(output.status.success(), "{case}: load: {output:?}");
        let locked = sim.inspect()["ebpfMaps"]["memlockBytes"]
            .as_u64()
            .unwrap_or_else(|| panic!("{case}: inspect shows no map memory"));
        assert!(
            locked + INSTALLER_OWN <= request,
            "{case}: maps lock {} MiB, the request is {} MiB",
            locked >> 20,
            request >> 20
        );
    }
}
