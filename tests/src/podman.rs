//! podman (Debian's 4.3, CNI network backend) run against the simulated host's conflist, with
//! every configuration, storage and state path of its own under the host's work directory:
//! `podman run -p …` with a root filesystem made here (`--rootfs DIR:O`, nothing pulled).
//! Containers and mounts it leaves are removed on drop.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

use crate::{Netns, SimHost, chain, cri, image};

#[derive(Debug)]
pub struct Podman {
    base: PathBuf,
    host_netns: PathBuf,
    network: String,
    cgroup_parent: String,
}

impl Podman {
    pub fn new(sim: &SimHost) -> Self {
        Self::with_networks(sim, |conf_dir, bin_dir| {
            cri::cni_bin_dir(bin_dir, &["bridge", "host-local", "cnibpf"]);
            std::fs::write(
                conf_dir.join(format!("{}.conflist", sim.network())),
                serde_json::to_string_pretty(sim.chain.conflist()).expect("conflist"),
            )
            .expect("write the conflist");
        })
    }

    /// podman whose CNI conf and bin dirs `setup` fills (both exist, empty) before anything
    /// runs; its containers join the network named as `sim`'s.
    pub fn with_networks(sim: &SimHost, setup: impl FnOnce(&Path, &Path)) -> Self {
        let base = sim.work_dir.join("podman");
        let _ = std::fs::remove_dir_all(&base);
        for dir in [
            "root", "runroot", "runc", "tmp", "events", "conf", "rootfs", "bin",
        ] {
            std::fs::create_dir_all(base.join(dir)).expect("podman dir");
        }
        setup(&base.join("conf"), &base.join("bin"));
        image::write_rootfs(&base.join("rootfs"));
        let b = base.display();
        std::fs::write(
            base.join("containers.conf"),
            format!(
                r#"[containers]
# Within this machine's hard limits (the default nproc is above them).
default_ulimits = ["nofile=4096:4096", "nproc=4096:4096"]
log_driver = "k8s-file"
[network]
network_backend = "cni"
cni_plugin_dirs = ["{b}/bin"]
network_config_dir = "{b}/conf"
default_network = "{network}"
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "{b}/events/events.log"
tmp_dir = "{b}/tmp"
volume_path = "{b}/root/volumes"
static_dir = "{b}/root/libpod"
lock_type = "file"
image_copy_tmp_dir = "{b}/tmp"
"#,
                network = sim.network()
            ),
        )
        .expect("containers.conf");
        std::fs::write(
            base.join("storage.conf"),
            format!("[storage]\ndriver = \"overlay\"\ngraphroot = \"{b}/root\"\nrunroot = \"{b}/runroot\"\n"),
        )
        .expect("storage.conf");
        std::fs::write(
            base.join("registries.conf"),
            "unqualified-search-registries = []\n",
        )
        .expect("registries.conf");
        Self {
            base,
            host_netns: sim.host.path(),
            network: sim.network(),
            cgroup_parent: format!("/cnibpf-test-{}-podman", sim.id),
        }
    }

    /// The CNI configuration dir podman reads.
    pub fn conf_dir(&self) -> PathBuf {
        self.base.join("conf")
    }

    /// The CNI plugin dir podman runs plugins from.
    pub fn bin_dir(&self) -> PathBuf {
        self.base.join("bin")
    }

    /// The variables that point podman at this instance's configuration and storage, for a
    /// script that runs podman itself.
    pub fn environment(&self) -> [(&'static str, PathBuf); 3] {
        [
            ("CONTAINERS_CONF", self.base.join("containers.conf")),
            ("CONTAINERS_STORAGE_CONF", self.base.join("storage.conf")),
            (
                "CONTAINERS_REGISTRIES_CONF",
                self.base.join("registries.conf"),
            ),
        ]
    }

    /// `podman <args>` with this instance's configuration, in the simulated host.
    pub fn run(&self, args: &[&str]) -> Output {
        let mut command = Command::new("podman");
        command
            .envs(self.environment())
            .arg("--root")
            .arg(self.base.join("root"))
            .arg("--runroot")
            .arg(self.base.join("runroot"))
            .args(["--storage-driver", "overlay", "--runtime-flag"])
            .arg(format!("root={}", self.base.join("runc").display()))
            .args(args);
        chain::enter_netns_on_exec(&mut command, &self.host_netns);
        command
            .output()
            .expect("run podman (Debian package podman)")
    }

    /// `podman run -d` of `command` in a container named `name` with the `publish` options
    /// (`-p` values); panics with podman's words when it fails.
    pub fn start(&self, name: &str, publish: &[&str], command: &[&str]) -> String {
        let rootfs = format!("{}:O", self.base.join("rootfs").display());
        let mut args = vec![
            "run",
            "-d",
            "--name",
            name,
            "--network",
            &self.network,
            "--cgroup-parent",
            &self.cgroup_parent,
        ];
        for port in publish {
            args.extend(["-p", port]);
        }
        args.extend(["--rootfs", &rootfs]);
        args.extend(command);
        let output = self.run(&args);
        assert!(
            output.status.success(),
            "podman run failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    /// The network namespace of container `name`.
    pub fn netns(&self, name: &str) -> Netns {
        let output = self.run(&[
            "inspect",
            "--format",
            "{{.NetworkSettings.SandboxKey}}",
            name,
        ]);
        let path = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        assert!(
            output.status.success() && !path.is_empty(),
            "podman inspect {name}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        Netns::at(Path::new(&path))
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = self.run(&["rm", "--force", "--all", "--time", "0"]);
        cri::unmount_below(&self.base);
        cri::remove_cgroups(&self.cgroup_parent);
        let _ = std::fs::remove_dir_all(&self.base);
    }
}
