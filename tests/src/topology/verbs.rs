//! The CNI verbs a simulated host runs through its chain, and the `cnibpf` command line
//! against its node (install, uninstall, inspect).

use super::*;

impl SimHost {
    pub fn network(&self) -> String {
        format!("net-{}", self.id)
    }

    /// The call log cnibpf's entry names (`logFile`).
    pub fn call_log(&self) -> PathBuf {
        self.work_dir.join(CALL_LOG)
    }

    /// Creates a container namespace and runs the chain's ADD for it.
    pub fn add_container(
        &self,
        name: &str,
        capability_args: Value,
    ) -> Result<Container, ChainError> {
        self.add_container_with_args(name, capability_args, "")
    }

    /// [`Self::add_container`] with `CNI_ARGS` as a runtime sets them.
    pub fn add_container_with_args(
        &self,
        name: &str,
        capability_args: Value,
        cni_args: &str,
    ) -> Result<Container, ChainError> {
        let attachment = Attachment {
            container_id: format!("{}-{name}", self.id),
            ifname: "eth0".to_owned(),
            netns: PathBuf::new(),
            capability_args,
            cni_args: cni_args.to_owned(),
        };
        add_to(
            &self.chain,
            &self.attached,
            &format!("cbt-{}-{name}", self.id),
            attachment,
        )
    }

    /// A second attachment of `container` to this network, by interface `ifname` in the same
    /// subnet (its routes stay on the first: the bridge's IPAM adds none here).
    pub fn add_interface(
        &self,
        container: &Container,
        ifname: &str,
        capability_args: Value,
    ) -> Result<Container, ChainError> {
        let mut conflist = self.chain.conflist().clone();
        conflist["plugins"][0]["ipam"]["routes"] = json!([]);
        let chain = Chain::new(conflist, &cni_path(), &self.host.path());
        let attachment = Attachment {
            container_id: container.attachment.container_id.clone(),
            ifname: ifname.to_owned(),
            netns: container.netns.path(),
            capability_args,
            cni_args: String::new(),
        };
        let result = chain.add(&attachment)?;
        self.chain.remember(&attachment, &result);
        self.attached
            .lock()
            .expect("attached lock")
            .push(attachment.clone());
        let address = |ipv4| {
            container_address(&result, ipv4)
                .unwrap_or_else(|| panic!("no address of each family in result {result}"))
        };
        let (IpAddr::V4(address), IpAddr::V6(address6)) = (address(true), address(false)) else {
            panic!("addresses of the wrong family in {result}");
        };
        Ok(Container {
            netns: Netns::at(&container.netns.path()),
            attachment,
            result,
            address,
            address6,
        })
    }

    /// [`Self::add_container`] that must succeed.
    pub fn container(&self, name: &str, capability_args: Value) -> Container {
        self.add_container(name, capability_args)
            .unwrap_or_else(|error| panic!("ADD of {name} failed: {error}"))
    }

    pub fn del(&self, container: &Container) -> Result<(), ChainError> {
        self.chain.del(&container.attachment)?;
        self.attached
            .lock()
            .expect("attached lock")
            .retain(|attachment| {
                (&attachment.container_id, &attachment.ifname)
                    != (
                        &container.attachment.container_id,
                        &container.attachment.ifname,
                    )
            });
        Ok(())
    }

    /// ADD of cnibpf again for `container` with `keys` replacing keys of its conflist entry
    /// (how an operator changes its filter).
    pub fn readd_with(&self, container: &Container, keys: Value) -> Result<Value, ChainError> {
        self.chain
            .add_again_with(&container.attachment, "cnibpf", &keys)
    }

    pub fn check(&self, container: &Container) -> Result<(), ChainError> {
        self.chain.check(&container.attachment)
    }

    /// The network a cluster had before cnibpf: this host's interface plugin with the
    /// reference portmap after it (containerd's own example configuration has that shape),
    /// written to `10-<network>.conflist` in `conf_dir`; then `cnibpf install --replace-portmap`
    /// chains cnibpf, with this host's keys, into a file of its own there and puts its binary
    /// in `bin_dir`. The primary network, as written.
    pub fn install_over_portmap(&self, conf_dir: &Path, bin_dir: &Path) -> Value {
        let conflist = self.chain.conflist().clone();
        let mut entry = conflist["plugins"][1].clone();
        if let Some(entry) = entry.as_object_mut() {
            entry.remove("type");
        }
        let primary = serde_json::json!({
            "cniVersion": conflist["cniVersion"],
            "name": conflist["name"],
            "plugins": [
                conflist["plugins"][0],
                { "type": "portmap", "snat": true, "capabilities": { "portMappings": true } },
            ],
        });
        std::fs::write(
            conf_dir.join(format!("10-{}.conflist", self.network())),
            serde_json::to_string_pretty(&primary).expect("JSON"),
        )
        .expect("write the primary network");
        let entry_file = self.work_dir.join("entry.json");
        std::fs::write(&entry_file, entry.to_string()).expect("write the entry");
        let installed = self.install(conf_dir, bin_dir, &entry_file, "--replace-portmap");
        assert!(installed.status.success(), "cnibpf install: {installed:?}");
        primary
    }

    /// `cnibpf install` into the node dirs `conf_dir` and `bin_dir` with the entry in
    /// `entry`, and one more flag (`--load`, `--replace-portmap`).
    pub fn install(
        &self,
        conf_dir: &Path,
        bin_dir: &Path,
        entry: &Path,
        flag: &str,
    ) -> std::process::Output {
        self.cnibpf(&[
            "install",
            "--conf-dir",
            &conf_dir.display().to_string(),
            "--bin-dir",
            &bin_dir.display().to_string(),
            "--entry",
            &entry.display().to_string(),
            flag,
        ])
    }

    /// `cnibpf uninstall` of the node dirs `conf_dir` and `bin_dir` while a pod cnibpf set up
    /// runs: it must leave cnibpf's conflist in release-only mode.
    pub fn uninstall_with_pods_running(&self, conf_dir: &Path, bin_dir: &Path) {
        let uninstalled = self.cnibpf(&[
            "uninstall",
            "--conf-dir",
            &conf_dir.display().to_string(),
            "--bin-dir",
            &bin_dir.display().to_string(),
        ]);
        assert!(
            uninstalled.status.success()
                && String::from_utf8_lossy(&uninstalled.stdout).contains("release-only"),
            "cnibpf uninstall: {uninstalled:?}"
        );
    }

    /// Runs `cnibpf` with `args` in the host namespace (for `inspect`).
    pub fn cnibpf(&self, args: &[&str]) -> std::process::Output {
        self.cnibpf_command(args).output().expect("run cnibpf")
    }

    /// `cnibpf` with `args` as an admin command in the host namespace, to spawn (`monitor`).
    pub fn cnibpf_command(&self, args: &[&str]) -> std::process::Command {
        self.cnibpf_command_under(None, args)
    }

    /// [`Self::cnibpf_command`] run by the command line `prefix` (a fault's, a call
    /// counter's; see `faults`).
    pub fn cnibpf_command_under(
        &self,
        prefix: Option<&[String]>,
        args: &[&str],
    ) -> std::process::Command {
        let mut process = match prefix {
            Some(prefix) => crate::faults::wrapped(prefix, &cnibpf_binary()),
            None => std::process::Command::new(cnibpf_binary()),
        };
        process.args(args).env_remove("CNI_COMMAND");
        chain::enter_netns_on_exec(&mut process, &self.host.path());
        process
    }

    /// Invokes cnibpf alone with the given command, environment and raw stdin.
    pub fn invoke_cnibpf(
        &self,
        command: &str,
        attachment: Option<&Attachment>,
        stdin: &str,
    ) -> crate::PluginOutput {
        chain::invoke_plugin(
            &cni_path(),
            &self.host.path(),
            "cnibpf",
            command,
            attachment,
            stdin,
        )
    }
}

/// A container in a new namespace `netns_name`, added through `chain` as `attachment` (its
/// netns filled in), and recorded in `attached` for the DEL of its host's cleanup.
pub(super) fn add_to(
    chain: &Chain,
    attached: &Mutex<Vec<Attachment>>,
    netns_name: &str,
    mut attachment: Attachment,
) -> Result<Container, ChainError> {
    let netns = Netns::create(netns_name);
    attachment.netns = netns.path();
    let result = chain.add(&attachment)?;
    attached
        .lock()
        .expect("attached lock")
        .push(attachment.clone());
    let address = match container_address(&result, true) {
        Some(IpAddr::V4(addr)) => addr,
        _ => panic!("no IPv4 address in result {result}"),
    };
    let address6 = match container_address(&result, false) {
        Some(IpAddr::V6(addr)) => addr,
        _ => panic!("no IPv6 address in result {result}"),
    };
    Ok(Container {
        netns,
        attachment,
        result,
        address,
        address6,
    })
}
