//! Whose the pinned datapath is: the network namespace it was loaded in (its cookie, which
//! `settings` holds for the socket hooks) against the caller's. A datapath's tcx links are on
//! that namespace's interfaces, and its socket hooks serve that namespace's sockets alone; a
//! call from another namespace (a pinPath two hosts share, a simulated host made again, a
//! test rig) that reused it would believe hooked what is not, and serve nothing.
//!
//! While any of its tcx links still attaches an interface, the datapath serves its own
//! namespace, and every call from another that would use or change it is refused, naming both
//! ([`Owner::Other`]); a DEL from there finds none of its attachments. Once none does, every
//! interface it hooked is gone — its namespace went, or left it nothing — and so is every
//! attachment it records (an attachment whose interface is gone is gone): nothing of it is
//! served, and an ADD or `cnibpf load` reclaims it and sets the node up again for its caller
//! ([`Owner::Gone`]), rather than leave the node unable to start pods until someone unloads it.

use std::path::PathBuf;

use aya::maps::{Array, Map, MapData, MapError};
use cnibpf_common::datapath::{Settings, settings};

use super::{hooks::tcx_link_ifindex, pins::map_pinned, unpin::pinned_links};
use crate::{
    backend::{AttachmentRecord, BackendError, Draining},
    netns,
    paths::PinLayout,
};

/// Whose the pinned datapath is, as this call sees it.
#[derive(Debug)]
pub(super) enum Owner {
    /// This call's namespace (or state that does not say: none pinned, or of a build before
    /// the cookie was kept).
    Caller,
    /// Another namespace, which no tcx link of the datapath serves any more.
    Gone { datapath: u64, caller: u64 },
    /// Another namespace, still served.
    Other(OtherNamespace),
}

/// Whose the datapath pinned under `pins` is (see the module): three `bpf()` calls and a
/// socket option when it is the caller's; the links are read only when it is not.
pub(super) fn owner(pins: &PinLayout) -> Result<Owner, BackendError> {
    let Some(datapath) = recorded_cookie(pins)? else {
        return Ok(Owner::Caller);
    };
    let caller = netns::current_cookie().map_err(|source| BackendError::Pin {
        action: "could not read this call's network namespace cookie".to_owned(),
        source: Box::new(source),
    })?;
    if datapath == caller {
        return Ok(Owner::Caller);
    }
    let hooked = hooked_links(pins)?;
    if hooked.is_empty() {
        return Ok(Owner::Gone { datapath, caller });
    }
    Ok(Owner::Other(OtherNamespace {
        path: pins.root().to_owned(),
        datapath,
        caller,
        hooked: describe(&hooked),
    }))
}

/// The cookie of the namespace the datapath was loaded in; `None` where the state does not
/// say (no `settings` map, one of another shape, or a zero cookie).
fn recorded_cookie(pins: &PinLayout) -> Result<Option<u64>, BackendError> {
    let path = pins.map(settings::SETTINGS.name);
    if !map_pinned(pins, &path)? {
        return Ok(None);
    }
    let error = |source: MapError| BackendError::Map {
        action: format!("could not read {}", path.display()),
        source: Box::new(source),
    };
    let data = MapData::from_pin(&path).map_err(error)?;
    let array: Array<MapData, Settings> = match Array::try_from(Map::Array(data)) {
        Ok(array) => array,
        // Another build's settings: this one cannot tell, and leaves it as it always did.
        Err(MapError::InvalidKeySize { .. } | MapError::InvalidValueSize { .. }) => {
            return Ok(None);
        }
        Err(source) => return Err(error(source)),
    };
    let settings = array.get(&0, 0).map_err(error)?;
    Ok((settings.host_netns_cookie != 0).then_some(settings.host_netns_cookie))
}

/// The tcx links of the instance that still attach an interface (the kernel reports one):
/// each pin's name and the interface's index, in the datapath's namespace.
pub(super) fn hooked_links(pins: &PinLayout) -> Result<Vec<(String, u32)>, BackendError> {
    let mut hooked = Vec::new();
    for link in pinned_links(pins)? {
        let name = link
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            // fail-closed: an Option of a listed path's last part, which it always has.
            .unwrap_or_default();
        if !is_tcx_link(&name) {
            continue;
        }
        if let Some(ifindex) = tcx_link_ifindex(&link)? {
            hooked.push((name, ifindex));
        }
    }
    hooked.sort();
    Ok(hooked)
}

/// The interfaces `hooked` links attach, as a message names them: an uplink by its name, an
/// attachment's interface by the attachment's owner id; each once.
fn describe(hooked: &[(String, u32)]) -> String {
    let mut named: Vec<String> = hooked
        .iter()
        .map(|(link, ifindex)| match uplink_of_link(link) {
            Some(uplink) => format!("uplink {uplink}, index {ifindex}"),
            None => {
                // fail-closed: an Option of parsing a pin's name, no kernel result.
                let owner = link
                    .strip_prefix("endpoint-")
                    .and_then(|rest| rest.split('-').next())
                    .unwrap_or(link);
                format!("attachment {owner}'s interface, index {ifindex}")
            }
        })
        .collect();
    named.dedup();
    named.join("; ")
}

/// Whether a link pin (by its file name, see `PinLayout`) is a tcx link's.
fn is_tcx_link(file_name: &str) -> bool {
    file_name.starts_with("uplink-") || file_name.starts_with("endpoint-")
}

/// The uplink an uplink's link pin (by its file name, `PinLayout::uplink_link`) hooks.
pub(super) fn uplink_of_link(file_name: &str) -> Option<String> {
    let hooked = file_name.strip_prefix("uplink-")?;
    hooked
        .strip_suffix("-ingress")
        .or_else(|| hooked.strip_suffix("-egress"))
        .map(str::to_owned)
}

/// A datapath that serves another network namespace, as a call of this one that may change
/// state meets it: it holds none of this namespace's attachments (a DEL finds nothing there),
/// and everything that would list, use or change it — GC, CHECK, `gc`, `unload`, `filter
/// apply`, an ADD served by nftables beside it — is refused with [`Self::error`].
#[derive(Debug)]
pub(super) struct OtherNamespace {
    path: PathBuf,
    datapath: u64,
    caller: u64,
    /// The tcx links that still attach an interface there, for the message.
    hooked: String,
}

impl OtherNamespace {
    /// What a call of this namespace is told: both namespaces, and the hooks of the other.
    pub(super) fn error(&self) -> BackendError {
        BackendError::OtherNamespace {
            path: self.path.clone(),
            datapath: self.datapath,
            caller: self.caller,
            hooked: self.hooked.clone(),
        }
    }
}

impl Draining for OtherNamespace {
    fn backend_name(&self) -> &'static str {
        "ebpf"
    }

    fn refused(&self) -> BackendError {
        self.error()
    }

    /// Its attachments are the other namespace's, not to be listed (and reclaimed) from here.
    fn held(&self) -> Result<Vec<AttachmentRecord>, BackendError> {
        Err(self.error())
    }

    fn holds(&self, _: u64) -> Result<bool, BackendError> {
        Ok(false)
    }

    fn release(&mut self, _: u64) -> Result<(), BackendError> {
        Ok(())
    }

    fn commit_releases(&mut self) -> Result<(), BackendError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_uplinks_name_is_read_back_from_its_link_pins() {
        let pins = PinLayout::new(std::path::Path::new("/sys/fs/bpf/x"));
        for name in ["up0", "eth-0", "en-ingress"] {
            for hook in ["ingress", "egress"] {
                let pin = pins.uplink_link(name, hook);
                let file = pin
                    .file_name()
                    .and_then(|file| file.to_str())
                    .expect("a name");
                assert!(is_tcx_link(file));
                assert_eq!(uplink_of_link(file).as_deref(), Some(name), "{file}");
            }
        }
        let endpoint = pins.endpoint_link(7, "from");
        let file = endpoint
            .file_name()
            .and_then(|file| file.to_str())
            .expect("a name");
        assert!(is_tcx_link(file) && uplink_of_link(file).is_none());
        assert!(!is_tcx_link("cgroup-sock_connect4") && !is_tcx_link("tracepoint-qdisc_created"));
    }

    #[test]
    fn hooked_interfaces_are_named_once_each() {
        let hooked = [
            ("endpoint-00000000000000ab-from".to_owned(), 4),
            ("endpoint-00000000000000ab-to".to_owned(), 4),
            ("uplink-up0-egress".to_owned(), 2),
            ("uplink-up0-ingress".to_owned(), 2),
        ];
        assert_eq!(
            describe(&hooked),
            "attachment 00000000000000ab's interface, index 4; uplink up0, index 2"
        );
    }
}
