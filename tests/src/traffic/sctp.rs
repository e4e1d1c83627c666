//! SCTP: one-to-one association requests through libc (std has no SCTP), and whether the
//! kernel has SCTP at all.

use super::*;

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
