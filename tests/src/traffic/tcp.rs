//! TCP: servers that greet, echo or sink, clients that request, upload or hold a
//! conversation, and connection rates.

use super::*;

/// A TCP server in a namespace answering every connection with its greeting, recording the
/// peer address of each connection. Stops on drop.
#[derive(Debug)]
pub struct TcpServer {
    peers: Arc<Mutex<Vec<SocketAddr>>>,
    _accepting: Background,
}

impl TcpServer {
    pub fn start(netns: &Netns, bind: SocketAddr, greeting: &str) -> Self {
        let peers = Arc::new(Mutex::new(Vec::new()));
        let recorded = Arc::clone(&peers);
        let greeting = greeting.to_owned();
        let accepting = accept_each(netns, bind, move |mut stream, _| {
            if let Ok(peer) = stream.peer_addr() {
                recorded.lock().expect("peers lock").push(peer);
            }
            let _ = stream.write_all(greeting.as_bytes());
        });
        Self {
            peers,
            _accepting: accepting,
        }
    }

    /// Peer addresses of the connections accepted so far.
    pub fn peers(&self) -> Vec<SocketAddr> {
        self.peers.lock().expect("peers lock").clone()
    }
}

/// Connects from `netns` to `target` and returns what the server sent, or why it failed.
pub fn tcp_request(netns: &Netns, target: SocketAddr) -> Result<String, String> {
    netns.run(move || tcp_exchange(target, CLIENT_TIMEOUT).map(|(answer, _)| answer))
}

/// [`tcp_request`] from the local address `source` (one of `netns`'s addresses).
pub fn tcp_request_from(
    netns: &Netns,
    source: IpAddr,
    target: SocketAddr,
) -> Result<String, String> {
    netns.run(move || {
        let mut stream = connect_from(SocketAddr::new(source, 0), target)?;
        stream
            .set_read_timeout(Some(CLIENT_TIMEOUT))
            .map_err(|error| error.to_string())?;
        let mut answer = String::new();
        stream
            .read_to_string(&mut answer)
            .map_err(|error| error.to_string())?;
        Ok(answer)
    })
}

/// A TCP connection from the current namespace's `local` address and port (port 0: any) to
/// `target`, its connect bounded by [`CLIENT_TIMEOUT`].
pub fn connect_from(local: SocketAddr, target: SocketAddr) -> Result<TcpStream, String> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, SockaddrStorage, bind, connect};
    use std::os::fd::AsRawFd as _;
    let family = if local.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let socket = nix::sys::socket::socket(family, SockType::Stream, SockFlag::empty(), None)
        .map_err(|error| error.to_string())?;
    // A port an earlier connection of the test left in TIME_WAIT may be bound again (towards
    // another remote).
    nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::ReuseAddr, &true)
        .map_err(|error| error.to_string())?;
    bind(socket.as_raw_fd(), &SockaddrStorage::from(local))
        .map_err(|error| format!("bind {local}: {error}"))?;
    let stream = TcpStream::from(socket);
    stream
        .set_write_timeout(Some(CLIENT_TIMEOUT))
        .map_err(|error| error.to_string())?;
    // A blocking connect bounded by the send timeout (SO_SNDTIMEO applies to connect, which
    // reports running out of it as EINPROGRESS).
    connect(stream.as_raw_fd(), &SockaddrStorage::from(target)).map_err(|error| match error {
        nix::errno::Errno::EINPROGRESS => "connection timed out".to_owned(),
        error => error.to_string(),
    })?;
    Ok(stream)
}

/// Connects to `target` from the current namespace and reads what the server sends until it
/// closes; returns that and the peer address the socket reports.
pub fn tcp_exchange(target: SocketAddr, timeout: Duration) -> Result<(String, SocketAddr), String> {
    stream_exchange(target, timeout, b"")
}

/// An HTTP/1.0 GET of `/` from `netns`: the body of the answer (status line and headers
/// dropped), or why it failed.
pub fn http_get(netns: &Netns, target: SocketAddr) -> Result<String, String> {
    netns.run(move || http_exchange(target, CLIENT_TIMEOUT).map(|(body, _)| body))
}

/// [`http_get`] from the current namespace; also the peer address the socket reports.
pub fn http_exchange(
    target: SocketAddr,
    timeout: Duration,
) -> Result<(String, SocketAddr), String> {
    let (answer, peer) = stream_exchange(
        target,
        timeout,
        b"GET / HTTP/1.0\r\nHost: cnibpf-test\r\n\r\n",
    )?;
    let body = answer
        .split_once("\r\n\r\n")
        .map_or(answer.as_str(), |(_, body)| body)
        .to_owned();
    Ok((body, peer))
}

/// Connects to `target`, sends `request` (if any) and reads until the server closes; returns
/// that and the peer address the socket reports.
fn stream_exchange(
    target: SocketAddr,
    timeout: Duration,
    request: &[u8],
) -> Result<(String, SocketAddr), String> {
    let mut stream =
        TcpStream::connect_timeout(&target, timeout).map_err(|error| error.to_string())?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|error| error.to_string())?;
    let peer = stream.peer_addr().map_err(|error| error.to_string())?;
    if !request.is_empty() {
        stream
            .write_all(request)
            .map_err(|error| error.to_string())?;
    }
    let mut answer = String::new();
    stream
        .read_to_string(&mut answer)
        .map_err(|error| error.to_string())?;
    Ok((answer, peer))
}

/// What [`connection_rate`] measured.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionRate {
    /// Completed connections per second, all clients together.
    pub per_second: f64,
    /// The 99th percentile of one connection's time, connect to the answer's byte.
    pub latency_p99: Duration,
}

/// Connections per second from `netns` to `target` over `duration` with `clients` parallel
/// clients, each connecting, sending one byte, reading one byte and closing with a reset (so
/// that no TIME_WAIT piles up on either side), and how long each took. Failed connections are
/// not counted.
pub fn connection_rate(
    netns: &Netns,
    target: SocketAddr,
    clients: usize,
    duration: Duration,
) -> ConnectionRate {
    let handles: Vec<_> = (0..clients)
        .map(|_| {
            netns.spawn(move || {
                let started = std::time::Instant::now();
                let mut latencies = Vec::new();
                let mut byte = [1u8; 1];
                while started.elapsed() < duration {
                    let connecting = std::time::Instant::now();
                    let Ok(mut stream) = TcpStream::connect_timeout(&target, CLIENT_TIMEOUT) else {
                        continue;
                    };
                    let _ = stream.set_read_timeout(Some(CLIENT_TIMEOUT));
                    if stream.write_all(&byte).is_ok() && stream.read_exact(&mut byte).is_ok() {
                        latencies.push(connecting.elapsed());
                    }
                    reset_on_close(&stream);
                }
                latencies
            })
        })
        .collect();
    let mut latencies: Vec<Duration> = handles
        .into_iter()
        .flat_map(|handle| handle.join().unwrap_or_default())
        .collect();
    latencies.sort_unstable();
    let latency_p99 = latencies
        .get((latencies.len() * 99).div_ceil(100).saturating_sub(1))
        .copied()
        .unwrap_or_default();
    ConnectionRate {
        per_second: latencies.len() as f64 / duration.as_secs_f64(),
        latency_p99,
    }
}

/// Makes closing `stream` send an RST (SO_LINGER 0): no TIME_WAIT piles up.
pub fn reset_on_close(stream: &TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // A socket that keeps its linger only leaves a TIME_WAIT behind.
    let _ = nix::sys::socket::setsockopt(stream, nix::sys::socket::sockopt::Linger, &linger);
}

/// A TCP server that reads each connection to its end and answers with the number of bytes
/// it read. Stops on drop.
#[derive(Debug)]
pub struct SinkServer {
    _accepting: Background,
}

impl SinkServer {
    pub fn start(netns: &Netns, bind: SocketAddr) -> Self {
        let accepting = accept_each(netns, bind, |mut stream, _| {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(20)));
            let mut buffer = vec![0u8; 65_536];
            let mut total = 0u64;
            while let Ok(length) = stream.read(&mut buffer) {
                if length == 0 {
                    break;
                }
                total += length as u64;
            }
            let _ = stream.write_all(total.to_string().as_bytes());
        });
        Self {
            _accepting: accepting,
        }
    }
}

/// Sends `bytes` bytes from `netns` to a [`SinkServer`] at `target` in full-size segments and
/// returns how many it says it read.
pub fn tcp_upload(
    netns: &Netns,
    target: SocketAddr,
    bytes: usize,
    timeout: Duration,
) -> Result<u64, String> {
    netns.run(move || {
        let mut stream =
            TcpStream::connect_timeout(&target, timeout).map_err(|error| error.to_string())?;
        stream
            .set_write_timeout(Some(timeout))
            .map_err(|error| error.to_string())?;
        stream
            .set_read_timeout(Some(timeout))
            .map_err(|error| error.to_string())?;
        stream
            .write_all(&vec![0x5a; bytes])
            .map_err(|error| format!("write: {error}"))?;
        stream
            .shutdown(std::net::Shutdown::Write)
            .map_err(|error| error.to_string())?;
        let mut answer = String::new();
        stream
            .read_to_string(&mut answer)
            .map_err(|error| format!("read: {error}"))?;
        answer
            .parse()
            .map_err(|_| format!("unexpected answer {answer:?}"))
    })
}

/// A TCP server that echoes everything each connection sends until it closes. Stops on drop.
#[derive(Debug)]
pub struct StreamEchoServer {
    _accepting: Background,
}

impl StreamEchoServer {
    pub fn start(netns: &Netns, bind: SocketAddr) -> Self {
        let accepting = accept_each(netns, bind, |mut stream, stop| {
            let _ = stream.set_read_timeout(Some(Duration::from_millis(100)));
            let stop = Arc::clone(stop);
            // A thread per connection: conversations stay open across exchanges.
            thread::spawn(move || {
                let mut buffer = [0u8; 4096];
                while !stop.load(Ordering::Relaxed) {
                    match stream.read(&mut buffer) {
                        Ok(0) => break,
                        Ok(length) => {
                            if stream.write_all(&buffer[..length]).is_err() {
                                break;
                            }
                        }
                        Err(error)
                            if matches!(
                                error.kind(),
                                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                            ) => {}
                        Err(_) => break,
                    }
                }
            });
        });
        Self {
            _accepting: accepting,
        }
    }
}

/// One TCP connection opened from a namespace and kept across exchanges with a
/// [`StreamEchoServer`].
#[derive(Debug)]
pub struct Conversation {
    stream: TcpStream,
}

impl Conversation {
    pub fn open(netns: &Netns, target: SocketAddr) -> Result<Self, String> {
        let stream = netns.run(move || TcpStream::connect_timeout(&target, CLIENT_TIMEOUT));
        Ok(Self {
            stream: stream.map_err(|error| error.to_string())?,
        })
    }

    /// [`Self::open`] from a given local address and port of `netns` (port 0: any).
    pub fn open_from(netns: &Netns, local: SocketAddr, target: SocketAddr) -> Result<Self, String> {
        let stream = netns.run(move || connect_from(local, target))?;
        Ok(Self { stream })
    }

    /// The local address and port of the connection.
    pub fn local(&self) -> SocketAddr {
        self.stream
            .local_addr()
            .expect("a connected socket's address")
    }

    /// Sends `message` and waits up to `timeout` for it to come back whole.
    pub fn exchange(&mut self, message: &[u8], timeout: Duration) -> Result<(), String> {
        self.stream
            .set_read_timeout(Some(timeout))
            .map_err(|error| error.to_string())?;
        self.stream
            .write_all(message)
            .map_err(|error| error.to_string())?;
        let mut echoed = vec![0u8; message.len()];
        self.stream
            .read_exact(&mut echoed)
            .map_err(|error| error.to_string())?;
        if echoed == message {
            Ok(())
        } else {
            Err(format!("echoed {echoed:?} for {message:?}"))
        }
    }
}
