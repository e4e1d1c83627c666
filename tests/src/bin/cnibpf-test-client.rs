//! A client process for tests of the socket hooks: joins a cgroup (v2 moves whole processes, so
//! a thread of the test cannot), then makes one request and prints what it saw.
//!
//! `cnibpf-test-client <cgroup-dir> tcp|udp|http <address:port>` prints `answer=<text>` (for
//! http, the first line of the body of a GET of `/`) and `peer=<address>` (getpeername for TCP,
//! the datagram's source for UDP). `cnibpf-test-client <cgroup-dir> udp-socket <address:port>`
//! binds a UDP socket there and hands it over its standard input, a Unix socket
//! (`SimHost::host_udp_socket`), to the test that uses it.

use std::{
    net::{SocketAddr, UdpSocket},
    os::{fd::FromRawFd as _, unix::net::UnixStream},
    process::ExitCode,
    time::Duration,
};

use cnibpf_tests::traffic::{http_exchange, send_descriptor, tcp_exchange, udp_exchange};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            println!("error={error}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [cgroup, protocol, target] = args.as_slice() else {
        return Err(
            "usage: cnibpf-test-client <cgroup-dir> tcp|udp|http|udp-socket <address:port>"
                .to_owned(),
        );
    };
    std::fs::write(format!("{cgroup}/cgroup.procs"), "0")
        .map_err(|error| format!("join {cgroup}: {error}"))?;
    let target: SocketAddr = target
        .parse()
        .map_err(|error| format!("{target}: {error}"))?;
    if protocol == "udp-socket" {
        let socket = UdpSocket::bind(target).map_err(|error| format!("bind {target}: {error}"))?;
        // SAFETY: the test made standard input one end of a Unix socket pair for this.
        let test = unsafe { UnixStream::from_raw_fd(0) };
        return send_descriptor(&test, &socket).map_err(|error| format!("hand over: {error}"));
    }
    let timeout = Duration::from_secs(2);
    let (answer, peer) = match protocol.as_str() {
        "tcp" => tcp_exchange(target, timeout)?,
        "udp" => udp_exchange(target, timeout)?,
        "http" => http_exchange(target, timeout)?,
        other => return Err(format!("unknown protocol {other}")),
    };
    println!("answer={answer}");
    println!("peer={peer}");
    Ok(())
}
