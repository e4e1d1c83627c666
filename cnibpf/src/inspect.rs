//! `cnibpf inspect`: the state of an instance, for people (a table) or scripts (`--json`).

use std::{io::Write as _, path::Path};

use serde_json::json;

use crate::{
    backend::{self, BackendError, ebpf::describe_mapping},
    paths::PinLayout,
};

pub fn run(pin_path: &Path, as_json: bool) -> Result<(), BackendError> {
    let pins = PinLayout::new(pin_path);
    let mut attachments = Vec::new();
    for backend in backend::existing(&pins)? {
        let mappings = backend.port_mappings()?;
        for record in backend.attachments()? {
            let mut own: Vec<_> = mappings
                .iter()
                .filter(|(owner, _)| *owner == record.owner)
                .map(|(_, mapping)| *mapping)
                .collect();
            own.sort_by_key(|mapping| (mapping.protocol, mapping.host_port, mapping.host_addr));
            attachments.push((backend.name(), record, own));
        }
    }
    attachments.sort_by(|a, b| {
        (
            &a.1.attachment.network,
            &a.1.attachment.container_id,
            &a.1.attachment.ifname,
        )
            .cmp(&(
                &b.1.attachment.network,
                &b.1.attachment.container_id,
                &b.1.attachment.ifname,
            ))
    });
    let mut out = std::io::stdout().lock();
    if as_json {
        let list: Vec<_> = attachments
            .iter()
            .map(|(backend, record, mappings)| {
                json!({
                    "network": record.attachment.network,
                    "containerID": record.attachment.container_id,
                    "ifname": record.attachment.ifname,
                    "owner": format!("{:016x}", record.owner),
                    "backend": backend,
                    "hostInterface": record.host_ifname,
                    "hostIfindex": record.host_ifindex,
                    "portMappings": mappings.iter().map(|mapping| json!({
                        "protocol": mapping.protocol.name(),
                        "hostIP": mapping.host_addr.map(|addr| addr.to_string()),
                        "hostPort": mapping.host_port,
                        "containerIP": mapping.container_addr.to_string(),
                        "containerPort": mapping.container_port,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        let document =
            json!({ "pinPath": pin_path, "lockFile": pins.lock_file(), "attachments": list });
        let _ = writeln!(out, "{document:#}");
        return Ok(());
    }
    if attachments.is_empty() {
        let _ = writeln!(out, "no attachments under {}", pin_path.display());
        return Ok(());
    }
    let _ = writeln!(
        out,
        "{:<16} {:<20} {:<8} {:<16} {:<7} {:<16}",
        "NETWORK", "CONTAINER", "IFNAME", "HOST-IF", "BACKEND", "OWNER"
    );
    for (backend, record, mappings) in &attachments {
        let container: String = record.attachment.container_id.chars().take(20).collect();
        let _ = writeln!(
            out,
            "{:<16} {:<20} {:<8} {:<16} {:<7} {:016x}",
            record.attachment.network,
            container,
            record.attachment.ifname,
            record.host_ifname,
            backend,
            record.owner
        );
        for mapping in mappings {
            let _ = writeln!(out, "    portmap {}", describe_mapping(mapping));
        }
    }
    Ok(())
}
