//! Real traffic: servers that record who they saw, clients that report what they got.
//!
//! (Longer than most files: every server and client the suites and benches use, on the one
//! `Background` thread type, kept together so that a new test finds the one it needs.)

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use crate::Netns;

pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(2);

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

/// Runs a blocking socket call again when a signal or a stop interrupted it. A socket with
/// a receive timeout returns EINTR after any stop and continue of the process (signal(7)),
/// even where no handler runs; that is neither an answer nor a timeout, so it never reaches a
/// test's judgement of one.
pub fn uninterrupted<T>(mut call: impl FnMut() -> std::io::Result<T>) -> std::io::Result<T> {
    loop {
        match call() {
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            outcome => return outcome,
        }
    }
}

/// Whether a request's error (as the helpers here report it) means no answer came in time —
/// the connect, or the read of the answer, timed out — rather than an answer that refused the
/// request (a reset, an ICMP error), which a test of a drop must not take for one.
pub fn unanswered(error: &str) -> bool {
    // std's connect_timeout says "connection timed out"; a read past SO_RCVTIMEO is EAGAIN.
    error.contains("timed out") || error.contains("os error 110") || error.contains("os error 11)")
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
        let socket = match source {
            IpAddr::V4(_) => nix::sys::socket::socket(
                nix::sys::socket::AddressFamily::Inet,
                nix::sys::socket::SockType::Stream,
                nix::sys::socket::SockFlag::empty(),
                None,
            ),
            IpAddr::V6(_) => nix::sys::socket::socket(
                nix::sys::socket::AddressFamily::Inet6,
                nix::sys::socket::SockType::Stream,
                nix::sys::socket::SockFlag::empty(),
                None,
            ),
        }
        .map_err(|error| error.to_string())?;
        let local = nix::sys::socket::SockaddrStorage::from(SocketAddr::new(source, 0));
        nix::sys::socket::bind(std::os::fd::AsRawFd::as_raw_fd(&socket), &local)
            .map_err(|error| format!("bind {source}: {error}"))?;
        let stream = TcpStream::from(socket);
        stream
            .set_write_timeout(Some(CLIENT_TIMEOUT))
            .map_err(|error| error.to_string())?;
        let remote = nix::sys::socket::SockaddrStorage::from(target);
        // A blocking connect bounded by the send timeout (SO_SNDTIMEO applies to connect).
        nix::sys::socket::connect(std::os::fd::AsRawFd::as_raw_fd(&stream), &remote)
            .map_err(|error| error.to_string())?;
        let mut stream = stream;
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

/// A UDP server answering each datagram with its greeting, recording the peers. Stops on
/// drop.
#[derive(Debug)]
pub struct UdpServer {
    peers: Arc<Mutex<Vec<SocketAddr>>>,
    _serving: Background,
}

impl UdpServer {
    pub fn start(netns: &Netns, bind: SocketAddr, greeting: &str) -> Self {
        // Bound in the namespace; a socket stays in the namespace it was made in.
        let socket = netns.run(move || bind_server(bind, UdpSocket::bind));
        socket
            .set_read_timeout(Some(Duration::from_millis(20)))
            .expect("read timeout");
        let peers = Arc::new(Mutex::new(Vec::new()));
        let recorded = Arc::clone(&peers);
        let greeting = greeting.to_owned();
        let serving = Background::spawn(move |stop| {
            let mut buffer = vec![0u8; 65_536];
            while !stop.load(Ordering::Relaxed) {
                if let Ok((_, peer)) = socket.recv_from(&mut buffer) {
                    recorded.lock().expect("peers lock").push(peer);
                    let _ = socket.send_to(greeting.as_bytes(), peer);
                }
            }
        });
        Self {
            peers,
            _serving: serving,
        }
    }

    /// Peers of the datagrams answered so far.
    pub fn peers(&self) -> Vec<SocketAddr> {
        self.peers.lock().expect("peers lock").clone()
    }
}

/// Sends one datagram from `netns` to `target` and returns the answer and where it came from.
pub fn udp_request(netns: &Netns, target: SocketAddr) -> Result<(String, SocketAddr), String> {
    netns.run(move || udp_exchange(target, CLIENT_TIMEOUT))
}

/// Sends one datagram to `target` from the current namespace and returns the answer and where
/// it came from.
pub fn udp_exchange(target: SocketAddr, timeout: Duration) -> Result<(String, SocketAddr), String> {
    udp_exchange_from(0, target, timeout)
}

/// The wildcard address of `target`'s family with `port`, to bind a client to.
pub fn any_address_for(target: IpAddr, port: u16) -> SocketAddr {
    match target {
        IpAddr::V4(_) => SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)),
        IpAddr::V6(_) => SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)),
    }
}

/// One SCTP request from `client` to `target`, answered by a one-shot SCTP server bound to
/// `bind` in `server` (for kernels that have SCTP).
pub fn sctp_request(
    client: &Netns,
    server: &Netns,
    target: SocketAddr,
    bind: SocketAddr,
) -> Result<String, String> {
    let listener = server.run(move || sctp_socket(bind, true));
    let listener = listener?;
    let serving = server.spawn(move || {
        // SAFETY: accept(2)/write(2)/close(2) on descriptors this thread owns.
        unsafe {
            let connection = libc::accept(listener, std::ptr::null_mut(), std::ptr::null_mut());
            if connection >= 0 {
                libc::write(connection, b"sctp".as_ptr().cast(), 4);
                libc::close(connection);
            }
            libc::close(listener);
        }
    });
    let answer = client.run(move || {
        let fd = sctp_socket(target, false)?;
        let mut buffer = [0u8; 16];
        // SAFETY: read(2) into a stack buffer of the given length, then close(2).
        let length = unsafe {
            let length = libc::read(fd, buffer.as_mut_ptr().cast(), buffer.len());
            libc::close(fd);
            length
        };
        usize::try_from(length)
            .map(|length| String::from_utf8_lossy(&buffer[..length]).into_owned())
            .map_err(|_| std::io::Error::last_os_error().to_string())
    });
    let _ = serving.join();
    answer
}

/// An SCTP stream socket bound and listening at `addr`, or connected to it.
fn sctp_socket(addr: SocketAddr, listen: bool) -> Result<i32, String> {
    let (storage, length) = sockaddr(addr);
    let family = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain socket calls on a descriptor this function owns, with a sockaddr of the
    // length the kernel expects.
    unsafe {
        let fd = libc::socket(family, libc::SOCK_STREAM, libc::IPPROTO_SCTP);
        if fd < 0 {
            return Err(std::io::Error::last_os_error().to_string());
        }
        let pointer = (&raw const storage).cast::<libc::sockaddr>();
        let rc = if listen {
            if libc::bind(fd, pointer, length) == 0 {
                libc::listen(fd, 1)
            } else {
                -1
            }
        } else {
            libc::connect(fd, pointer, length)
        };
        if rc != 0 {
            let error = std::io::Error::last_os_error().to_string();
            libc::close(fd);
            return Err(error);
        }
        Ok(fd)
    }
}

fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; all-zero is a valid value.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(v4) => {
            // SAFETY: sockaddr_storage is large and aligned enough for any sockaddr.
            let sin = unsafe { &mut *(&raw mut storage).cast::<libc::sockaddr_in>() };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = v4.port().to_be();
            sin.sin_addr.s_addr = u32::from_ne_bytes(v4.ip().octets());
            (storage, size_of::<libc::sockaddr_in>() as libc::socklen_t)
        }
        SocketAddr::V6(v6) => {
            // SAFETY: as above.
            let sin6 = unsafe { &mut *(&raw mut storage).cast::<libc::sockaddr_in6>() };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = v6.port().to_be();
            sin6.sin6_addr.s6_addr = v6.ip().octets();
            (storage, size_of::<libc::sockaddr_in6>() as libc::socklen_t)
        }
    }
}

/// A server for connection-rate measurements: each connection sends one byte and gets one byte
/// back, then the client closes. Stops on drop.
#[derive(Debug)]
pub struct EchoServer {
    stop: Arc<AtomicBool>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl EchoServer {
    pub fn start(netns: &Netns, bind: SocketAddr, workers: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let listener = nonblocking_listener(netns, bind);
        let threads = (0..workers)
            .map(|_| {
                let listener = listener.try_clone().expect("clone listener");
                let stop = Arc::clone(&stop);
                thread::spawn(move || {
                    let mut byte = [0u8; 1];
                    while !stop.load(Ordering::Relaxed) {
                        match listener.accept() {
                            Ok((mut stream, _)) => {
                                let _ = stream.set_nonblocking(false);
                                let _ = stream.set_read_timeout(Some(CLIENT_TIMEOUT));
                                if stream.read_exact(&mut byte).is_ok() {
                                    let _ = stream.write_all(&byte);
                                }
                            }
                            // Waits in the kernel, not in a sleep: a connection is
                            // accepted the moment it arrives (the latency the benches report).
                            Err(_) => wait_readable(&listener, STOP_POLL),
                        }
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// How long a server waits for a connection before it looks at its stop flag again.
const STOP_POLL: Duration = Duration::from_millis(50);

/// Waits until `listener` has a connection to accept, or `timeout`.
fn wait_readable(listener: &TcpListener, timeout: Duration) {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    use std::os::fd::AsFd as _;
    let timeout = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
    let _ = poll(
        &mut [PollFd::new(listener.as_fd(), PollFlags::POLLIN)],
        timeout,
    );
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

/// Binds a socket to a fixed port, waiting out an "address in use" for up to two seconds: a
/// socket the previous user of the port closed stays bound while a process that another test
/// thread forks still holds its descriptor (until that child execs).
fn bind_retrying<T>(
    bind: SocketAddr,
    open: impl Fn(SocketAddr) -> std::io::Result<T>,
) -> std::io::Result<T> {
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    loop {
        match open(bind) {
            Err(error)
                if error.kind() == std::io::ErrorKind::AddrInUse
                    && std::time::Instant::now() < deadline =>
            {
                thread::sleep(Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

/// [`bind_retrying`] for a server, which cannot do without its port.
fn bind_server<T>(bind: SocketAddr, open: impl Fn(SocketAddr) -> std::io::Result<T>) -> T {
    bind_retrying(bind, open).unwrap_or_else(|error| panic!("bind {bind}: {error}"))
}

/// A non-blocking TCP listener bound to `bind` in `netns`, for servers that poll a stop flag.
fn nonblocking_listener(netns: &Netns, bind: SocketAddr) -> TcpListener {
    netns.run(move || {
        let listener = bind_server(bind, TcpListener::bind);
        listener
            .set_nonblocking(true)
            .expect("nonblocking listener");
        listener
    })
}

/// Makes closing `stream` send an RST (SO_LINGER 0): no TIME_WAIT piles up.
pub fn reset_on_close(stream: &TcpStream) {
    use std::os::fd::AsRawFd as _;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt(2) on a descriptor `stream` owns, with a correctly sized value.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

/// [`udp_exchange`] from a fixed source port of the current namespace (0: any).
pub fn udp_exchange_from(
    source_port: u16,
    target: SocketAddr,
    timeout: Duration,
) -> Result<(String, SocketAddr), String> {
    udp_exchange_with(source_port, target, b"ping", timeout)
}

/// [`udp_exchange_from`] with `payload` as the datagram (larger than the MTU: fragmented).
pub fn udp_exchange_with(
    source_port: u16,
    target: SocketAddr,
    payload: &[u8],
    timeout: Duration,
) -> Result<(String, SocketAddr), String> {
    let socket = bind_retrying(any_address_for(target.ip(), source_port), UdpSocket::bind)
        .map_err(|error| error.to_string())?;
    socket
        .set_read_timeout(Some(timeout))
        .map_err(|error| error.to_string())?;
    socket
        .send_to(payload, target)
        .map_err(|error| error.to_string())?;
    let mut buffer = vec![0u8; 65_536];
    let (length, from) =
        uninterrupted(|| socket.recv_from(&mut buffer)).map_err(|error| error.to_string())?;
    Ok((
        String::from_utf8_lossy(&buffer[..length]).into_owned(),
        from,
    ))
}

/// Sends a datagram on a connected UDP socket from `netns` to `target` and returns the error
/// the next receive reports: `ConnectionRefused` when an ICMP "port unreachable" came back.
pub fn udp_error(netns: &Netns, target: SocketAddr) -> std::io::ErrorKind {
    netns.run(move || {
        let socket = UdpSocket::bind(any_address_for(target.ip(), 0)).expect("bind udp");
        socket.connect(target).expect("connect udp");
        socket
            .set_read_timeout(Some(CLIENT_TIMEOUT))
            .expect("timeout");
        socket.send(b"ping").expect("send");
        let mut buffer = [0u8; 64];
        match uninterrupted(|| socket.recv(&mut buffer)) {
            Ok(_) => std::io::ErrorKind::Other,
            Err(error) => error.kind(),
        }
    })
}

/// A thread that runs until told to stop, stopped and joined on drop: the servers and senders
/// below. `work` gets the stop flag to poll.
#[derive(Debug)]
struct Background<T: Send + 'static = ()> {
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<T>>,
}

impl<T: Send + 'static> Background<T> {
    fn spawn(work: impl FnOnce(&Arc<AtomicBool>) -> T + Send + 'static) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        Self {
            stop,
            thread: Some(thread::spawn(move || work(&flag))),
        }
    }

    /// [`Self::spawn`] on a thread that has entered `netns`.
    fn in_netns(netns: &Netns, work: impl FnOnce(&Arc<AtomicBool>) -> T + Send + 'static) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        Self {
            stop,
            thread: Some(netns.spawn(move || work(&flag))),
        }
    }

    /// Stops the thread and returns what it returned.
    fn finish(mut self) -> Option<T> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().and_then(|thread| thread.join().ok())
    }
}

impl<T: Send + 'static> Drop for Background<T> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Accepts connections on `bind` in `netns` until stopped, handing each, blocking again, to
/// `serve` with the stop flag.
fn accept_each(
    netns: &Netns,
    bind: SocketAddr,
    serve: impl Fn(TcpStream, &Arc<AtomicBool>) + Send + 'static,
) -> Background {
    let listener = nonblocking_listener(netns, bind);
    Background::spawn(move |stop| {
        while !stop.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok((stream, _)) => {
                    let _ = stream.set_nonblocking(false);
                    serve(stream, stop);
                }
                Err(_) => wait_readable(&listener, STOP_POLL),
            }
        }
    })
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

/// One ping from `netns` to `target`; whether it was answered.
pub fn ping(netns: &Netns, target: IpAddr) -> bool {
    netns
        .command(&["ping", "-c", "1", "-W", "2", &target.to_string()])
        .output()
        .expect("run ping")
        .status
        .success()
}

/// Counts the datagrams arriving on a UDP socket in a namespace. Stops on drop.
#[derive(Debug)]
pub struct UdpCounter {
    received: Arc<std::sync::atomic::AtomicU64>,
    _receiving: Background,
}

impl UdpCounter {
    pub fn start(netns: &Netns, bind: SocketAddr) -> Self {
        let received = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let socket = netns.run(move || bind_server(bind, UdpSocket::bind));
        socket
            .set_read_timeout(Some(Duration::from_millis(50)))
            .expect("timeout");
        let counted = Arc::clone(&received);
        let receiving = Background::spawn(move |stop| {
            let mut buffer = [0u8; 2048];
            while !stop.load(Ordering::Relaxed) {
                if socket.recv(&mut buffer).is_ok() {
                    counted.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        Self {
            received,
            _receiving: receiving,
        }
    }

    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }
}

/// Sends datagrams from `netns` to each of `targets` in turn, one round every `interval`,
/// until stopped; counts the rounds sent. Stops on drop.
#[derive(Debug)]
pub struct UdpSender {
    sending: Background<u64>,
}

impl UdpSender {
    pub fn start(netns: &Netns, targets: Vec<SocketAddr>, interval: Duration) -> Self {
        let sending = Background::in_netns(netns, move |stop| {
            let bind = |unspecified: IpAddr| UdpSocket::bind((unspecified, 0)).expect("bind");
            let (v4, v6) = (
                bind(Ipv4Addr::UNSPECIFIED.into()),
                bind(Ipv6Addr::UNSPECIFIED.into()),
            );
            let mut rounds = 0;
            while !stop.load(Ordering::Relaxed) {
                for target in &targets {
                    let socket = if target.is_ipv4() { &v4 } else { &v6 };
                    socket.send_to(b"tick", target).expect("send");
                }
                rounds += 1;
                thread::sleep(interval);
            }
            rounds
        });
        Self { sending }
    }

    /// Stops sending; the rounds sent.
    pub fn stop(self) -> u64 {
        self.sending.finish().expect("sender thread")
    }
}

/// Whether this kernel can open SCTP sockets at all (it may be built without SCTP).
pub fn kernel_has_sctp() -> bool {
    // SAFETY: socket(2) with constant arguments; the descriptor is closed right away.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, libc::IPPROTO_SCTP) };
    if fd < 0 {
        return false;
    }
    // SAFETY: fd was just returned by socket(2).
    unsafe { libc::close(fd) };
    true
}

/// Sends `frame` (Ethernet header included) out of interface `ifname` of `netns`, as a raw
/// packet socket does: no stack of the sender's judges it.
pub fn send_frame(netns: &Netns, ifname: &str, frame: Vec<u8>) {
    let ifname = ifname.to_owned();
    netns.run(move || {
        let name = std::ffi::CString::new(ifname.clone()).expect("interface name");
        // SAFETY: a NUL-terminated name.
        let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
        assert_ne!(index, 0, "no interface {ifname}");
        // SAFETY: plain socket creation; the descriptor is owned below.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
        assert!(
            fd >= 0,
            "packet socket: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: `fd` was just opened and is owned by nothing else.
        let socket: std::os::fd::OwnedFd = unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) };
        // SAFETY: all-zero is a valid sockaddr_ll; the fields that matter are set below.
        let mut address: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        address.sll_family = libc::AF_PACKET as u16;
        address.sll_ifindex = i32::try_from(index).expect("ifindex");
        address.sll_halen = 6;
        address.sll_addr[..6].copy_from_slice(&frame[..6]);
        // SAFETY: `frame` and `address` outlive the call; the lengths are theirs.
        let sent = unsafe {
            libc::sendto(
                std::os::fd::AsRawFd::as_raw_fd(&socket),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&raw const address).cast(),
                size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        assert_eq!(
            usize::try_from(sent).ok(),
            Some(frame.len()),
            "send a raw frame on {ifname}: {}",
            std::io::Error::last_os_error()
        );
    });
}
