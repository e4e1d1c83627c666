//! Netfilter's netlink (`NETLINK_NETFILTER`), spoken directly for the few questions the
//! nftables backend asks on every operation — does the table exist, is an attachment the last
//! one, which connections go to a hostPort — where an `nft` or `conntrack` process would cost
//! milliseconds each, or one per hostPort.

use std::{io, ops::ControlFlow};

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLM_F_DUMP: u16 = 0x300;
const NLA_TYPE_MASK: u16 = 0x3fff;
/// `struct nlmsghdr` and `struct nfgenmsg`.
const HEADER_LEN: usize = 16 + 4;

/// A request: header, `nfgenmsg`, attributes.
#[derive(Clone, Debug)]
pub struct Request {
    bytes: Vec<u8>,
}

impl Request {
    /// `subsystem` and `kind` make the message type; `family` is the `nfgenmsg` family.
    pub fn new(subsystem: u8, kind: u8, family: u8, dump: bool) -> Self {
        let flags = NLM_F_REQUEST | if dump { NLM_F_DUMP } else { NLM_F_ACK };
        let mut bytes = Vec::with_capacity(128);
        bytes.extend(0u32.to_ne_bytes());
        bytes.extend((u16::from(subsystem) << 8 | u16::from(kind)).to_ne_bytes());
        bytes.extend(flags.to_ne_bytes());
        bytes.extend(1u32.to_ne_bytes());
        bytes.extend(0u32.to_ne_bytes());
        // nfgenmsg: family, version 0, resource id 0.
        bytes.extend([family, 0, 0, 0]);
        Self { bytes }
    }

    /// The `nfgenmsg` resource id (big endian: an NFLOG group's number).
    pub fn resource(mut self, id: u16) -> Self {
        self.bytes[18..20].copy_from_slice(&id.to_be_bytes());
        self
    }

    pub fn attribute(mut self, kind: u16, value: &[u8]) -> Self {
        self.push_attribute(kind, value);
        self
    }

    /// A string attribute, NUL-terminated as the kernel's `NLA_STRING`s are.
    pub fn string(self, kind: u16, value: &str) -> Self {
        let mut bytes = value.as_bytes().to_vec();
        bytes.push(0);
        self.attribute(kind, &bytes)
    }

    fn push_attribute(&mut self, kind: u16, value: &[u8]) {
        // fail-closed: no kernel result; our attributes are short.
        let length = u16::try_from(4 + value.len()).unwrap_or(u16::MAX);
        self.bytes.extend(length.to_ne_bytes());
        self.bytes.extend(kind.to_ne_bytes());
        self.bytes.extend(value);
        self.bytes.resize(self.bytes.len().next_multiple_of(4), 0);
    }

    pub fn finish(mut self) -> Vec<u8> {
        // fail-closed: no kernel result; our requests are short.
        let length = u32::try_from(self.bytes.len()).unwrap_or(u32::MAX);
        self.bytes[..4].copy_from_slice(&length.to_ne_bytes());
        self.bytes
    }
}

/// The attributes in `bytes`: (type without flags, payload).
pub fn attributes(bytes: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut rest = bytes;
    std::iter::from_fn(move || {
        if rest.len() < 4 {
            return None;
        }
        let length = usize::from(u16::from_ne_bytes([rest[0], rest[1]]));
        let kind = u16::from_ne_bytes([rest[2], rest[3]]) & NLA_TYPE_MASK;
        if length < 4 || length > rest.len() {
            return None;
        }
        let payload = &rest[4..length];
        rest = &rest[length.next_multiple_of(4).min(rest.len())..];
        Some((kind, payload))
    })
}

/// The payload of the first attribute of type `kind` in `bytes`.
pub fn attribute(bytes: &[u8], kind: u16) -> Option<&[u8]> {
    attributes(bytes).find_map(|(found, payload)| (found == kind).then_some(payload))
}

/// The messages in `received` (one datagram): each one's (type, bytes from its `nfgenmsg`
/// on), until a malformed one; errors and the end of a dump are left to [`Connection`].
pub fn messages(received: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut offset = 0;
    std::iter::from_fn(move || {
        let message = received.get(offset..)?;
        if message.len() < HEADER_LEN {
            return None;
        }
        let length = u32::from_ne_bytes([message[0], message[1], message[2], message[3]]) as usize;
        if length < HEADER_LEN || length > message.len() {
            return None;
        }
        offset += length.next_multiple_of(4);
        Some((
            u16::from_ne_bytes([message[4], message[5]]),
            &message[16..length],
        ))
    })
}

/// An open netfilter netlink socket.
pub struct Connection {
    socket: Socket,
    /// Where replies are read, whole: its size tells the kernel to fill dump messages up to
    /// its limit (32 KiB) instead of a page or two each, a tenth of the reads for a big
    /// table.
    buffer: Vec<u8>,
}

/// The receive buffer: larger than any message the kernel sends (a dump's are at most 32 KiB).
const RECEIVE_BUFFER: usize = 256 * 1024;

impl Connection {
    /// The socket, to read what the kernel sends unasked (an NFLOG group's packets).
    pub fn into_socket(self) -> Socket {
        self.socket
    }

    pub fn open() -> io::Result<Self> {
        let mut socket = Socket::new(NETLINK_NETFILTER)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Self {
            socket,
            buffer: Vec::with_capacity(RECEIVE_BUFFER),
        })
    }

    /// Sends `request` and hands each reply's (message kind, attributes) to `each` until the
    /// dump ends, the request is acknowledged, or `each` breaks. An error the kernel answers
    /// with is returned as such.
    pub fn exchange(
        &mut self,
        request: Request,
        mut each: impl FnMut(u8, &[u8]) -> ControlFlow<()>,
    ) -> io::Result<()> {
        self.socket.send(&request.finish(), 0)?;
        loop {
            self.buffer.clear();
            let received = self.socket.recv(&mut self.buffer, libc::MSG_TRUNC)?;
            if received > self.buffer.len() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("a netlink message of {received} bytes, more than {RECEIVE_BUFFER}"),
                ));
            }
            let reply = &self.buffer[..];
            let mut offset = 0;
            while offset + 16 <= reply.len() {
                let message = &reply[offset..];
                let length =
                    u32::from_ne_bytes([message[0], message[1], message[2], message[3]]) as usize;
                if length < 16 || length > message.len() {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "truncated netlink message",
                    ));
                }
                let kind = u16::from_ne_bytes([message[4], message[5]]);
                match kind {
                    NLMSG_DONE => return Ok(()),
                    NLMSG_ERROR => {
                        // An error message too short to carry its code is no acknowledgement.
                        let code = message
                            .get(16..20)
                            .map(|code| i32::from_ne_bytes([code[0], code[1], code[2], code[3]]))
                            .ok_or_else(|| {
                                io::Error::new(
                                    io::ErrorKind::InvalidData,
                                    "truncated netlink error message",
                                )
                            })?;
                        return if code == 0 {
                            Ok(())
                        } else {
                            Err(io::Error::from_raw_os_error(-code))
                        };
                    }
                    _ if length >= HEADER_LEN
                        && each((kind & 0xff) as u8, &message[HEADER_LEN..length]).is_break() =>
                    {
                        return Ok(());
                    }
                    _ => {}
                }
                offset += length.next_multiple_of(4);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_pad_their_attributes_and_nested_ones_read_back() {
        let inner = Request::new(0, 0, 0, false)
            .attribute(1, &[1, 2, 3, 4, 5])
            .finish();
        let request = Request::new(10, 13, 1, true)
            .string(1, "cnibpf")
            .attribute(3 | 0x8000, &inner[HEADER_LEN..])
            .finish();
        let length = u32::from_ne_bytes(request[..4].try_into().expect("4 bytes")) as usize;
        assert_eq!(length, request.len());
        assert_eq!(u16::from_ne_bytes([request[4], request[5]]), 10 << 8 | 13);
        let found: Vec<(u16, Vec<u8>)> = attributes(&request[HEADER_LEN..])
            .map(|(kind, payload)| (kind, payload.to_vec()))
            .collect();
        assert_eq!(found[0], (1, b"cnibpf\0".to_vec()));
        assert_eq!(found[1].0, 3, "the nested flag is masked off");
        let inner: Vec<(u16, Vec<u8>)> = attributes(&found[1].1)
            .map(|(kind, payload)| (kind, payload.to_vec()))
            .collect();
        assert_eq!(inner, [(1, vec![1, 2, 3, 4, 5])]);
    }

    #[test]
    fn malformed_attributes_end_the_walk() {
        assert_eq!(
            attributes(&[8, 0, 1, 0, 1]).count(),
            0,
            "longer than the buffer"
        );
        assert_eq!(
            attributes(&[2, 0, 1, 0]).count(),
            0,
            "shorter than a header"
        );
        assert_eq!(attribute(&[5, 0, 7, 0, 9, 0, 0, 0], 7), Some(&[9][..]));
    }
}
