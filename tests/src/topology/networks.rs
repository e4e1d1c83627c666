//! More CNI networks on a simulated host, each with its own name, bridge (or a bridge another
//! network has) and address ranges, and cnibpf chained after it on the host's instance: one
//! cnibpf serves every network of a node, which a filter rule's `srcNetwork` and `dstNetwork`
//! name.

use super::*;

/// A CNI network of a simulated host besides its own (see [`SimHost::add_network`]). Its
/// containers are DELed when it goes, before the host.
#[derive(Debug)]
pub struct Network<'a> {
    sim: &'a SimHost,
    pub name: String,
    pub chain: Chain,
    attached: Mutex<Vec<Attachment>>,
}

impl SimHost {
    /// Network `name` on bridge `bridge` with IPAM `ranges` (host-local's, one list per
    /// family), the bridge plugin and cnibpf chained after it as the host's own network has
    /// them, cnibpf's entry with `cnibpf_keys` besides the host's.
    pub fn add_network(
        &self,
        name: &str,
        bridge: &str,
        ranges: Value,
        cnibpf_keys: Value,
    ) -> Network<'_> {
        let mut conflist = self.chain.conflist().clone();
        conflist["name"] = json!(name);
        let plugins = conflist["plugins"]
            .as_array_mut()
            .expect("a conflist has plugins");
        plugins[0]["bridge"] = json!(bridge);
        plugins[0]["ipam"]["ranges"] = ranges;
        plugins[0]["ipam"]["dataDir"] = json!(self.work_dir.join(format!("ipam-{name}")));
        for plugin in plugins.iter_mut().skip(1) {
            if plugin["type"] == "cnibpf" {
                merge(plugin, &cnibpf_keys);
            }
        }
        Network {
            sim: self,
            name: name.to_owned(),
            chain: Chain::new(conflist, &cni_path(), &self.host.path()),
            attached: Mutex::new(Vec::new()),
        }
    }
}

impl Network<'_> {
    pub fn add_container(
        &self,
        name: &str,
        capability_args: Value,
    ) -> Result<Container, ChainError> {
        let attachment = Attachment {
            container_id: format!("{}-{}-{name}", self.sim.id, self.name),
            ifname: "eth0".to_owned(),
            netns: PathBuf::new(),
            capability_args,
            cni_args: String::new(),
        };
        verbs::add_to(
            &self.chain,
            &self.attached,
            &format!("cbt-{}-{}-{name}", self.sim.id, self.name),
            attachment,
        )
    }

    /// [`Self::add_container`] that must succeed.
    pub fn container(&self, name: &str, capability_args: Value) -> Container {
        self.add_container(name, capability_args)
            .unwrap_or_else(|error| panic!("ADD of {name} to {} failed: {error}", self.name))
    }

    pub fn del(&self, container: &Container) -> Result<(), ChainError> {
        self.chain.del(&container.attachment)?;
        self.attached
            .lock()
            .expect("attached lock")
            .retain(|attachment| attachment.container_id != container.attachment.container_id);
        Ok(())
    }
}

impl Drop for Network<'_> {
    fn drop(&mut self) {
        del_attached(&self.chain, &self.attached);
    }
}
