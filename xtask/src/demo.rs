//! `cargo xtask demo`: a simulated host, one container wired by a conflist with cnibpf chained
//! after bridge + host-local, and real traffic through its hostPort, out through the
//! masquerade, and against its filter.

use std::{
    io::Read as _,
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use cnibpf_tests::{
    SimHost,
    topology::{Family, OUTSIDE_ADDR, port_mappings},
    traffic::{TcpServer, tcp_request},
};
use serde_json::json;

fn section(started: Instant, title: &str) {
    println!(
        "\n\x1b[1m[{:5.2}s] {title}\x1b[0m",
        started.elapsed().as_secs_f64()
    );
}

pub fn run() -> Result<()> {
    let started = Instant::now();
    section(
        started,
        "simulated host: netns cbt-demo-host (uplink up0 203.0.113.1) <-> cbt-demo-out (203.0.113.2)",
    );
    let sim = SimHost::new(
        "demo",
        json!({
            "ipMasq": true,
            "filter": [
                { "index": 10, "direction": "ingress", "proto": "tcp", "dport": 81, "target": "DROP" },
            ],
            "filterDefault": "ALLOW",
        }),
    );
    println!("conflist:\n{:#}", sim.chain.conflist());

    section(
        started,
        "ADD container \"web\" with portMappings [8080 -> 80/tcp, 8081 -> 81/tcp]",
    );
    let web = sim
        .add_container(
            "web",
            port_mappings(&[(8080, 80, "tcp"), (8081, 81, "tcp")]),
        )
        .map_err(|error| anyhow::anyhow!("ADD failed: {error}"))?;
    println!(
        "container address {}; result:\n{:#}",
        web.address, web.result
    );
    let server = TcpServer::start(&web.netns, web.socket(80), "hello from the web container\n");

    section(
        started,
        "outside client -> 203.0.113.1:8080 (the hostPort on the uplink)",
    );
    let answer = tcp_request(&sim.outside, sim.uplink_target(8080))
        .map_err(|error| anyhow::anyhow!("request through the hostPort failed: {error}"))?;
    print!("answer: {answer}");
    let peers = server.peers();
    println!("the container saw the connection from {peers:?}");
    ensure!(
        peers
            .iter()
            .any(|peer| peer.ip() == std::net::IpAddr::V4(OUTSIDE_ADDR)),
        "the container should see the client's own address"
    );

    section(
        started,
        "masquerade: the container -> a server in the outside netns, which has no route back",
    );
    for family in Family::BOTH {
        let outside_server =
            TcpServer::start(&sim.outside, family.any(9090), "hello from outside\n");
        let target = std::net::SocketAddr::new(family.outside(), 9090);
        let answer = tcp_request(&web.netns, target)
            .map_err(|error| anyhow::anyhow!("container -> {target} failed: {error}"))?;
        let peers = outside_server.peers();
        print!("{target}: {answer}");
        println!("  the outside server saw the connection from {peers:?} (the uplink's address)");
        ensure!(
            peers
                .iter()
                .all(|peer| peer.ip() == sim.uplink(family, 0).ip()),
            "the outside should see the uplink's address"
        );
    }

    section(
        started,
        "a host process -> 127.0.0.1:8080 and [::1]:8080 (socket hooks, no route_localnet)",
    );
    let _server6 = TcpServer::start(
        &web.netns,
        web.at(Family::V6, 80),
        "hello from the web container over IPv6\n",
    );
    for target in ["127.0.0.1:8080", "[::1]:8080"] {
        let target = target.parse().context("literal address")?;
        let (answer, peer) = sim
            .host_client("tcp", target)
            .map_err(|error| anyhow::anyhow!("host process -> {target}: {error}"))?;
        print!("{target}: {answer}");
        println!("  (getpeername says {peer})");
    }

    section(
        started,
        "hairpin: the container itself -> 203.0.113.1:8080 (no br_netfilter)",
    );
    let answer = tcp_request(&web.netns, sim.uplink_target(8080))
        .map_err(|error| anyhow::anyhow!("hairpin request failed: {error}"))?;
    print!("answer: {answer}");

    section(
        started,
        "filter: rule 10 drops TCP to container port 81; outside client -> 203.0.113.1:8081, watched by cnibpf monitor",
    );
    let _guarded = TcpServer::start(&web.netns, web.socket(81), "should not be seen\n");
    let pin_path = sim.pin_path.display().to_string();
    let mut monitor = sim
        .cnibpf_command(&["monitor", "--pin-path", &pin_path])
        .stdout(Stdio::piped())
        .spawn()
        .context("start cnibpf monitor")?;
    std::thread::sleep(Duration::from_millis(300));
    match tcp_request(&sim.outside, sim.uplink_target(8081)) {
        Ok(answer) => bail!("the filter let through a connection to port 81: {answer}"),
        Err(error) => println!("the client gave up as expected: {error}"),
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(monitor.id())?),
        nix::sys::signal::Signal::SIGINT,
    )?;
    let mut events = String::new();
    monitor
        .stdout
        .take()
        .context("monitor stdout")?
        .read_to_string(&mut events)?;
    ensure!(
        monitor.wait()?.success(),
        "cnibpf monitor exits cleanly on Ctrl-C"
    );
    print!("cnibpf monitor printed:\n{events}");
    ensure!(
        events.contains("DROP by rule 10"),
        "the monitor should report the drops of rule 10"
    );

    section(started, "installed state: cnibpf inspect");
    print!(
        "{}",
        String::from_utf8_lossy(&sim.cnibpf(&["inspect", "--pin-path", &pin_path]).stdout)
    );
    for map in ["portmap", "connections"] {
        section(
            started,
            &format!("installed state: bpftool map dump pinned {pin_path}/{map}"),
        );
        let dump = std::process::Command::new("bpftool")
            .args(["map", "dump", "pinned", &format!("{pin_path}/{map}")])
            .output()
            .context("run bpftool")?;
        print!("{}", String::from_utf8_lossy(&dump.stdout));
    }

    section(started, "CHECK");
    sim.check(&web)
        .map_err(|error| anyhow::anyhow!("CHECK failed: {error}"))?;
    println!("CHECK passed");

    section(started, "DEL container \"web\", then the same request");
    sim.del(&web)
        .map_err(|error| anyhow::anyhow!("DEL failed: {error}"))?;
    match tcp_request(&sim.outside, sim.uplink_target(8080)) {
        Ok(answer) => bail!("the hostPort still answers after DEL: {answer}"),
        Err(error) => println!("refused as expected: {error}"),
    }
    drop(server);
    drop(_server6);
    drop(web);
    drop(sim);
    section(
        started,
        "torn down: namespaces, pins and IPAM state removed",
    );
    Ok(())
}
