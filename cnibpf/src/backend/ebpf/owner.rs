//! `owners` entries: an attachment's identity, host interface and pod as fixed-size fields.

use cnibpf_common::endpoints::{
    OwnerInfo,
    owners::{IFNAME_LEN, NAME_LEN},
};

use crate::{
    model::{Attachment, Pod},
    netlink::Link,
};

/// The `owners` entry of `attachment` on host interface `host`.
pub fn owner_info(attachment: &Attachment, host: &Link, pod: Option<&Pod>) -> OwnerInfo {
    let mut info = OwnerInfo::default();
    copy_name(&mut info.network, &attachment.network);
    copy_name(&mut info.container_id, &attachment.container_id);
    copy_name(&mut info.ifname, &attachment.ifname);
    copy_name(&mut info.host_ifname, &host.name);
    info.host_ifindex = host.index;
    if let Some(pod) = pod {
        copy_name(&mut info.pod_namespace, &pod.namespace);
        copy_name(&mut info.pod_name, &pod.name);
    }
    info
}

/// The attachment an `owners` entry names.
pub fn attachment_of(info: &OwnerInfo) -> Attachment {
    Attachment {
        network: read_name(&info.network),
        container_id: read_name(&info.container_id),
        ifname: read_name(&info.ifname),
    }
}

/// The pod an `owners` entry names, if any.
pub fn pod_of(info: &OwnerInfo) -> Option<Pod> {
    let namespace = read_name(&info.pod_namespace);
    let name = read_name(&info.pod_name);
    (!namespace.is_empty() && !name.is_empty()).then_some(Pod { namespace, name })
}

/// Copies a name into a zero-padded field. Names are validated shorter than the field, so the
/// last byte always stays zero and the field always reads back as the same name.
fn copy_name<const N: usize>(field: &mut [u8; N], name: &str) {
    let length = name.len().min(N - 1);
    field[..length].copy_from_slice(&name.as_bytes()[..length]);
}

/// A zero-padded name field as text.
pub fn read_name(field: &[u8]) -> String {
    let end = field
        .iter()
        .position(|byte| *byte == 0)
        // fail-closed: no terminating zero, the name fills the field.
        .unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end]).into_owned()
}

const _: () = assert!(NAME_LEN > 64 && IFNAME_LEN == 16);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_info_round_trips_names_and_the_pod() {
        let a = Attachment::new("mynet", "0123456789abcdef", "eth0");
        let host = Link {
            index: 7,
            name: "veth1234".to_owned(),
            kind: Some("veth".to_owned()),
            peer_index: None,
            master: None,
            mac: None,
        };
        let pod = Pod {
            namespace: "default".to_owned(),
            name: "web-0".to_owned(),
        };
        let info = owner_info(&a, &host, Some(&pod));
        assert_eq!(attachment_of(&info), a);
        assert_eq!(read_name(&info.host_ifname), "veth1234");
        assert_eq!(pod_of(&info), Some(pod));
        assert_eq!(pod_of(&owner_info(&a, &host, None)), None);
    }
}
