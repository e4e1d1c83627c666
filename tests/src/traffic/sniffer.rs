//! What an interface carries, as a sniffer on the link sees it.

use std::{
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread,
};

use nix::sys::{
    socket::{setsockopt, sockopt},
    time::TimeVal,
};

use crate::Netns;

/// Every frame interface `ifname` of a namespace sends or receives while it runs: a packet
/// socket bound to it, as tcpdump's would be.
#[derive(Debug)]
pub struct Sniffer {
    stop: Arc<AtomicBool>,
    frames: Arc<Mutex<Vec<Vec<u8>>>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Sniffer {
    /// Starts capturing; returns once the socket is bound.
    pub fn start(netns: &Netns, ifname: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let frames = Arc::new(Mutex::new(Vec::new()));
        let (bound, ready) = mpsc::channel();
        let ifname = ifname.to_owned();
        let (stopped, captured) = (Arc::clone(&stop), Arc::clone(&frames));
        let thread = netns.spawn(move || {
            let socket = bind(&ifname);
            bound.send(()).expect("the starter waits");
            let mut buffer = vec![0u8; 65_536];
            while !stopped.load(Ordering::Relaxed) {
                // SAFETY: the buffer outlives the call; its length is its own.
                let read = unsafe {
                    libc::recv(
                        socket.as_raw_fd(),
                        buffer.as_mut_ptr().cast(),
                        buffer.len(),
                        0,
                    )
                };
                if let Ok(length) = usize::try_from(read) {
                    captured
                        .lock()
                        .expect("frames")
                        .push(buffer[..length].to_vec());
                }
            }
        });
        ready.recv().expect("the sniffer binds its socket");
        Self {
            stop,
            frames,
            thread: Some(thread),
        }
    }

    /// The frames captured so far, in order.
    pub fn frames(&self) -> Vec<Vec<u8>> {
        self.frames.lock().expect("frames").clone()
    }
}

impl Drop for Sniffer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A packet socket of every protocol bound to `ifname`, whose reads give up after 50 ms so
/// that the capture loop sees its stop flag.
fn bind(ifname: &str) -> OwnedFd {
    let name = std::ffi::CString::new(ifname).expect("interface name");
    // SAFETY: a NUL-terminated name.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    assert_ne!(index, 0, "no interface {ifname}");
    let all = (libc::ETH_P_ALL as u16).to_be();
    // SAFETY: plain socket creation; the descriptor is owned below.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(all)) };
    assert!(
        fd >= 0,
        "packet socket: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: `fd` was just opened and is owned by nothing else.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: all-zero is a valid sockaddr_ll; the fields that matter are set below.
    let mut address: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    address.sll_family = libc::AF_PACKET as u16;
    address.sll_protocol = all;
    address.sll_ifindex = i32::try_from(index).expect("ifindex");
    // SAFETY: `address` outlives the call; the length is its own.
    let bound = unsafe {
        libc::bind(
            socket.as_raw_fd(),
            (&raw const address).cast(),
            size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    assert_eq!(
        bound,
        0,
        "bind to {ifname}: {}",
        std::io::Error::last_os_error()
    );
    let timeout = TimeVal::new(0, 50_000);
    setsockopt(&socket, sockopt::ReceiveTimeout, &timeout)
        .unwrap_or_else(|error| panic!("receive timeout: {error}"));
    socket
}
