//! Real traffic: servers that record who they saw, clients that report what they got.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
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
    stop: Arc<AtomicBool>,
    peers: Arc<Mutex<Vec<SocketAddr>>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl TcpServer {
    pub fn start(netns: &Netns, bind: SocketAddr, greeting: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let peers = Arc::new(Mutex::new(Vec::new()));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let greeting = greeting.to_owned();
        let thread = {
            let stop = Arc::clone(&stop);
            let peers = Arc::clone(&peers);
            netns.spawn(move || {
                let listener =
                    TcpListener::bind(bind).unwrap_or_else(|error| panic!("bind {bind}: {error}"));
                listener
                    .set_nonblocking(true)
                    .expect("nonblocking listener");
                ready_tx.send(()).expect("test waits for the server");
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((mut stream, peer)) => {
                            peers.lock().expect("peers lock").push(peer);
                            let _ = stream.set_nonblocking(false);
                            let _ = stream.write_all(greeting.as_bytes());
                        }
                        Err(_) => thread::sleep(Duration::from_millis(5)),
                    }
                }
            })
        };
        ready_rx
            .recv_timeout(Duration::from_secs(5))
            .unwrap_or_else(|_| panic!("TCP server on {bind} did not start"));
        Self {
            stop,
            peers,
            thread: Some(thread),
        }
    }

    /// Peer addresses of the connections accepted so far.
    pub fn peers(&self) -> Vec<SocketAddr> {
        self.peers.lock().expect("peers lock").clone()
    }
}

impl Drop for TcpServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Connects from `netns` to `target` and returns what the server sent, or why it failed.
pub fn tcp_request(netns: &Netns, target: SocketAddr) -> Result<String, String> {
    netns.run(move || {
        let mut stream = TcpStream::connect_timeout(&target, CLIENT_TIMEOUT)
            .map_err(|error| error.to_string())?;
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

/// A UDP server answering each datagram with its greeting, recording the peers.
#[derive(Debug)]
pub struct UdpServer {
    stop: Arc<AtomicBool>,
    peers: Arc<Mutex<Vec<SocketAddr>>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl UdpServer {
    pub fn start(netns: &Netns, bind: SocketAddr, greeting: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let peers = Arc::new(Mutex::new(Vec::new()));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let greeting = greeting.to_owned();
        let thread = {
            let stop = Arc::clone(&stop);
            let peers = Arc::clone(&peers);
            netns.spawn(move || {
                let socket =
                    UdpSocket::bind(bind).unwrap_or_else(|error| panic!("bind {bind}: {error}"));
                socket
                    .set_read_timeout(Some(Duration::from_millis(20)))
                    .expect("read timeout");
                ready_tx.send(()).expect("test waits for the server");
                let mut buffer = [0u8; 1500];
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((_, peer)) = socket.recv_from(&mut buffer) {
                        peers.lock().expect("peers lock").push(peer);
                        let _ = socket.send_to(greeting.as_bytes(), peer);
                    }
                }
            })
        };
        ready_rx
            .recv_timeout(Duration::from_secs(5))
            .unwrap_or_else(|_| panic!("UDP server on {bind} did not start"));
        Self {
            stop,
            peers,
            thread: Some(thread),
        }
    }

    pub fn peers(&self) -> Vec<SocketAddr> {
        self.peers.lock().expect("peers lock").clone()
    }
}

impl Drop for UdpServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Sends one datagram from `netns` to `target` and returns the answer and where it came from.
pub fn udp_request(netns: &Netns, target: SocketAddr) -> Result<(String, SocketAddr), String> {
    netns.run(move || {
        let bind: SocketAddr = if target.is_ipv4() {
            "0.0.0.0:0"
        } else {
            "[::]:0"
        }
        .parse()
        .expect("literal");
        let socket = UdpSocket::bind(bind).map_err(|error| error.to_string())?;
        socket
            .set_read_timeout(Some(CLIENT_TIMEOUT))
            .map_err(|error| error.to_string())?;
        socket
            .send_to(b"ping", target)
            .map_err(|error| error.to_string())?;
        let mut buffer = [0u8; 1500];
        let (length, from) = socket
            .recv_from(&mut buffer)
            .map_err(|error| error.to_string())?;
        Ok((
            String::from_utf8_lossy(&buffer[..length]).into_owned(),
            from,
        ))
    })
}
