//! Choosing a backend, and an attachment moving between them.

use super::*;

#[test]
fn without_bpf_auto_serves_with_nftables_and_a_forced_ebpf_backend_is_104() {
    for errno in [libc::EPERM, libc::ENOSYS] {
        let mut sim = SimHost::new(
            &format!("proto-nobpf{errno}"),
            json!({ "capabilities": { "portMappings": true } }),
        );
        sim.chain.deny_bpf_to_cnibpf(errno);
        let status = |path: &str| {
            let mut status =
                chain::plugin_command(&cni_path(), &sim.host.path(), "cnibpf", "STATUS", None);
            status.env("PATH", path);
            deny_bpf_syscall(&mut status, errno);
            run_with_stdin(
                status,
                "cnibpf",
                "STATUS",
                &cnibpf_config(&sim, "1.1.0", None).to_string(),
            )
        };
        assert_silent_success(&status(&std::env::var("PATH").unwrap_or_default()));
        // Without `nft` either, nothing can work.
        assert_cni_error(
            &status("/nonexistent"),
            50,
            "no backend can work on this host",
        );

        let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
        let _server = TcpServer::start(&c1.netns, Family::V4.any(80), "served by nftables");
        assert_eq!(
            tcp_request(&sim.outside, sim.uplink(Family::V4, 8080)).as_deref(),
            Ok("served by nftables"),
            "auto without BPF: the hostPort works through nftables"
        );
        let inspect = sim.inspect();
        assert_eq!(
            inspect["attachments"][0]["backend"], "nftables",
            "{inspect:#}"
        );
        assert!(!sim.pin_path.exists(), "no eBPF state was made");

        let mut config = cnibpf_config(&sim, "1.0.0", Some(&c1.result));
        config["backend"] = json!("ebpf");
        let mut add = chain::plugin_command(
            &cni_path(),
            &sim.host.path(),
            "cnibpf",
            "ADD",
            Some(&c1.attachment),
        );
        deny_bpf_syscall(&mut add, errno);
        let output = run_with_stdin(add, "cnibpf", "ADD", &config.to_string());
        assert_cni_error(&output, 104, "backend ebpf cannot work on this host");

        sim.del(&c1).unwrap_or_else(|error| panic!("DEL: {error}"));
        assert!(
            !sim.host.exec(&["nft", "list", "tables"]).contains("cnibpf"),
            "DEL of the last attachment removes the table"
        );
    }
}

#[test]
fn an_owner_too_long_for_an_nftables_comment_is_refused() {
    let sim = SimHost::new("proto-long", json!({ "backend": "nftables" }));
    let c1 = sim.container("c1", json!({}));
    let mut long = c1.attachment.clone();
    long.container_id = "x".repeat(120);
    let config = cnibpf_config(&sim, "1.0.0", Some(&c1.result));
    let output = invoke(&sim, "ADD", Some(&long), &config);
    assert_cni_error(&output, 102, "too long for the nftables backend");
    assert!(
        !sim.nft_ruleset().contains(&long.container_id),
        "nothing of the refused attachment is in the table"
    );
}

#[test]
fn a_re_add_on_the_other_backend_moves_the_attachment_and_check_follows_it() {
    let sim = SimHost::new(
        "proto-move",
        json!({ "capabilities": { "portMappings": true } }),
    );
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let c2 = sim.container("c2", port_mappings(&[(8081, 80, "tcp")]));
    sim.readd_with(&c2, json!({ "backend": "nftables" }))
        .unwrap_or_else(|error| panic!("re-ADD on nftables: {error}"));
    let inspect = sim.inspect();
    let backends: Vec<(String, String)> = inspect["attachments"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|attachment| {
            (
                attachment["containerID"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                attachment["backend"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            )
        })
        .collect();
    assert_eq!(
        backends,
        [
            (c1.attachment.container_id.clone(), "ebpf".to_owned()),
            (c2.attachment.container_id.clone(), "nftables".to_owned()),
        ],
        "c2 moved to nftables, listed once: {inspect:#}"
    );
    for (container, port) in [(&c1, 8080), (&c2, 8081)] {
        let _server = TcpServer::start(&container.netns, Family::V4.any(80), "served");
        assert_eq!(
            tcp_request(&sim.outside, sim.uplink(Family::V4, port)).as_deref(),
            Ok("served"),
            "hostPort {port}"
        );
        sim.check(container)
            .unwrap_or_else(|error| panic!("CHECK finds the serving backend: {error}"));
    }
}

#[test]
fn del_cleans_up_what_the_other_backend_made() {
    let sim = SimHost::new(
        "proto-cross",
        json!({ "backend": "nftables", "capabilities": { "portMappings": true } }),
    );
    let c1 = sim.container("c1", port_mappings(&[(8080, 80, "tcp")]));
    let mut config = cnibpf_config(&sim, "1.0.0", None);
    config["backend"] = json!("ebpf");
    let del = invoke(&sim, "DEL", Some(&c1.attachment), &config);
    assert_silent_success(&del);
    assert!(
        !sim.host.exec(&["nft", "list", "tables"]).contains("cnibpf"),
        "a DEL configured for eBPF removes the nftables attachment"
    );
    let ebpf = SimHost::new(
        "proto-cross2",
        json!({ "capabilities": { "portMappings": true } }),
    );
    let c2 = ebpf.container("c2", port_mappings(&[(8080, 80, "tcp")]));
    let mut config = cnibpf_config(&ebpf, "1.0.0", None);
    config["backend"] = json!("nftables");
    assert_silent_success(&invoke(&ebpf, "DEL", Some(&c2.attachment), &config));
    assert!(
        ebpf.holds_no_state(),
        "a DEL configured for nftables removes the eBPF attachment"
    );
}
