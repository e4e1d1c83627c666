//! containerd's CRI driven the way kubelet drives it: Debian's containerd 1.6 started with a
//! config, root, state and socket of its own inside the simulated host's network namespace,
//! using the host's conflist (bridge + cnibpf) from a conf dir of its own, and a CRI v1 client
//! over its socket. The pod image is made here (no registry) and imported with `ctr`.
//! Everything it starts is stopped and removed on drop, also after a failed test.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use hyper_util::rt::TokioIo;
use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, CreateContainerRequest, ExecSyncRequest, ImageSpec,
    LinuxContainerConfig, LinuxContainerSecurityContext, LinuxPodSandboxConfig,
    LinuxSandboxSecurityContext, NamespaceMode, NamespaceOption, PodSandboxMetadata,
    PodSandboxStatusRequest, PortMapping, RemovePodSandboxRequest, RunPodSandboxRequest,
    StartContainerRequest, StopPodSandboxRequest, VersionRequest,
    runtime_service_client::RuntimeServiceClient,
};
pub use k8s_cri::v1::{PodSandboxConfig, Protocol};
use sha2::{Digest as _, Sha256};
use tonic::transport::{Channel, Endpoint, Uri};

use crate::{Netns, SimHost, image, topology};

/// The image every pod and container runs (imported, never pulled).
pub const IMAGE: &str = "localhost/cnibpf-test-busybox:latest";

/// A private containerd in a simulated host.
#[derive(Debug)]
pub struct Containerd {
    base: PathBuf,
    socket: PathBuf,
    /// cgroup parent of every pod (cgroupfs driver), removed on drop.
    cgroup_parent: String,
    child: Option<Child>,
    /// Every sandbox and container made through a client: containerd 1.6 leaves their shims'
    /// sockets in /run/containerd/s, named after them.
    made: Arc<Mutex<Vec<String>>>,
}

/// The CNI plugins containerd may run: the reference ones and the cnibpf under test.
pub fn cni_bin_dir(dir: &Path, plugins: &[&str]) {
    std::fs::create_dir_all(dir).expect("CNI bin dir");
    for plugin in plugins {
        let source = if *plugin == "cnibpf" {
            topology::cnibpf_binary()
        } else {
            Path::new("/usr/lib/cni").join(plugin)
        };
        let link = dir.join(plugin);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&source, &link)
            .unwrap_or_else(|error| panic!("link {}: {error}", link.display()));
    }
}

impl Containerd {
    /// containerd serving `sim`'s conflist in `sim`'s host namespace, with the test image
    /// imported.
    pub fn start(sim: &SimHost) -> Self {
        Self::start_with(sim, |conf_dir, _| {
            std::fs::write(
                conf_dir.join(format!("10-{}.conflist", sim.network())),
                serde_json::to_string_pretty(sim.chain.conflist()).expect("conflist"),
            )
            .expect("write the conflist");
        })
    }

    /// containerd with the conf dir `configure` fills (given the conf and bin dirs).
    pub fn start_with(sim: &SimHost, configure: impl FnOnce(&Path, &Path)) -> Self {
        let base = sim.work_dir.join("containerd");
        let _ = std::fs::remove_dir_all(&base);
        for dir in ["root", "state", "conf", "logs"] {
            std::fs::create_dir_all(base.join(dir)).expect("containerd dir");
        }
        cni_bin_dir(
            &base.join("bin"),
            &["bridge", "host-local", "loopback", "portmap", "cnibpf"],
        );
        configure(&base.join("conf"), &base.join("bin"));
        let socket = base.join("containerd.sock");
        let b = base.display();
        std::fs::write(
            base.join("config.toml"),
            format!(
                r#"version = 2
root = "{b}/root"
state = "{b}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{b}/containerd.sock"
[ttrpc]
  address = "{b}/containerd.sock.ttrpc"
[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = "{b}/opt"
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "{IMAGE}"
    # Root here lacks CAP_SYS_RESOURCE: without this, runc fails with "can't get final
    # child's PID from pipe".
    restrict_oom_score_adj = true
    netns_mounts_under_state_dir = true
    disable_apparmor = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = false
          Root = "{b}/runc"
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "{b}/bin"
      conf_dir = "{b}/conf"
      max_conf_num = 1
"#
            ),
        )
        .expect("write containerd's config");
        let log = std::fs::File::create(base.join("containerd.log")).expect("containerd log");
        let mut process = Command::new("containerd");
        process
            .arg("--config")
            .arg(base.join("config.toml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        crate::chain::enter_netns_on_exec(&mut process, &sim.host.path());
        let child = process
            .spawn()
            .expect("start containerd (Debian package containerd)");
        let containerd = Self {
            cgroup_parent: format!("/cnibpf-test-{}-pods", sim.id),
            base,
            socket,
            child: Some(child),
            made: Arc::default(),
        };
        let started = Instant::now();
        while !containerd.socket.exists() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "containerd made no socket; see {}",
                containerd.base.join("containerd.log").display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let tarball = containerd.base.join("image.tar");
        image::write_docker_archive(&tarball, IMAGE);
        crate::netns::run_checked(
            Command::new("ctr")
                .arg("-a")
                .arg(&containerd.socket)
                .args(["-n", "k8s.io", "images", "import"])
                .arg(&tarball),
        );
        containerd
    }

    pub fn client(&self) -> Cri {
        Cri::connect(&self.socket, &self.cgroup_parent, Arc::clone(&self.made))
    }

    /// containerd's log, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.base.join("containerd.log")).unwrap_or_default()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let deadline = Instant::now() + Duration::from_secs(10);
            while !matches!(child.try_wait(), Ok(Some(_))) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        let made = self
            .made
            .lock()
            .map(|made| made.clone())
            .unwrap_or_default();
        for id in made {
            let name = Sha256::digest(format!("{}/k8s.io/{id}", self.socket.display()).as_bytes());
            let _ = std::fs::remove_file(format!("/run/containerd/s/{name:x}"));
        }
        // Pods left by a failed test: their shims and containers outlive containerd.
        let tasks = self.base.join("state/io.containerd.runtime.v2.task/k8s.io");
        let runc_root = self.base.join("runc/k8s.io");
        for task in std::fs::read_dir(&tasks).into_iter().flatten().flatten() {
            let id = task.file_name().to_string_lossy().into_owned();
            let _ = Command::new("runc")
                .arg("--root")
                .arg(&runc_root)
                .args(["delete", "-f", &id])
                .output();
            for cached in std::fs::read_dir("/var/lib/cni/results")
                .into_iter()
                .flatten()
                .flatten()
            {
                if cached.file_name().to_string_lossy().contains(&id) {
                    let _ = std::fs::remove_file(cached.path());
                }
            }
        }
        let address = format!("-address\0{}\0", self.socket.display());
        for process in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = process.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let command_line = std::fs::read(process.path().join("cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&command_line).contains(&address) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        unmount_below(&self.base);
        remove_cgroups(&self.cgroup_parent);
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

/// Unmounts everything mounted below `dir` (rootfs overlays, pod namespaces), deepest first.
pub fn unmount_below(dir: &Path) {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let prefix = dir.display().to_string();
    let mut points: Vec<&str> = mounts
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .filter(|point| point.starts_with(&prefix))
        .collect();
    points.sort_by_key(|point| std::cmp::Reverse(point.len()));
    for point in points {
        let _ = Command::new("umount").args(["-l", point]).output();
    }
}

/// Removes `parent` and the cgroups under it in every hierarchy (v1 controllers and v2).
pub fn remove_cgroups(parent: &str) {
    fn remove_tree(dir: &Path) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if entry.path().is_dir() {
                remove_tree(&entry.path());
            }
        }
        let _ = std::fs::remove_dir(dir);
    }
    let relative = parent.trim_start_matches('/');
    for hierarchy in std::fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
    {
        remove_tree(&hierarchy.path().join(relative));
    }
    remove_tree(&Path::new("/sys/fs/cgroup").join(relative));
}

/// A CRI v1 client over containerd's socket; each call blocks, as the tests do.
#[derive(Debug)]
pub struct Cri {
    runtime: tokio::runtime::Runtime,
    service: RuntimeServiceClient<Channel>,
    cgroup_parent: String,
    made: Arc<Mutex<Vec<String>>>,
}

/// A running pod: its sandbox id and network namespace.
#[derive(Debug)]
pub struct Pod {
    pub id: String,
    pub config: PodSandboxConfig,
    pub netns: Netns,
    pub ip: String,
}

/// A hostPort as kubelet passes it: (protocol, containerPort, hostPort, hostIP or "").
pub fn host_port(
    protocol: Protocol,
    container_port: i32,
    host_port: i32,
    host_ip: &str,
) -> PortMapping {
    PortMapping {
        protocol: protocol as i32,
        container_port,
        host_port,
        host_ip: host_ip.to_owned(),
    }
}

impl Cri {
    fn connect(socket: &Path, cgroup_parent: &str, made: Arc<Mutex<Vec<String>>>) -> Self {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        let socket = socket.to_owned();
        let channel = runtime
            .block_on(async move {
                Endpoint::try_from("http://containerd")?
                    .connect_with_connector(tower::service_fn(move |_: Uri| {
                        let socket = socket.clone();
                        async move {
                            Ok::<_, std::io::Error>(TokioIo::new(
                                tokio::net::UnixStream::connect(socket).await?,
                            ))
                        }
                    }))
                    .await
            })
            .expect("connect to containerd's socket");
        let mut cri = Self {
            runtime,
            service: RuntimeServiceClient::new(channel),
            cgroup_parent: cgroup_parent.to_owned(),
            made,
        };
        let version = cri
            .runtime
            .block_on(cri.service.version(VersionRequest {
                version: "v1".to_owned(),
            }))
            .expect("CRI Version")
            .into_inner();
        assert_eq!(version.runtime_api_version, "v1");
        cri
    }

    /// The sandbox config kubelet would send for pod `namespace/name` (attempt `attempt`).
    pub fn pod_config(
        &self,
        namespace: &str,
        name: &str,
        attempt: u32,
        port_mappings: Vec<PortMapping>,
    ) -> PodSandboxConfig {
        let uid = format!("{namespace}-{name}-uid");
        PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: name.to_owned(),
                uid: uid.clone(),
                namespace: namespace.to_owned(),
                attempt,
            }),
            hostname: name.to_owned(),
            port_mappings,
            labels: HashMap::from([
                ("io.kubernetes.pod.name".to_owned(), name.to_owned()),
                (
                    "io.kubernetes.pod.namespace".to_owned(),
                    namespace.to_owned(),
                ),
                ("io.kubernetes.pod.uid".to_owned(), uid.clone()),
            ]),
            linux: Some(LinuxPodSandboxConfig {
                cgroup_parent: format!("{}/pod{uid}", self.cgroup_parent),
                security_context: Some(LinuxSandboxSecurityContext {
                    namespace_options: Some(pod_namespaces()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// RunPodSandbox, as kubelet calls it.
    pub fn run_pod(&mut self, config: PodSandboxConfig) -> Result<Pod, tonic::Status> {
        let id = self
            .runtime
            .block_on(self.service.run_pod_sandbox(RunPodSandboxRequest {
                config: Some(config.clone()),
                runtime_handler: String::new(),
            }))?
            .into_inner()
            .pod_sandbox_id;
        self.record(&id);
        let status = self
            .runtime
            .block_on(self.service.pod_sandbox_status(PodSandboxStatusRequest {
                pod_sandbox_id: id.clone(),
                verbose: true,
            }))?
            .into_inner();
        let ip = status
            .status
            .as_ref()
            .and_then(|status| status.network.as_ref())
            .map(|network| network.ip.clone())
            .unwrap_or_default();
        let info: serde_json::Value =
            serde_json::from_str(status.info.get("info").map_or("{}", String::as_str))
                .unwrap_or_default();
        let netns = info["runtimeSpec"]["linux"]["namespaces"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|namespace| namespace["type"] == "network")
            .and_then(|namespace| namespace["path"].as_str())
            .map(PathBuf::from)
            .unwrap_or_else(|| panic!("no network namespace in the sandbox's spec: {info}"));
        Ok(Pod {
            id,
            config,
            netns: Netns::at(&netns),
            ip,
        })
    }

    /// A container in `pod` running `command` (busybox applets), started.
    pub fn start_container(&mut self, pod: &Pod, name: &str, command: &[&str]) -> String {
        let config = ContainerConfig {
            metadata: Some(ContainerMetadata {
                name: name.to_owned(),
                attempt: 0,
            }),
            image: Some(ImageSpec {
                image: IMAGE.to_owned(),
                ..Default::default()
            }),
            command: command.iter().map(|word| (*word).to_owned()).collect(),
            linux: Some(LinuxContainerConfig {
                security_context: Some(LinuxContainerSecurityContext {
                    namespace_options: Some(pod_namespaces()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let id = self
            .runtime
            .block_on(self.service.create_container(CreateContainerRequest {
                pod_sandbox_id: pod.id.clone(),
                config: Some(config),
                sandbox_config: Some(pod.config.clone()),
            }))
            .unwrap_or_else(|status| panic!("CreateContainer {name}: {status}"))
            .into_inner()
            .container_id;
        self.record(&id);
        self.runtime
            .block_on(self.service.start_container(StartContainerRequest {
                container_id: id.clone(),
            }))
            .unwrap_or_else(|status| panic!("StartContainer {name}: {status}"));
        id
    }

    /// ExecSync: the command's exit code and standard output.
    pub fn exec(&mut self, container_id: &str, command: &[&str]) -> (i32, String) {
        let answer = self
            .runtime
            .block_on(self.service.exec_sync(ExecSyncRequest {
                container_id: container_id.to_owned(),
                cmd: command.iter().map(|word| (*word).to_owned()).collect(),
                timeout: 10,
            }))
            .unwrap_or_else(|status| panic!("ExecSync {command:?}: {status}"))
            .into_inner();
        (
            answer.exit_code,
            String::from_utf8_lossy(&answer.stdout).into_owned(),
        )
    }

    fn record(&self, id: &str) {
        if let Ok(mut made) = self.made.lock() {
            made.push(id.to_owned());
        }
    }

    pub fn stop_pod(&mut self, pod_id: &str) -> Result<(), tonic::Status> {
        self.runtime
            .block_on(self.service.stop_pod_sandbox(StopPodSandboxRequest {
                pod_sandbox_id: pod_id.to_owned(),
            }))
            .map(|_| ())
    }

    pub fn remove_pod(&mut self, pod_id: &str) -> Result<(), tonic::Status> {
        self.runtime
            .block_on(self.service.remove_pod_sandbox(RemovePodSandboxRequest {
                pod_sandbox_id: pod_id.to_owned(),
            }))
            .map(|_| ())
    }
}

fn pod_namespaces() -> NamespaceOption {
    NamespaceOption {
        network: NamespaceMode::Pod as i32,
        pid: NamespaceMode::Container as i32,
        ipc: NamespaceMode::Pod as i32,
        ..Default::default()
    }
}
