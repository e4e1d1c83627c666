//! Where the running kernel keeps the fields of a `struct net_device` the qdisc watcher reads
//! (its index, its network namespace's cookie), read from the kernel's own BTF
//! (`/sys/kernel/btf/vmlinux`): no fixed offset describes them across kernels, and the Rust
//! eBPF toolchain has no CO-RE relocations to do it at load. Only what that needs of the BTF
//! format is read: the header, and the struct and typedef types with their members.

use std::{io, path::Path};

/// The kernel's BTF.
pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

const MAGIC: u16 = 0xeb9f;
/// `BTF_KIND_*` the walk needs by name.
const KIND_STRUCT: u32 = 4;
const KIND_TYPEDEF: u32 = 8;

/// Byte offsets of what the qdisc watcher reads, as the loader sets them in its program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceOffsets {
    /// `struct net_device`'s `ifindex` (an `int`).
    pub ifindex: u32,
    /// `struct net_device`'s `nd_net.net` (a `struct net *`).
    pub namespace: u32,
    /// `struct net`'s `net_cookie` (a `u64`).
    pub namespace_cookie: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum KernelBtfError {
    #[error("could not read the kernel's BTF ({VMLINUX_BTF})")]
    Read(#[source] io::Error),
    #[error("the kernel's BTF is malformed: {0}")]
    Malformed(&'static str),
    #[error("the kernel's BTF has no {0}")]
    Missing(String),
}

/// The offsets in the running kernel.
pub fn device_offsets() -> Result<DeviceOffsets, KernelBtfError> {
    let bytes = std::fs::read(Path::new(VMLINUX_BTF)).map_err(KernelBtfError::Read)?;
    Btf::parse(&bytes)?.device_offsets()
}

/// One type: its kind, name and (for a struct or typedef) what it holds.
#[derive(Debug)]
struct Type {
    kind: u32,
    name: u32,
    /// A typedef's type.
    target: u32,
    /// A struct's members: (name, type, offset in bits).
    members: Vec<(u32, u32, u32)>,
}

#[derive(Debug)]
struct Btf<'a> {
    /// By id: `types[id - 1]` (id 0 is `void`).
    types: Vec<Type>,
    strings: &'a [u8],
}

fn word(bytes: &[u8], at: usize) -> Result<u32, KernelBtfError> {
    let slice = bytes
        .get(at..at + 4)
        .ok_or(KernelBtfError::Malformed("cut short"))?;
    Ok(u32::from_le_bytes([slice[0], slice[1], slice[2], slice[3]]))
}

impl<'a> Btf<'a> {
    fn parse(bytes: &'a [u8]) -> Result<Self, KernelBtfError> {
        let magic = bytes
            .get(0..2)
            .map(|magic| u16::from_le_bytes([magic[0], magic[1]]));
        if magic != Some(MAGIC) {
            return Err(KernelBtfError::Malformed(
                "no BTF magic (or not little-endian)",
            ));
        }
        let header_len = word(bytes, 4)? as usize;
        let (type_off, type_len) = (word(bytes, 8)? as usize, word(bytes, 12)? as usize);
        let (string_off, string_len) = (word(bytes, 16)? as usize, word(bytes, 20)? as usize);
        let section = |offset: usize, length: usize| {
            bytes
                .get(header_len + offset..header_len + offset + length)
                .ok_or(KernelBtfError::Malformed("a section past the end"))
        };
        let type_bytes = section(type_off, type_len)?;
        let strings = section(string_off, string_len)?;
        let mut types = Vec::new();
        let mut at = 0;
        while at < type_bytes.len() {
            let name = word(type_bytes, at)?;
            let info = word(type_bytes, at + 4)?;
            let size_or_type = word(type_bytes, at + 8)?;
            let kind = (info >> 24) & 0x1f;
            let count = (info & 0xffff) as usize;
            let kind_flag = info >> 31 != 0;
            at += 12;
            let mut members = Vec::new();
            let trailing = match kind {
                // INT, VAR, DECL_TAG
                1 | 14 | 17 => 4,
                // ARRAY
                3 => 12,
                // STRUCT, UNION
                4 | 5 => {
                    for member in 0..count {
                        let base = at + member * 12;
                        let offset = word(type_bytes, base + 8)?;
                        // With kind_flag, the low 24 bits are the offset, the rest a bitfield size.
                        let offset = if kind_flag {
                            offset & 0x00ff_ffff
                        } else {
                            offset
                        };
                        members.push((
                            word(type_bytes, base)?,
                            word(type_bytes, base + 4)?,
                            offset,
                        ));
                    }
                    count * 12
                }
                // ENUM, FUNC_PROTO
                6 | 13 => count * 8,
                // DATASEC, ENUM64
                15 | 19 => count * 12,
                // PTR, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC, FLOAT, TYPE_TAG
                2 | 7..=12 | 16 | 18 => 0,
                _ => return Err(KernelBtfError::Malformed("a type of unknown kind")),
            };
            at += trailing;
            types.push(Type {
                kind,
                name,
                target: size_or_type,
                members,
            });
        }
        Ok(Self { types, strings })
    }

    fn name(&self, offset: u32) -> &[u8] {
        // fail-closed: decoding a blob read whole; a name past the end is empty, no name.
        let rest = self.strings.get(offset as usize..).unwrap_or_default();
        // fail-closed: a name without its terminating zero ends with the section.
        let end = rest
            .iter()
            .position(|byte| *byte == 0)
            .unwrap_or(rest.len());
        &rest[..end]
    }

    fn by_id(&self, id: u32) -> Option<&Type> {
        self.types.get((id as usize).checked_sub(1)?)
    }

    /// The struct named `name`.
    fn find_struct(&self, name: &str) -> Result<&Type, KernelBtfError> {
        self.types
            .iter()
            .find(|ty| ty.kind == KIND_STRUCT && self.name(ty.name) == name.as_bytes())
            .ok_or_else(|| KernelBtfError::Missing(format!("struct {name}")))
    }

    /// The struct a member's type names, through typedefs.
    fn struct_of(&self, mut id: u32) -> Option<&Type> {
        for _ in 0..8 {
            let ty = self.by_id(id)?;
            match ty.kind {
                KIND_STRUCT => return Some(ty),
                KIND_TYPEDEF => id = ty.target,
                _ => return None,
            }
        }
        None
    }

    /// (type id, byte offset) of member `member` of `owner`, named `what` in errors.
    fn member(&self, owner: &Type, member: &str, what: &str) -> Result<(u32, u32), KernelBtfError> {
        owner
            .members
            .iter()
            .find(|(name, _, _)| self.name(*name) == member.as_bytes())
            .map(|(_, ty, bits)| (*ty, bits / 8))
            .ok_or_else(|| KernelBtfError::Missing(what.to_owned()))
    }

    fn device_offsets(&self) -> Result<DeviceOffsets, KernelBtfError> {
        let device = self.find_struct("net_device")?;
        let (_, ifindex) = self.member(device, "ifindex", "net_device.ifindex")?;
        let (possible_net, nd_net) = self.member(device, "nd_net", "net_device.nd_net")?;
        let holder = self
            .struct_of(possible_net)
            .ok_or_else(|| KernelBtfError::Missing("the type of net_device.nd_net".to_owned()))?;
        let (_, net) = self.member(holder, "net", "possible_net_t.net (CONFIG_NET_NS)")?;
        let namespace = self.find_struct("net")?;
        let (_, cookie) = self.member(namespace, "net_cookie", "net.net_cookie")?;
        Ok(DeviceOffsets {
            ifindex,
            namespace: nd_net + net,
            namespace_cookie: cookie,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A BTF blob of `types` (raw words) and `strings`.
    fn blob(types: &[u32], strings: &[u8]) -> Vec<u8> {
        let type_bytes: Vec<u8> = types.iter().flat_map(|word| word.to_le_bytes()).collect();
        let mut out = Vec::new();
        out.extend(MAGIC.to_le_bytes());
        out.extend([1, 0]);
        for word in [
            24,
            0,
            type_bytes.len() as u32,
            type_bytes.len() as u32,
            strings.len() as u32,
        ] {
            out.extend(word.to_le_bytes());
        }
        out.extend(type_bytes);
        out.extend(strings);
        out
    }

    #[test]
    fn offsets_are_read_through_the_typedef_of_the_namespace() {
        // Names: 1 "net_device", 12 "ifindex", 20 "nd_net", 27 "possible_net_t", 42 "net",
        // 46 "net_cookie", 57 "int".
        let strings = b"\0net_device\0ifindex\0nd_net\0possible_net_t\0net\0net_cookie\0int\0";
        let struct_info = |members: u32| (KIND_STRUCT << 24) | members;
        #[rustfmt::skip]
        let types = [
            // 1: int
            57, 1 << 24, 4, 32,
            // 2: struct net_device { int ifindex @ 0x100 bytes; possible_net_t nd_net @ 0x280 }
            1, struct_info(2), 0x400, 12, 1, 0x100 * 8, 20, 3, 0x280 * 8,
            // 3: typedef possible_net_t -> 4
            27, KIND_TYPEDEF << 24, 4,
            // 4: struct { struct net *net @ 0 }
            0, struct_info(1), 8, 42, 6, 0,
            // 5: struct net { u64 net_cookie @ 0x78 }
            42, struct_info(1), 0x100, 46, 1, 0x78 * 8,
            // 6: pointer to 5
            0, 2 << 24, 5,
        ];
        let bytes = blob(&types, strings);
        let offsets = Btf::parse(&bytes)
            .expect("parses")
            .device_offsets()
            .expect("finds them");
        assert_eq!(
            offsets,
            DeviceOffsets {
                ifindex: 0x100,
                namespace: 0x280,
                namespace_cookie: 0x78,
            }
        );
    }

    #[test]
    fn what_is_not_btf_is_refused() {
        assert!(Btf::parse(b"not btf at all, no").is_err());
        assert!(Btf::parse(&[0x9f, 0xeb, 1, 0]).is_err(), "cut short");
    }

    #[test]
    fn the_running_kernels_btf_has_them() {
        match std::fs::read(VMLINUX_BTF) {
            Ok(bytes) => {
                let offsets = Btf::parse(&bytes)
                    .expect("the kernel's BTF parses")
                    .device_offsets()
                    .expect("net_device and net are described");
                assert!(offsets.ifindex > 0 && offsets.namespace > 0, "{offsets:?}");
            }
            // A machine without kernel BTF (a build host): the blob tests above hold.
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => panic!("read {VMLINUX_BTF}: {error}"),
        }
    }
}
