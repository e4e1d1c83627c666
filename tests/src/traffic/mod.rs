//! Real traffic: servers that record who they saw, clients that report what they got.
//!
//! One module per protocol (`tcp`, `udp`, `sctp`), every server on the one
//! `Background` thread type defined here; all of them are re-exported here, where tests look.

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

mod sctp;
mod sniffer;
mod tcp;
mod udp;

pub use sctp::*;
pub use sniffer::Sniffer;
pub use tcp::*;
pub use udp::*;

pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(2);

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

/// The wildcard address of `target`'s family with `port`, to bind a client to.
pub fn any_address_for(target: IpAddr, port: u16) -> SocketAddr {
    match target {
        IpAddr::V4(_) => SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)),
        IpAddr::V6(_) => SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)),
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

/// One ping from `netns` to `target`; whether it was answered.
pub fn ping(netns: &Netns, target: IpAddr) -> bool {
    netns
        .command(&["ping", "-c", "1", "-W", "2", &target.to_string()])
        .output()
        .expect("run ping")
        .status
        .success()
}

/// Sends `frame` (Ethernet header included) out of interface `ifname` of `netns`, as a raw
/// packet socket does: no stack of the sender's judges it.
pub fn send_frame(netns: &Netns, ifname: &str, frame: Vec<u8>) {
    send_frames(netns, ifname, vec![frame]);
}

/// [`send_frame`] of each of `frames`, one right after the other from one socket.
pub fn send_frames(netns: &Netns, ifname: &str, frames: Vec<Vec<u8>>) {
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
        for frame in frames {
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
        }
    });
}
