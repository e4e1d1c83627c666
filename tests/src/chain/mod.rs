//! A CNI chain executor with libcni's semantics: ADD runs the plugins in order passing each
//! result on as `prevResult`; DEL runs them in reverse with the cached result; CHECK passes the
//! cached result to each; GC and STATUS go to every plugin that speaks 1.1.0. Capability
//! arguments reach only plugins that declare the capability, under `runtimeConfig`.

use std::{
    collections::HashMap,
    fmt,
    path::{Path, PathBuf},
    sync::Mutex,
};

use serde_json::{Map, Value, json};

mod process;

use process::set_plugin_environment;

pub use process::{
    deny_bpf_syscall, enter_netns_on_exec, invoke_plugin, plugin_binary, plugin_command,
    plugin_process, run_with_stdin,
};

/// What one plugin invocation printed and how it exited.
#[derive(Clone, Debug)]
pub struct PluginOutput {
    pub plugin: String,
    pub command: String,
    pub exit_code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl PluginOutput {
    /// The CNI error code, when the plugin failed with an error object on stdout.
    pub fn error_code(&self) -> Option<u64> {
        serde_json::from_str::<Value>(&self.stdout)
            .ok()?
            .get("code")?
            .as_u64()
    }

    pub fn error_msg(&self) -> String {
        serde_json::from_str::<Value>(&self.stdout)
            .ok()
            .and_then(|error| error.get("msg").and_then(Value::as_str).map(str::to_owned))
            .unwrap_or_default()
    }
}

/// A plugin of the chain failed.
#[derive(Clone, Debug)]
pub struct ChainError(pub PluginOutput);

impl fmt::Display for ChainError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let output = &self.0;
        write!(
            f,
            "{} {} exited {}: stdout {} stderr {}",
            output.plugin, output.command, output.exit_code, output.stdout, output.stderr
        )
    }
}

impl std::error::Error for ChainError {}

/// One attachment's runtime parameters.
#[derive(Clone, Debug)]
pub struct Attachment {
    pub container_id: String,
    pub ifname: String,
    pub netns: PathBuf,
    /// Capability arguments, e.g. `{"portMappings": [...]}`.
    pub capability_args: Value,
    /// `CNI_ARGS`, as a runtime sets it (e.g. containerd's pod names).
    pub cni_args: String,
}

#[derive(Debug)]
pub struct Chain {
    conflist: Value,
    cni_path: String,
    /// Network namespace the plugins run in (the simulated host).
    host_netns: PathBuf,
    cache: Mutex<HashMap<(String, String), (Value, Value)>>,
    /// When set, cnibpf runs with `bpf(2)` failing with this errno (a host without BPF).
    cnibpf_bpf_errno: Option<i32>,
    /// When set, cnibpf runs under this command line (a fault's or a call counter's, see
    /// `faults`).
    cnibpf_prefix: Mutex<Option<Vec<String>>>,
    /// Variables every plugin runs with besides the CNI ones (a `PATH` choosing the
    /// reference portmap's iptables).
    environment: Mutex<Vec<(String, String)>>,
}

impl Chain {
    pub fn new(conflist: Value, cni_path: &str, host_netns: &Path) -> Self {
        Self {
            conflist,
            cni_path: cni_path.to_owned(),
            host_netns: host_netns.to_owned(),
            cache: Mutex::new(HashMap::new()),
            cnibpf_bpf_errno: None,
            cnibpf_prefix: Mutex::new(None),
            environment: Mutex::new(Vec::new()),
        }
    }

    /// Keeps `result` as the cached result of `attachment` (added by another chain of the same
    /// network), for its CHECK and DEL.
    pub fn remember(&self, attachment: &Attachment, result: &Value) {
        self.cache.lock().expect("cache lock").insert(
            (attachment.container_id.clone(), attachment.ifname.clone()),
            (result.clone(), attachment.capability_args.clone()),
        );
    }

    /// From now on plugins are looked for in `dir` before the other directories of the
    /// search path (a newer release of a reference plugin).
    pub fn search_first(&mut self, dir: &Path) {
        self.cni_path = format!("{}:{}", dir.display(), self.cni_path);
    }

    /// The directories plugins are looked for in, as `CNI_PATH` gives them.
    pub fn cni_path(&self) -> &str {
        &self.cni_path
    }

    /// From now on every plugin runs with `variables` set besides the CNI ones.
    pub fn set_environment(&self, variables: &[(&str, &str)]) {
        *self.environment.lock().expect("environment lock") = variables
            .iter()
            .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
            .collect();
    }

    /// From now on (until set to `None`) cnibpf runs under the command line `prefix` (a
    /// fault's, a call counter's).
    pub fn set_cnibpf_prefix(&self, prefix: Option<Vec<String>>) {
        *self.cnibpf_prefix.lock().expect("prefix lock") = prefix;
    }

    /// One plugin of the chain alone, for an attachment already added: `command` (ADD, CHECK
    /// or DEL) with the cached result as `prevResult`, as libcni would send it that plugin. The
    /// cache is left as it is.
    pub fn run_one(
        &self,
        attachment: &Attachment,
        plugin_type: &str,
        command: &str,
    ) -> PluginOutput {
        let key = (attachment.container_id.clone(), attachment.ifname.clone());
        let (prev, capability_args) = self
            .cache
            .lock()
            .expect("cache lock")
            .get(&key)
            .cloned()
            .unwrap_or_else(|| panic!("{command} of {} before its ADD", attachment.container_id));
        let plugin = self
            .plugins()
            .into_iter()
            .find(|plugin| plugin["type"] == plugin_type)
            .unwrap_or_else(|| panic!("no plugin {plugin_type} in the chain"));
        let config = self.plugin_config(&plugin, &self.version(), Some(&prev), &capability_args);
        self.invoke(&plugin, command, Some(attachment), &config)
    }

    /// GC of one plugin of the chain with the given (containerID, ifname) list.
    pub fn gc_one(&self, plugin_type: &str, valid: &[(&str, &str)]) -> PluginOutput {
        let plugin = self
            .plugins()
            .into_iter()
            .find(|plugin| plugin["type"] == plugin_type)
            .unwrap_or_else(|| panic!("no plugin {plugin_type} in the chain"));
        let mut config = self.plugin_config(&plugin, "1.1.0", None, &Value::Null);
        config["cni.dev/valid-attachments"] = Value::Array(
            valid
                .iter()
                .map(|(container_id, ifname)| json!({ "containerID": container_id, "ifname": ifname }))
                .collect(),
        );
        self.invoke(&plugin, "GC", None, &config)
    }

    /// From now on cnibpf runs as on a host without BPF: `bpf(2)` fails with `errno`.
    pub fn deny_bpf_to_cnibpf(&mut self, errno: i32) {
        self.cnibpf_bpf_errno = Some(errno);
    }

    pub fn conflist(&self) -> &Value {
        &self.conflist
    }

    fn plugins(&self) -> Vec<Value> {
        self.conflist["plugins"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The network configuration one plugin receives (libcni's buildOneConfig).
    pub fn plugin_config(
        &self,
        plugin: &Value,
        version: &str,
        prev_result: Option<&Value>,
        capability_args: &Value,
    ) -> Value {
        let mut config = plugin.as_object().cloned().unwrap_or_default();
        config.insert("cniVersion".to_owned(), json!(version));
        config.insert("name".to_owned(), self.conflist["name"].clone());
        if let Some(prev) = prev_result {
            config.insert("prevResult".to_owned(), prev.clone());
        }
        let mut runtime_config = Map::new();
        if let Some(capabilities) = plugin.get("capabilities").and_then(Value::as_object) {
            for (capability, enabled) in capabilities {
                if enabled.as_bool() == Some(true)
                    && let Some(value) = capability_args.get(capability)
                {
                    runtime_config.insert(capability.clone(), value.clone());
                }
            }
        }
        if !runtime_config.is_empty() {
            config.insert("runtimeConfig".to_owned(), Value::Object(runtime_config));
        }
        Value::Object(config)
    }

    fn version(&self) -> String {
        self.conflist["cniVersion"]
            .as_str()
            .unwrap_or("1.0.0")
            .to_owned()
    }

    pub fn add(&self, attachment: &Attachment) -> Result<Value, ChainError> {
        let mut prev: Option<Value> = None;
        for plugin in self.plugins() {
            let config = self.plugin_config(
                &plugin,
                &self.version(),
                prev.as_ref(),
                &attachment.capability_args,
            );
            let output = self.invoke(&plugin, "ADD", Some(attachment), &config);
            if output.exit_code != 0 {
                return Err(ChainError(output));
            }
            let result: Value = serde_json::from_str(&output.stdout).unwrap_or_else(|error| {
                panic!(
                    "{} ADD printed no JSON result ({error}): {output:?}",
                    plugin["type"]
                )
            });
            prev = Some(result);
        }
        let result = prev.unwrap_or(Value::Null);
        self.cache.lock().expect("cache lock").insert(
            (attachment.container_id.clone(), attachment.ifname.clone()),
            (result.clone(), attachment.capability_args.clone()),
        );
        Ok(result)
    }

    /// ADD of one plugin of the chain again, for an attachment already added, with the cached
    /// result as `prevResult` and `attachment`'s capability arguments: how a runtime repeats an
    /// ADD for a plugin that supports it (the reference bridge does not).
    pub fn add_again(
        &self,
        attachment: &Attachment,
        plugin_type: &str,
    ) -> Result<Value, ChainError> {
        self.add_again_with(attachment, plugin_type, &Value::Null)
    }

    /// [`Self::add_again`] with `overrides` (an object) replacing keys of the plugin's entry:
    /// how an operator changes a plugin's configuration for a running container.
    pub fn add_again_with(
        &self,
        attachment: &Attachment,
        plugin_type: &str,
        overrides: &Value,
    ) -> Result<Value, ChainError> {
        let key = (attachment.container_id.clone(), attachment.ifname.clone());
        let (prev, _) = self
            .cache
            .lock()
            .expect("cache lock")
            .get(&key)
            .cloned()
            .unwrap_or_else(|| {
                panic!(
                    "ADD again of {} before its first ADD",
                    attachment.container_id
                )
            });
        let mut plugin = self
            .plugins()
            .into_iter()
            .find(|plugin| plugin["type"] == plugin_type)
            .unwrap_or_else(|| panic!("no plugin {plugin_type} in the chain"));
        if let (Some(entry), Some(overrides)) = (plugin.as_object_mut(), overrides.as_object()) {
            entry.extend(overrides.clone());
        }
        let config = self.plugin_config(
            &plugin,
            &self.version(),
            Some(&prev),
            &attachment.capability_args,
        );
        let output = self.invoke(&plugin, "ADD", Some(attachment), &config);
        if output.exit_code != 0 {
            return Err(ChainError(output));
        }
        let result: Value = serde_json::from_str(&output.stdout).unwrap_or_else(|error| {
            panic!("{plugin_type} ADD printed no JSON result ({error}): {output:?}")
        });
        self.cache
            .lock()
            .expect("cache lock")
            .insert(key, (result.clone(), attachment.capability_args.clone()));
        Ok(result)
    }

    pub fn del(&self, attachment: &Attachment) -> Result<(), ChainError> {
        let cached = self
            .cache
            .lock()
            .expect("cache lock")
            .get(&(attachment.container_id.clone(), attachment.ifname.clone()))
            .cloned();
        let (prev, capability_args) = match cached {
            Some((prev, args)) => (Some(prev), args),
            None => (None, attachment.capability_args.clone()),
        };
        let mut first_error = None;
        for plugin in self.plugins().iter().rev() {
            let config =
                self.plugin_config(plugin, &self.version(), prev.as_ref(), &capability_args);
            let output = self.invoke(plugin, "DEL", Some(attachment), &config);
            if output.exit_code != 0 && first_error.is_none() {
                first_error = Some(ChainError(output));
            }
        }
        if let Some(error) = first_error {
            return Err(error);
        }
        self.cache
            .lock()
            .expect("cache lock")
            .remove(&(attachment.container_id.clone(), attachment.ifname.clone()));
        Ok(())
    }

    pub fn check(&self, attachment: &Attachment) -> Result<(), ChainError> {
        let (prev, capability_args) = self
            .cache
            .lock()
            .expect("cache lock")
            .get(&(attachment.container_id.clone(), attachment.ifname.clone()))
            .cloned()
            .unwrap_or_else(|| panic!("CHECK of {} before its ADD", attachment.container_id));
        for plugin in self.plugins() {
            let config =
                self.plugin_config(&plugin, &self.version(), Some(&prev), &capability_args);
            let output = self.invoke(&plugin, "CHECK", Some(attachment), &config);
            if output.exit_code != 0 {
                return Err(ChainError(output));
            }
        }
        Ok(())
    }

    /// GC with the given (containerID, ifname) list, sent to every plugin that supports 1.1.0.
    pub fn gc(&self, valid: &[(&str, &str)]) -> Result<(), ChainError> {
        let list: Vec<Value> = valid
            .iter()
            .map(|(container_id, ifname)| json!({ "containerID": container_id, "ifname": ifname }))
            .collect();
        for plugin in self.plugins() {
            if !self.supports(&plugin, "1.1.0") {
                continue;
            }
            let mut config = self.plugin_config(&plugin, "1.1.0", None, &Value::Null);
            config["cni.dev/valid-attachments"] = Value::Array(list.clone());
            let output = self.invoke(&plugin, "GC", None, &config);
            if output.exit_code != 0 {
                return Err(ChainError(output));
            }
        }
        Ok(())
    }

    /// STATUS of every plugin that supports 1.1.0.
    pub fn status(&self) -> Result<(), ChainError> {
        for plugin in self.plugins() {
            if !self.supports(&plugin, "1.1.0") {
                continue;
            }
            let config = self.plugin_config(&plugin, "1.1.0", None, &Value::Null);
            let output = self.invoke(&plugin, "STATUS", None, &config);
            if output.exit_code != 0 {
                return Err(ChainError(output));
            }
        }
        Ok(())
    }

    fn supports(&self, plugin: &Value, version: &str) -> bool {
        let output = self.invoke(plugin, "VERSION", None, &json!({ "cniVersion": version }));
        serde_json::from_str::<Value>(&output.stdout)
            .ok()
            .and_then(|answer| answer.get("supportedVersions").cloned())
            .and_then(|versions| versions.as_array().cloned())
            .is_some_and(|versions| versions.iter().any(|v| v.as_str() == Some(version)))
    }

    /// Runs one plugin binary, found in CNI_PATH, inside the host namespace.
    pub fn invoke(
        &self,
        plugin: &Value,
        command: &str,
        attachment: Option<&Attachment>,
        config: &Value,
    ) -> PluginOutput {
        let plugin_type = plugin["type"]
            .as_str()
            .expect("plugin has a type")
            .to_owned();
        let prefix = self
            .cnibpf_prefix
            .lock()
            .expect("prefix lock")
            .clone()
            .filter(|_| plugin_type == "cnibpf");
        let mut process = match prefix {
            Some(prefix) => {
                let binary = plugin_binary(&self.cni_path, &plugin_type);
                let mut process = crate::faults::wrapped(&prefix, &binary);
                set_plugin_environment(&mut process, &self.cni_path, command, attachment);
                enter_netns_on_exec(&mut process, &self.host_netns);
                process
            }
            None => plugin_command(
                &self.cni_path,
                &self.host_netns,
                &plugin_type,
                command,
                attachment,
            ),
        };
        if let Some(errno) = self.cnibpf_bpf_errno.filter(|_| plugin_type == "cnibpf") {
            deny_bpf_syscall(&mut process, errno);
        }
        process.envs(
            self.environment
                .lock()
                .expect("environment lock")
                .iter()
                .map(|(name, value)| (name, value)),
        );
        run_with_stdin(process, &plugin_type, command, &config.to_string())
    }
}
