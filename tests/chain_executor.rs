//! The chain executor itself behaves like libcni, so the other tests mean what they say.

use cnibpf_tests::{
    SimHost,
    topology::{BRIDGE, port_mappings},
};
use serde_json::{Value, json};

#[test]
fn capability_arguments_reach_only_plugins_that_declare_them() {
    let sim = SimHost::new("chain-caps", json!({}));
    let plugins = sim.chain.conflist()["plugins"]
        .as_array()
        .expect("plugins")
        .clone();
    let args = json!({ "portMappings": [{ "hostPort": 1, "containerPort": 2 }], "bandwidth": {} });
    let prev = json!({ "cniVersion": "1.0.0" });

    let bridge = sim.chain.plugin_config(&plugins[0], "1.0.0", None, &args);
    assert!(
        bridge.get("runtimeConfig").is_none(),
        "bridge declares no capability: {bridge}"
    );
    assert!(bridge.get("prevResult").is_none());
    assert_eq!(bridge["name"], sim.network());
    assert_eq!(bridge["cniVersion"], "1.0.0");

    let cnibpf = sim
        .chain
        .plugin_config(&plugins[1], "1.0.0", Some(&prev), &args);
    assert_eq!(
        cnibpf["runtimeConfig"],
        json!({ "portMappings": args["portMappings"] })
    );
    assert_eq!(cnibpf["prevResult"], prev);
}

#[test]
fn add_passes_results_down_and_del_undoes_every_plugin() {
    let sim = SimHost::new("chain-order", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let interfaces = c1.result["interfaces"].as_array().expect("interfaces");
    assert_eq!(
        interfaces[0]["name"], BRIDGE,
        "the bridge's result reached the end of the chain"
    );
    assert_eq!(
        interfaces[2]["sandbox"],
        Value::String(c1.netns.path().display().to_string())
    );
    let host_if = sim.host_interface(&c1);
    let ipam_file = sim
        .work_dir
        .join("ipam")
        .join(sim.network())
        .join(c1.address.to_string());
    assert!(ipam_file.exists(), "host-local reserved {}", c1.address);

    sim.check(&c1)
        .unwrap_or_else(|error| panic!("CHECK: {error}"));
    sim.del(&c1).unwrap_or_else(|error| panic!("DEL: {error}"));
    assert!(
        !ipam_file.exists(),
        "DEL reached host-local (after cnibpf, in reverse order)"
    );
    let links = sim.host.exec(&["ip", "-o", "link", "show"]);
    assert!(
        !links.contains(&host_if),
        "DEL reached bridge: {host_if} is gone"
    );
    assert!(sim.installed_host_ports().is_empty(), "DEL reached cnibpf");
}

#[test]
fn gc_goes_only_to_plugins_that_speak_1_1_0() {
    let sim = SimHost::new("chain-gc", json!({}));
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    // The reference bridge (CNI 1.0.0) would reject a GC; the executor must skip it.
    sim.chain
        .gc(&[])
        .unwrap_or_else(|error| panic!("GC: {error}"));
    assert!(
        sim.installed_host_ports().is_empty(),
        "cnibpf collected {}",
        c1.attachment.container_id
    );
    sim.chain
        .status()
        .unwrap_or_else(|error| panic!("STATUS: {error}"));
}
