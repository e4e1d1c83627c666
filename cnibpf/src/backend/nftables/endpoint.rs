//! Endpoints: set `attachments` (host-side interface, owner in the comment) and set `pods`.

use super::{COMMENT_MAX, Element, NftablesBackend, TABLE, owner_comment};
use crate::{
    backend::{BackendError, Endpoint, Endpoints},
    model::Pod,
};

impl NftablesBackend {
    /// Makes `pod` the one recorded for the attachment on `host_ifname` (in set `pods`, keyed
    /// by that interface, the pod in the comment); `None` removes it.
    fn record_pod(&mut self, host_ifname: &str, pod: Option<&Pod>) {
        let key = vec![host_ifname.to_owned()];
        let current = self
            .elements
            .iter()
            .find(|element| element.set == "pods" && element.key_parts == key)
            .map(|element| element.comment.clone());
        let wanted = pod.map(|pod| {
            let mut text = pod.to_string();
            while text.len() > COMMENT_MAX {
                text.pop();
            }
            text
        });
        if current == wanted {
            return;
        }
        // A table made by an earlier cnibpf has no such set yet.
        self.script
            .push(format!("add set {TABLE} pods {{ type ifname; }}"));
        if current.is_some() {
            self.script.push(format!(
                "delete element {TABLE} pods {{ \"{host_ifname}\" }}"
            ));
            self.elements
                .retain(|element| !(element.set == "pods" && element.key_parts == key));
        }
        if let Some(text) = wanted {
            self.add_element("pods", format!("\"{host_ifname}\""), None, &text);
        }
    }

    pub(super) fn pod_of(&self, host_ifname: &str) -> Option<Pod> {
        let element = self.elements.iter().find(|element| {
            element.set == "pods"
                && element.key_parts.first().map(String::as_str) == Some(host_ifname)
        })?;
        let (namespace, name) = element.comment.split_once('/')?;
        Some(Pod {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
    }
}

impl Endpoints for NftablesBackend {
    fn setup_endpoint(&mut self, endpoint: &Endpoint) -> Result<(), BackendError> {
        let owner = owner_comment(&endpoint.attachment)?;
        self.ensure_table();
        self.record_pod(&endpoint.host.name, endpoint.pod.as_ref());
        let current: Vec<Element> = self
            .elements_of(&owner, &["attachments"])
            .cloned()
            .collect();
        if current
            .iter()
            .any(|element| element.key_parts == [endpoint.host.name.clone()])
        {
            return Ok(());
        }
        for element in &current {
            if let Some(host_ifname) = element.key_parts.first().cloned() {
                self.record_pod(&host_ifname, None);
            }
        }
        self.delete_elements(&owner, &["attachments"]);
        self.add_element(
            "attachments",
            format!("\"{}\"", endpoint.host.name),
            None,
            &owner,
        );
        Ok(())
    }

    fn teardown_endpoint(&mut self, owner: u64) -> Result<(), BackendError> {
        let Some(text) = self.owner_text(owner) else {
            return Ok(());
        };
        let host_ifnames: Vec<String> = self
            .elements_of(&text, &["attachments"])
            .filter_map(|element| element.key_parts.first().cloned())
            .collect();
        for host_ifname in host_ifnames {
            self.record_pod(&host_ifname, None);
        }
        self.delete_elements(&text, &["attachments"]);
        if !self
            .elements
            .iter()
            .any(|element| element.set == "attachments")
        {
            // The last attachment: the whole table goes, as the eBPF backend's pins do.
            self.script.push(format!("delete table {TABLE}"));
            *self = Self {
                script: std::mem::take(&mut self.script),
                forget: std::mem::take(&mut self.forget),
                ..Self::default()
            };
        }
        Ok(())
    }

    fn check_endpoint(&self, endpoint: &Endpoint) -> Result<(), BackendError> {
        let owner = owner_comment(&endpoint.attachment)?;
        if self
            .elements_of(&owner, &["attachments"])
            .any(|element| element.key_parts == [endpoint.host.name.clone()])
        {
            return Ok(());
        }
        Err(BackendError::CheckFailed(format!(
            "{} is not recorded with interface {} in set attachments of table {TABLE}",
            endpoint.attachment, endpoint.host.name
        )))
    }
}
