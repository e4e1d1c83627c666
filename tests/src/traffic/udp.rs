//! UDP: servers that answer, echo or count, clients that ask from a given port, senders
//! of steady streams, and the ICMP error a datagram gets back.

use nix::sys::socket::{setsockopt, sockopt};

use super::*;

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

/// Counts the datagrams arriving on a UDP socket in a namespace. Stops on drop.
#[derive(Debug)]
pub struct UdpCounter {
    received: Arc<std::sync::atomic::AtomicU64>,
    _receiving: Background,
}

/// A counter's receive buffer: room for the datagrams of a stream while its thread waits for
/// a CPU (a 2-core machine running two suites), so that what it misses is what the datapath
/// dropped, not what its socket had no room for.
const COUNTER_BUFFER: usize = 8 << 20;

impl UdpCounter {
    pub fn start(netns: &Netns, bind: SocketAddr) -> Self {
        let received = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let socket = netns.run(move || bind_server(bind, UdpSocket::bind));
        socket
            .set_read_timeout(Some(Duration::from_millis(50)))
            .expect("timeout");
        // SO_RCVBUFFORCE: root may exceed net.core.rmem_max.
        setsockopt(&socket, sockopt::RcvBufForce, &COUNTER_BUFFER).expect("SO_RCVBUFFORCE");
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

/// Hands `socket` to the process at the other end of `stream` (`SCM_RIGHTS`).
pub fn send_descriptor(
    stream: &std::os::unix::net::UnixStream,
    socket: &impl std::os::fd::AsRawFd,
) -> std::io::Result<()> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    let descriptors = [socket.as_raw_fd()];
    sendmsg::<()>(
        std::os::fd::AsRawFd::as_raw_fd(stream),
        &[std::io::IoSlice::new(b"s")],
        &[ControlMessage::ScmRights(&descriptors)],
        MsgFlags::empty(),
        None,
    )
    .map(drop)
    .map_err(std::io::Error::from)
}

/// The descriptor the process at the other end of `stream` handed over ([`send_descriptor`]).
pub fn receive_descriptor(stream: &std::os::unix::net::UnixStream) -> std::os::fd::OwnedFd {
    use std::os::fd::{AsRawFd as _, FromRawFd as _};

    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    let mut byte = [0u8; 1];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let mut buffers = [std::io::IoSliceMut::new(&mut byte)];
    let message = recvmsg::<()>(
        stream.as_raw_fd(),
        &mut buffers,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .expect("receive a descriptor");
    let descriptor = message
        .cmsgs()
        .expect("control messages")
        .find_map(|message| match message {
            ControlMessageOwned::ScmRights(descriptors) => descriptors.first().copied(),
            _ => None,
        })
        .expect("a descriptor was handed over");
    // SAFETY: the kernel just gave this process the descriptor; nothing else owns it.
    unsafe { std::os::fd::OwnedFd::from_raw_fd(descriptor) }
}

/// Has ICMP errors about `socket`'s datagrams reported by its next receive, connected or not
/// (`IP_RECVERR`/`IPV6_RECVERR`; without it an unconnected socket never hears of them).
pub fn report_icmp_errors(socket: &UdpSocket) {
    let v6 = socket.local_addr().expect("local address").is_ipv6();
    let (level, name) = if v6 {
        (libc::IPPROTO_IPV6, libc::IPV6_RECVERR)
    } else {
        (libc::IPPROTO_IP, libc::IP_RECVERR)
    };
    let on: libc::c_int = 1;
    // SAFETY: a valid socket and an int option of the size given.
    let result = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(socket),
            level,
            name,
            (&raw const on).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(result, 0, "IP_RECVERR: {}", std::io::Error::last_os_error());
}
