//! The kernel functions (kfuncs) the datapath calls, declared in the object's BTF.
//!
//! A BPF program calls a kfunc through an undefined symbol that the loader resolves against
//! the kernel's BTF, by the function's BTF entry in the object's `.ksyms` section (aya-obj and
//! libbpf alike). rustc emits no debug information for an `extern` declaration, so bpf-linker
//! leaves the symbol without that entry: this step adds it after the build — a `FUNC_PROTO`,
//! an extern `FUNC` and the `.ksyms` `DATASEC` for every kfunc the object calls — with the
//! prototype from [`KFUNCS`]. An object that calls a kernel function this table does not know
//! fails the build; one that already has its `.ksyms` section is left as it is.

use std::path::Path;

use anyhow::{Context as _, Result, bail, ensure};

/// What a kfunc's argument or result is, as far as the loader compares it with the kernel's
/// prototype: the kind of each type (a pointer to a struct, an integer), not its name.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Void,
    U32,
    /// A pointer to the named struct.
    StructPointer(&'static str),
}

/// A kernel function the datapath calls: its name, result, and parameters (name, kind). The
/// parameter names are the kernel's (a `__sz` suffix tells the verifier which size goes with
/// the memory argument before it; the kernel reads its own BTF for that, these are for people).
struct Kfunc {
    name: &'static str,
    returns: Kind,
    parameters: &'static [(&'static str, Kind)],
}

/// Conntrack's kfuncs (net/netfilter/nf_conntrack_bpf.c): the datapath asks the node's
/// netfilter about a packet's connection.
const KFUNCS: &[Kfunc] = &[
    Kfunc {
        name: "bpf_skb_ct_lookup",
        returns: Kind::StructPointer("nf_conn"),
        parameters: &[
            ("skb_ctx", Kind::StructPointer("__sk_buff")),
            ("bpf_tuple", Kind::StructPointer("bpf_sock_tuple")),
            ("tuple__sz", Kind::U32),
            ("opts", Kind::StructPointer("bpf_ct_opts")),
            ("opts__sz", Kind::U32),
        ],
    },
    Kfunc {
        name: "bpf_ct_release",
        returns: Kind::Void,
        parameters: &[("nfct", Kind::StructPointer("nf_conn"))],
    },
];

const BTF_KIND_INT: u32 = 1;
const BTF_KIND_PTR: u32 = 2;
const BTF_KIND_STRUCT: u32 = 4;
const BTF_KIND_FUNC: u32 = 12;
const BTF_KIND_FUNC_PROTO: u32 = 13;
const BTF_KIND_DATASEC: u32 = 15;
const BTF_FUNC_EXTERN: u32 = 2;
const BTF_HEADER_LEN: usize = 24;
const SECTION_HEADER_LEN: usize = 64;
const SYMBOL_LEN: usize = 24;

/// Adds the `.ksyms` declarations of the kfuncs `object` calls, in place; what it declared.
pub fn declare(object: &Path) -> Result<Vec<&'static str>> {
    let mut elf = std::fs::read(object).with_context(|| format!("read {}", object.display()))?;
    let sections = Sections::read(&elf)?;
    let called = undefined_symbols(&elf, &sections)?;
    if called.is_empty() {
        return Ok(Vec::new());
    }
    let kfuncs = called
        .iter()
        .map(|name| {
            KFUNCS
                .iter()
                .find(|kfunc| kfunc.name == name)
                .with_context(|| {
                    format!("the datapath calls {name}, a kernel function xtask/src/ksyms.rs does not declare")
                })
        })
        .collect::<Result<Vec<_>>>()?;
    let btf_section = sections.named(&elf, ".BTF")?;
    let mut btf = Btf::parse(sections.data(&elf, btf_section))?;
    if btf.has_datasec(".ksyms")? {
        return Ok(Vec::new());
    }
    let declared = btf.declare(&kfuncs);
    let bytes = btf.to_bytes();
    // The new section goes at the end of the file, its header pointed at it; the old bytes
    // stay where they were, unreferenced.
    while !elf.len().is_multiple_of(8) {
        elf.push(0);
    }
    let offset = elf.len() as u64;
    elf.extend_from_slice(&bytes);
    let header = sections.header_offset(btf_section);
    elf[header + 24..header + 32].copy_from_slice(&offset.to_le_bytes());
    elf[header + 32..header + 40].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
    std::fs::write(object, &elf).with_context(|| format!("write {}", object.display()))?;
    Ok(declared)
}

/// The section header table of a little-endian ELF64 object.
struct Sections {
    offset: usize,
    count: usize,
    names: usize,
}

impl Sections {
    fn read(elf: &[u8]) -> Result<Self> {
        ensure!(
            elf.len() > 64 && elf[..4] == *b"\x7fELF" && elf[4] == 2 && elf[5] == 1,
            "not a little-endian ELF64 object"
        );
        let sections = Self {
            offset: u64_at(elf, 0x28)? as usize,
            count: usize::from(u16_at(elf, 0x3c)?),
            names: usize::from(u16_at(elf, 0x3e)?),
        };
        ensure!(
            usize::from(u16_at(elf, 0x3a)?) == SECTION_HEADER_LEN,
            "unexpected section header size"
        );
        Ok(sections)
    }

    fn header_offset(&self, index: usize) -> usize {
        self.offset + index * SECTION_HEADER_LEN
    }

    fn data<'a>(&self, elf: &'a [u8], index: usize) -> &'a [u8] {
        let header = self.header_offset(index);
        let (offset, size) = (
            u64_at(elf, header + 24).unwrap_or(0) as usize,
            u64_at(elf, header + 32).unwrap_or(0) as usize,
        );
        elf.get(offset..offset + size).unwrap_or_default()
    }

    fn name<'a>(&self, elf: &'a [u8], index: usize) -> Result<&'a str> {
        let name = u32_at(elf, self.header_offset(index))? as usize;
        c_string(self.data(elf, self.names), name)
    }

    fn named(&self, elf: &[u8], wanted: &str) -> Result<usize> {
        for index in 0..self.count {
            if self.name(elf, index)? == wanted {
                return Ok(index);
            }
        }
        bail!("the object has no {wanted} section")
    }
}

/// The names of the object's undefined symbols: the kernel functions it calls.
fn undefined_symbols(elf: &[u8], sections: &Sections) -> Result<Vec<String>> {
    let symbols = sections.named(elf, ".symtab")?;
    let names = u32_at(elf, sections.header_offset(symbols) + 40)? as usize;
    let (table, strings) = (sections.data(elf, symbols), sections.data(elf, names));
    let mut undefined = Vec::new();
    for symbol in table.as_chunks::<SYMBOL_LEN>().0.iter().skip(1) {
        let name = c_string(strings, u32_at(symbol, 0)? as usize)?;
        if u16_at(symbol, 6)? == 0 && !name.is_empty() {
            undefined.push(name.to_owned());
        }
    }
    Ok(undefined)
}

/// BTF: its header's flags, its types (raw) and strings; new types and strings are appended.
struct Btf {
    flags: u8,
    types: Vec<u8>,
    strings: Vec<u8>,
    type_count: u32,
}

impl Btf {
    fn parse(bytes: &[u8]) -> Result<Self> {
        ensure!(u16_at(bytes, 0)? == 0xeb9f, ".BTF has no BTF magic");
        let header_len = u32_at(bytes, 4)? as usize;
        let (types_at, types_len) = (u32_at(bytes, 8)? as usize, u32_at(bytes, 12)? as usize);
        let (strings_at, strings_len) = (u32_at(bytes, 16)? as usize, u32_at(bytes, 20)? as usize);
        let slice = |at: usize, len: usize| {
            bytes
                .get(header_len + at..header_len + at + len)
                .context(".BTF shorter than its header says")
        };
        let mut btf = Self {
            flags: bytes[3],
            types: slice(types_at, types_len)?.to_vec(),
            strings: slice(strings_at, strings_len)?.to_vec(),
            type_count: 0,
        };
        btf.type_count = btf.types().count() as u32;
        Ok(btf)
    }

    /// Each type's (kind, name offset, vlen, byte offset).
    fn types(&self) -> impl Iterator<Item = (u32, u32, usize, usize)> + '_ {
        let mut at = 0;
        std::iter::from_fn(move || {
            let name = u32_at(&self.types, at).ok()?;
            let info = u32_at(&self.types, at + 4).ok()?;
            let (kind, vlen) = ((info >> 24) & 0x1f, (info & 0xffff) as usize);
            let start = at;
            at += 12 + trailing_len(kind, vlen);
            Some((kind, name, vlen, start))
        })
    }

    fn has_datasec(&self, name: &str) -> Result<bool> {
        for (kind, name_offset, _, _) in self.types() {
            if kind == BTF_KIND_DATASEC && c_string(&self.strings, name_offset as usize)? == name {
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn string(&mut self, text: &str) -> u32 {
        let offset = self.strings.len() as u32;
        self.strings.extend_from_slice(text.as_bytes());
        self.strings.push(0);
        offset
    }

    /// Appends a type; its id.
    fn add(&mut self, name: u32, kind: u32, vlen: usize, size_or_type: u32, extra: &[u32]) -> u32 {
        let info = (kind << 24) | vlen as u32;
        for word in [name, info, size_or_type].iter().chain(extra) {
            self.types.extend_from_slice(&word.to_le_bytes());
        }
        self.type_count += 1;
        self.type_count
    }

    fn kind_type(&mut self, kind: Kind) -> u32 {
        match kind {
            Kind::Void => 0,
            Kind::U32 => {
                let name = self.string("unsigned int");
                self.add(name, BTF_KIND_INT, 0, 4, &[32])
            }
            Kind::StructPointer(name) => {
                let name = self.string(name);
                let target = self.add(name, BTF_KIND_STRUCT, 0, 0, &[]);
                self.add(0, BTF_KIND_PTR, 0, target, &[])
            }
        }
    }

    /// Declares `kfuncs` as extern functions in a `.ksyms` section; their names.
    fn declare(&mut self, kfuncs: &[&Kfunc]) -> Vec<&'static str> {
        let mut functions = Vec::new();
        for kfunc in kfuncs {
            let returns = self.kind_type(kfunc.returns);
            let mut parameters = Vec::new();
            for (name, kind) in kfunc.parameters {
                let name = self.string(name);
                let kind = self.kind_type(*kind);
                parameters.extend([name, kind]);
            }
            let prototype = self.add(
                0,
                BTF_KIND_FUNC_PROTO,
                kfunc.parameters.len(),
                returns,
                &parameters,
            );
            let name = self.string(kfunc.name);
            functions.push(self.add(
                name,
                BTF_KIND_FUNC,
                BTF_FUNC_EXTERN as usize,
                prototype,
                &[],
            ));
        }
        let entries: Vec<u32> = functions.iter().flat_map(|id| [*id, 0, 0]).collect();
        let name = self.string(".ksyms");
        self.add(name, BTF_KIND_DATASEC, functions.len(), 0, &entries);
        kfuncs.iter().map(|kfunc| kfunc.name).collect()
    }

    fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(BTF_HEADER_LEN + self.types.len() + self.strings.len());
        bytes.extend_from_slice(&0xeb9f_u16.to_le_bytes());
        bytes.extend_from_slice(&[1, self.flags]);
        for word in [
            BTF_HEADER_LEN as u32,
            0,
            self.types.len() as u32,
            self.types.len() as u32,
            self.strings.len() as u32,
        ] {
            bytes.extend_from_slice(&word.to_le_bytes());
        }
        bytes.extend_from_slice(&self.types);
        bytes.extend_from_slice(&self.strings);
        bytes
    }
}

/// The bytes that follow a type's common 12 bytes, by kind (the kernel's `btf_type_size`).
fn trailing_len(kind: u32, vlen: usize) -> usize {
    match kind {
        // int, var, decl tag: one word.
        1 | 14 | 17 => 4,
        // array
        3 => 12,
        // struct, union, datasec: a member or variable is three words; enum64 too.
        4 | 5 | 15 | 19 => 12 * vlen,
        // enum, func proto: two words each.
        6 | 13 => 8 * vlen,
        _ => 0,
    }
}

fn c_string(bytes: &[u8], at: usize) -> Result<&str> {
    let tail = bytes.get(at..).context("string offset out of range")?;
    let end = tail
        .iter()
        .position(|byte| *byte == 0)
        .unwrap_or(tail.len());
    std::str::from_utf8(&tail[..end]).context("a name that is not UTF-8")
}

fn u16_at(bytes: &[u8], at: usize) -> Result<u16> {
    Ok(u16::from_le_bytes(
        bytes.get(at..at + 2).context("truncated")?.try_into()?,
    ))
}

fn u32_at(bytes: &[u8], at: usize) -> Result<u32> {
    Ok(u32::from_le_bytes(
        bytes.get(at..at + 4).context("truncated")?.try_into()?,
    ))
}

fn u64_at(bytes: &[u8], at: usize) -> Result<u64> {
    Ok(u64::from_le_bytes(
        bytes.get(at..at + 8).context("truncated")?.try_into()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declared_kfuncs_are_extern_functions_of_a_ksyms_section() {
        let mut btf = Btf {
            flags: 0,
            types: Vec::new(),
            strings: vec![0],
            type_count: 0,
        };
        let kfuncs: Vec<&Kfunc> = KFUNCS.iter().collect();
        assert_eq!(
            btf.declare(&kfuncs),
            ["bpf_skb_ct_lookup", "bpf_ct_release"]
        );
        let reparsed = Btf::parse(&btf.to_bytes()).expect("parses back");
        assert_eq!(reparsed.type_count, btf.type_count);
        assert!(reparsed.has_datasec(".ksyms").expect("names readable"));
        let functions: Vec<_> = reparsed
            .types()
            .filter(|(kind, ..)| *kind == BTF_KIND_FUNC)
            .map(|(_, name, vlen, _)| (c_string(&reparsed.strings, name as usize).unwrap(), vlen))
            .collect();
        assert_eq!(
            functions,
            [("bpf_skb_ct_lookup", 2), ("bpf_ct_release", 2)],
            "extern linkage is the FUNC's vlen"
        );
    }
}
