//! A client process for tests of the socket hooks: joins a cgroup (v2 moves whole processes, so
//! a thread of the test cannot), then makes one request and prints what it saw.
//!
//! `cnibpf-test-client <cgroup-dir> tcp|udp <address:port>` prints `answer=<text>` and
//! `peer=<address>` (getpeername for TCP, the datagram's source for UDP).

use std::{
    io::Read as _,
    net::{SocketAddr, TcpStream, UdpSocket},
    process::ExitCode,
    time::Duration,
};

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
        return Err("usage: cnibpf-test-client <cgroup-dir> tcp|udp <address:port>".to_owned());
    };
    std::fs::write(format!("{cgroup}/cgroup.procs"), "0")
        .map_err(|error| format!("join {cgroup}: {error}"))?;
    let target: SocketAddr = target
        .parse()
        .map_err(|error| format!("{target}: {error}"))?;
    let timeout = Duration::from_secs(2);
    match protocol.as_str() {
        "tcp" => {
            let mut stream =
                TcpStream::connect_timeout(&target, timeout).map_err(|error| error.to_string())?;
            stream
                .set_read_timeout(Some(timeout))
                .map_err(|error| error.to_string())?;
            let peer = stream.peer_addr().map_err(|error| error.to_string())?;
            let mut answer = String::new();
            stream
                .read_to_string(&mut answer)
                .map_err(|error| error.to_string())?;
            println!("answer={answer}");
            println!("peer={peer}");
        }
        "udp" => {
            let bind: SocketAddr = if target.is_ipv4() {
                "0.0.0.0:0"
            } else {
                "[::]:0"
            }
            .parse()
            .expect("literal");
            let socket = UdpSocket::bind(bind).map_err(|error| error.to_string())?;
            socket
                .set_read_timeout(Some(timeout))
                .map_err(|error| error.to_string())?;
            socket
                .send_to(b"ping", target)
                .map_err(|error| error.to_string())?;
            let mut buffer = [0u8; 1500];
            let (length, from) = socket
                .recv_from(&mut buffer)
                .map_err(|error| error.to_string())?;
            println!("answer={}", String::from_utf8_lossy(&buffer[..length]));
            println!("peer={from}");
        }
        other => return Err(format!("unknown protocol {other}")),
    }
    Ok(())
}
