//! The eBPF object the plugin embeds carries BTF, so bpftool shows named fields.

use std::path::Path;

use cnibpf_tests::netns::run_checked;

#[test]
fn the_object_describes_every_map_type_with_named_fields() {
    let object =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bpfel-unknown-none/release/cnibpf");
    assert!(
        object.exists(),
        "{} missing: cargo xtask build-ebpf",
        object.display()
    );
    let output = run_checked(
        std::process::Command::new("bpftool")
            .args(["btf", "dump", "file"])
            .arg(&object)
            .args(["format", "raw"]),
    );
    let btf = String::from_utf8_lossy(&output.stdout);
    for (structure, fields) in [
        (
            "PortMapKey",
            &["host_addr", "host_port", "protocol", "family"][..],
        ),
        (
            "PortMapValue",
            &["container_addr", "owner", "container_port"][..],
        ),
        (
            "ConnectionKey",
            &[
                "container_addr",
                "remote_addr",
                "container_port",
                "remote_port",
            ][..],
        ),
        (
            "Connection",
            &[
                "owner",
                "last_seen_ns",
                "nat_addr",
                "orig_addr",
                "orig_port",
                "parts",
            ][..],
        ),
        (
            "OwnerInfo",
            &[
                "network",
                "container_id",
                "ifname",
                "host_ifname",
                "host_ifindex",
            ][..],
        ),
        ("LayoutInfo", &["magic", "version", "object_id"][..]),
    ] {
        let start = btf
            .find(&format!("STRUCT '{structure}'"))
            .unwrap_or_else(|| panic!("no BTF for {structure}"));
        let body: String = btf[start..]
            .lines()
            .skip(1)
            .take_while(|line| line.starts_with('\t'))
            .collect();
        for field in fields {
            assert!(
                body.contains(&format!("'{field}'")),
                "{structure} lacks field {field} in BTF: {body}"
            );
        }
    }
    for program in [
        "uplink_ingress",
        "uplink_egress",
        "from_container",
        "to_container",
    ] {
        assert!(
            btf.contains(&format!("FUNC '{program}'")),
            "no BTF function for {program}"
        );
    }
}
