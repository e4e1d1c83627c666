//! The node's state refused with its error code: a lock held too long, a missing uplink,
//! pins of a newer layout or of something else, a pin path outside bpffs, inspect without
//! root.

use super::*;

#[test]
fn lock_held_too_long_is_error_11() {
    let sim = SimHost::new("proto-lock", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let lock_path = sim.lock_file();
    let lock = File::open(&lock_path)
        .unwrap_or_else(|error| panic!("open {}: {error}", lock_path.display()));
    let lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
        .unwrap_or_else(|(_, error)| panic!("take the lock: {error}"));

    let mut add = chain::plugin_command(
        &cni_path(),
        &sim.host.path(),
        "cnibpf",
        "ADD",
        Some(&c1.attachment),
    );
    add.env("CNIBPF_LOCK_TIMEOUT_MS", "300");
    let config = cnibpf_config(&sim, "1.0.0", Some(&c1.result));
    let output = run_with_stdin(add, "cnibpf", "ADD", &config.to_string());
    assert_cni_error(&output, 11, "timed out after 300ms waiting for lock");

    drop(lock);
    let output = invoke(&sim, "ADD", Some(&c1.attachment), &config);
    assert_eq!(
        output.exit_code, 0,
        "with the lock free the same ADD works: {output:?}"
    );
}

#[test]
fn an_uplink_that_does_not_exist_is_error_103() {
    let sim = SimHost::new("proto-uplink", json!({ "uplinks": ["nosuch0"] }));
    let error = sim
        .add_container("c1", port_mappings(&[(8080, 80, "tcp")]))
        .expect_err("an unknown uplink must fail the ADD");
    assert_cni_error(&error.0, 103, "no interface named \"nosuch0\"");
    assert!(!sim.pin_path.exists());
    assert!(sim.tcx_programs(UPLINK).is_empty());
}

/// Creates a `layout` map under the host's pinPath holding `magic` and `version`, as another
/// build (or another program) could have left it.
fn pin_layout(sim: &SimHost, magic: [u8; 8], version: u32) {
    std::fs::create_dir_all(&sim.pin_path).expect("pin dir");
    let layout = sim.pin_path.join("layout");
    let layout = layout.to_str().expect("utf-8 path");
    cnibpf_tests::netns::run_checked(std::process::Command::new("bpftool").args([
        "map", "create", layout, "type", "array", "key", "4", "value", "24", "entries", "1",
        "name", "layout",
    ]));
    // magic, layout version, padding, object id.
    let mut value = magic.to_vec();
    value.extend(version.to_le_bytes());
    value.extend([0; 12]);
    sim.write_layout(&value);
}

#[test]
fn pinned_state_of_a_newer_layout_is_error_106_for_add_only() {
    let sim = SimHost::new("proto-layout", json!({}));
    pin_layout(&sim, *b"cnibpf\0\0", 99);
    let error = sim
        .add_container("c1", port_mappings(&[(8080, 80, "tcp")]))
        .expect_err("a newer layout must be refused");
    assert_cni_error(
        &error.0,
        106,
        "has layout v99, written by a newer cnibpf (this one writes v",
    );
    assert!(
        !error.0.error_msg().contains("delete"),
        "no advice to delete state pods use: {error}"
    );
    assert!(
        sim.tcx_programs(UPLINK).is_empty(),
        "nothing may be attached over state of another layout"
    );
    assert_del_of_what_it_never_held_succeeds(&sim);
}

/// State of a layout before the supported window (layout 9, as a 0.4 release pinned it): ADD
/// is refused with the release to pass through; DEL still answers.
#[test]
fn pinned_state_of_a_layout_before_the_window_is_error_106_naming_the_release_between() {
    let sim = SimHost::new("proto-older", json!({}));
    pin_layout(&sim, *b"cnibpf\0\0", 9);
    let error = sim
        .add_container("c1", port_mappings(&[(8080, 80, "tcp")]))
        .expect_err("a layout before the window must be refused");
    assert_cni_error(&error.0, 106, "has layout v9, older than this cnibpf's");
    assert!(
        error
            .0
            .error_msg()
            .contains("upgrade through 0.5.1 (7d1bccd) first"),
        "names the release to pass through: {error}"
    );
    assert!(sim.tcx_programs(UPLINK).is_empty(), "nothing attached");
    assert_del_of_what_it_never_held_succeeds(&sim);
}

/// A DEL of something the state never held answers success, as a runtime retrying it needs.
fn assert_del_of_what_it_never_held_succeeds(sim: &SimHost) {
    let never = Attachment {
        container_id: "never-added".to_owned(),
        ifname: "eth0".to_owned(),
        netns: sim.host.path(),
        capability_args: Value::Null,
        cni_args: String::new(),
    };
    let config = cnibpf_config(sim, "1.0.0", None);
    assert_silent_success(&invoke(sim, "DEL", Some(&never), &config));
}

#[test]
fn a_pin_path_holding_something_else_is_error_106_naming_it() {
    let sim = SimHost::new("proto-foreign", json!({}));
    pin_layout(&sim, *b"someone!", 1);
    let error = sim
        .add_container("c1", port_mappings(&[(8080, 80, "tcp")]))
        .expect_err("foreign state must be refused");
    assert_cni_error(&error.0, 106, "holds no cnibpf state");
    assert!(
        error.0.error_msg().contains("choose another pinPath"),
        "{error}"
    );
    assert!(
        sim.pin_path.join("layout").exists(),
        "foreign state is left alone"
    );
}

#[test]
fn inspect_without_root_names_the_missing_privilege() {
    let sim = SimHost::new("proto-noroot", json!({}));
    let _c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let output = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(cnibpf_tests::topology::cnibpf_binary())
        .args(["inspect", "--pin-path", &sim.pin_path.display().to_string()])
        .output()
        .expect("run cnibpf inspect as nobody");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{output:?}");
    assert!(
        stderr.contains("permission denied: run as root"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("delete"),
        "no advice to delete state pods use: {stderr}"
    );
}

#[test]
fn a_pin_path_outside_bpffs_is_error_102() {
    let dir = std::env::temp_dir().join("cnibpf-test-not-bpffs");
    let _ = std::fs::remove_dir_all(&dir);
    let sim = SimHost::new("proto-notbpffs", json!({ "pinPath": dir }));
    let error = sim
        .add_container("c1", port_mappings(&[(8080, 80, "tcp")]))
        .expect_err("a pinPath on tmpfs cannot hold pins");
    assert_cni_error(&error.0, 102, "could not prepare bpffs directory");
    assert!(!dir.exists(), "a wrong pinPath must not be created");
    let inspect = sim.cnibpf(&[
        "inspect",
        "--json",
        "--pin-path",
        &dir.display().to_string(),
    ]);
    let inspect: Value = serde_json::from_slice(&inspect.stdout).expect("inspect prints JSON");
    for file in ["lockFile", "callStatsFile"] {
        if let Some(path) = inspect[file].as_str() {
            let _ = std::fs::remove_file(path);
        }
    }
    assert!(sim.tcx_programs(UPLINK).is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Records `version` for the map `name` in `map_versions`, and names another build's programs
/// in the stamp: the state another build of this layout family left, with that map at
/// `version`.
fn pin_map_version(sim: &SimHost, name: &str, version: u32) {
    let mut key = [0u8; 32];
    key[..name.len()].copy_from_slice(name.as_bytes());
    let mut command = std::process::Command::new("bpftool");
    command
        .args(["map", "update", "pinned"])
        .arg(sim.pin_path.join("map_versions"))
        .arg("key")
        .args(key.iter().map(u8::to_string))
        .arg("value")
        .args(version.to_le_bytes().iter().map(u8::to_string));
    cnibpf_tests::netns::run_checked(&mut command);
    let mut stamp = sim.layout_bytes();
    stamp[16..24].copy_from_slice(&1u64.to_le_bytes());
    sim.write_layout(&stamp);
}

/// A map a newer cnibpf left at a version of its types this build does not have (a rollback),
/// or at one older than any it migrates, is refused as another layout is: ADD 106 naming the
/// map and both versions, the running pod served on, its DEL releasing it and taking the state
/// with it, after which this build starts afresh.
#[test]
fn a_map_of_a_version_this_build_neither_writes_nor_migrates_drains_as_a_layout() {
    let sim = SimHost::new("proto-mapver", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let _server = TcpServer::start(&c1.netns, Family::V4.any(80), "served");
    for (refused, version, said) in [
        (
            "c2",
            2,
            "has map portmap at version 2, written by a newer cnibpf (this one writes version 1)",
        ),
        (
            "c3",
            0,
            "has map portmap at version 0, older than this cnibpf's version 1 and than the releases it upgrades from",
        ),
    ] {
        pin_map_version(&sim, "portmap", version);
        let error = sim
            .add_container(refused, port_mappings(&[(8081, 80, "tcp")]))
            .expect_err("a map of another version must be refused");
        assert_cni_error(&error.0, 106, said);
        assert_eq!(
            tcp_request(&sim.outside, sim.uplink(Family::V4, 8080)).as_deref(),
            Ok("served"),
            "version {version}: the running pod's hostPort is still served"
        );
    }
    sim.del(&c1)
        .unwrap_or_else(|error| panic!("the running pod's DEL: {error}"));
    assert!(!sim.pin_path.exists(), "the last DEL removed the state");
    let c4 = sim.container("c4", port_mappings(&[(8081, 80, "tcp")]));
    let _server = TcpServer::start(&c4.netns, Family::V4.any(80), "afresh");
    assert_eq!(
        tcp_request(&sim.outside, sim.uplink(Family::V4, 8081)).as_deref(),
        Ok("afresh"),
        "this build's own state, made afresh"
    );
}
