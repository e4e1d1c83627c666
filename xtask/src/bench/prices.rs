//! What the datapath's building blocks cost on this machine: a map lookup of each kind the
//! datapath makes, and each helper it calls per packet, timed by the kernel itself
//! (`BPF_PROG_TEST_RUN`) in small TC programs assembled here that repeat one operation in a
//! bounded loop; the price of one is the program's time less that of the same loop doing
//! nothing, over the loop's length. With the per-hook figures of `packets` they say where a
//! packet's time goes.
//!
//! The programs run on a copy of one TCP segment that is no clone, so a write into it never
//! un-clones it: what a write costs on a forwarded segment is at least this.

use std::{
    net::Ipv4Addr,
    os::fd::{AsRawFd as _, OwnedFd, RawFd},
};

use anyhow::{Context as _, Result};
use cnibpf_tests::raw_bpf::{bpf, instruction, load_classifier, owned};

use super::{Row, median};

/// Operations per program run.
const LOOPS: i32 = 64;
/// Runs per `BPF_PROG_TEST_RUN` (the kernel reports their mean), and test runs per price.
const REPEAT: u32 = 2_000;
const SAMPLES: usize = 9;

/// Entries of the maps priced, as the datapath's default sizes hold them full.
const FLOWS: u32 = 65_536;
const ENDPOINTS: u32 = 4_096;

/// `bpf(2)` commands, map and program types, helpers (uapi).
const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_PROG_TEST_RUN: libc::c_long = 10;
const BPF_MAP_TYPE_HASH: u32 = 1;
const BPF_MAP_TYPE_PERCPU_ARRAY: u32 = 6;
const BPF_MAP_TYPE_LRU_HASH: u32 = 9;
const MAP_LOOKUP_ELEM: i32 = 1;
const SKB_STORE_BYTES: i32 = 9;
const L3_CSUM_REPLACE: i32 = 10;
const L4_CSUM_REPLACE: i32 = 11;
const SKB_LOAD_BYTES: i32 = 26;
const FIB_LOOKUP: i32 = 69;
const REDIRECT_PEER: i32 = 155;
const GET_PRANDOM_U32: i32 = 7;
const KTIME_GET_COARSE_NS: i32 = 160;
const BPF_F_PSEUDO_HDR: i32 = 0x10;
const BPF_FIB_LOOKUP_SRC: i32 = 1 << 4;

/// Registers.
const R0: u8 = 0;
const R1: u8 = 1;
const R2: u8 = 2;
const R3: u8 = 3;
const R4: u8 = 4;
const R5: u8 = 5;
const R6: u8 = 6;
const R7: u8 = 7;
const R10: u8 = 10;

fn mov_imm(dst: u8, imm: i32) -> u64 {
    instruction(0xb7, dst, 0, 0, imm)
}
fn mov_reg(dst: u8, src: u8) -> u64 {
    instruction(0xbf, dst, src, 0, 0)
}
fn add_imm(dst: u8, imm: i32) -> u64 {
    instruction(0x07, dst, 0, 0, imm)
}
fn store_imm(off: i16, imm: i32) -> u64 {
    instruction(0x7a, R10, 0, off, imm)
}
fn call(helper: i32) -> u64 {
    instruction(0x85, 0, 0, 0, helper)
}
/// `dst = map` (two slots).
fn load_map(dst: u8, map: RawFd) -> [u64; 2] {
    [instruction(0x18, dst, 1, 0, map), 0]
}
/// `r2 = fp + off`.
fn stack_pointer(dst: u8, off: i32) -> [u64; 2] {
    [mov_reg(dst, R10), add_imm(dst, off)]
}

/// An Ethernet frame with an IPv4 TCP segment: 10.0.0.2:40000 → 10.0.0.1:80.
const SEGMENT: [u8; 54] = [
    2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 2, 0x08, 0x00, // Ethernet
    0x45, 0, 0, 40, 0, 1, 0x40, 0, 64, 6, 0, 0, 10, 0, 0, 2, 10, 0, 0, 1, // IPv4
    0x9c, 0x40, 0, 80, 0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x10, 0xff, 0xff, 0, 0, 0, 0, // TCP
];
/// Where the segment's source address and checksums are.
const IPV4_SADDR_OFF: i32 = 26;
const IPV4_CSUM_OFF: i32 = 24;
const TCP_CSUM_OFF: i32 = 50;
/// The source address as the program stores it: the bytes `10.0.0.2` read as a native u32.
const SADDR: i32 = i32::from_ne_bytes([10, 0, 0, 2]);

/// Maps the priced lookups read, full as the datapath's are at its default sizes.
struct Maps {
    endpoints: OwnedFd,
    flows: OwnedFd,
    scratch: OwnedFd,
}

impl Maps {
    fn create() -> Result<Self> {
        let endpoints = create_map(BPF_MAP_TYPE_HASH, 4, 48, ENDPOINTS)?;
        for index in 0..ENDPOINTS {
            update(&endpoints, &index.to_ne_bytes(), &[0; 48])?;
        }
        let flows = create_map(BPF_MAP_TYPE_LRU_HASH, 40, 64, FLOWS)?;
        for index in 0..FLOWS {
            update(&flows, &flow_key(index), &[0; 64])?;
        }
        let scratch = create_map(BPF_MAP_TYPE_PERCPU_ARRAY, 4, 256, 1)?;
        Ok(Self {
            endpoints,
            flows,
            scratch,
        })
    }
}

/// A 40-byte connection key (`ConnectionKey`'s size) told apart by `index`.
fn flow_key(index: u32) -> [u8; 40] {
    let mut key = [0; 40];
    key[..4].copy_from_slice(&index.to_ne_bytes());
    key
}

/// What each priced program does once per loop, with the stack it set up before the loop.
struct Operation {
    name: &'static str,
    setup: Vec<u64>,
    body: Vec<u64>,
    /// The operation whose time is taken off (the loop alone, or the same work without the
    /// part priced).
    net_of: usize,
}

/// The route the FIB lookup is priced on: a container's packet to the outside, as it enters
/// the host from the container's interface.
pub struct Route {
    pub interface: String,
    pub source: Ipv4Addr,
    pub destination: Ipv4Addr,
}

fn operations(maps: &Maps, route: &Route, input_ifindex: u32) -> Vec<Operation> {
    // The lookup keys at fp-48: the u32 or the 40-byte key of entry 7 (present), or of one
    // past the last (absent).
    let key = |index: i32| -> Vec<u64> {
        let mut setup = vec![store_imm(-48, index)];
        setup.extend((1..5).map(|word| store_imm(-48 + 8 * word, 0)));
        setup
    };
    let lookup = |map: &OwnedFd| -> Vec<u64> {
        let mut body = load_map(R1, map.as_raw_fd()).to_vec();
        body.extend(stack_pointer(R2, -48));
        body.push(call(MAP_LOOKUP_ELEM));
        body
    };
    // The key's first word: a random entry's index.
    let random_key = vec![
        call(GET_PRANDOM_U32),
        instruction(0x57, R0, 0, 0, (FLOWS - 1) as i32),
        instruction(0x63, R10, R0, -48, 0),
    ];
    let fib_params = {
        // struct bpf_fib_lookup at fp-64: AF_INET, TCP, tot_len 40, the input interface,
        // source and destination addresses, the rest zero.
        let mut setup: Vec<u64> = (0..8).map(|word| store_imm(-64 + 8 * word, 0)).collect();
        setup.push(instruction(0x72, R10, 0, -64, 2));
        setup.push(instruction(0x72, R10, 0, -63, 6));
        setup.push(instruction(0x6a, R10, 0, -58, 40));
        setup
    };
    let fib_body = {
        let mut body = vec![
            instruction(0x62, R10, 0, -56, input_ifindex as i32),
            instruction(0x62, R10, 0, -48, i32::from_ne_bytes(route.source.octets())),
            instruction(
                0x62,
                R10,
                0,
                -32,
                i32::from_ne_bytes(route.destination.octets()),
            ),
            mov_reg(R1, R6),
        ];
        body.extend(stack_pointer(R2, -64));
        body.extend([
            mov_imm(R3, 64),
            mov_imm(R4, BPF_FIB_LOOKUP_SRC),
            call(FIB_LOOKUP),
        ]);
        body
    };
    let csum = |helper: i32, off: i32, flags: i32| {
        vec![
            mov_reg(R1, R6),
            mov_imm(R2, off),
            mov_imm(R3, SADDR),
            mov_imm(R4, SADDR),
            mov_imm(R5, flags | 4),
            call(helper),
        ]
    };
    let mut store = vec![mov_reg(R1, R6), mov_imm(R2, IPV4_SADDR_OFF)];
    store.extend(stack_pointer(R3, -8));
    store.extend([mov_imm(R4, 4), mov_imm(R5, 0), call(SKB_STORE_BYTES)]);
    let mut load = vec![mov_reg(R1, R6), mov_imm(R2, 14)];
    load.extend(stack_pointer(R3, -64));
    load.extend([mov_imm(R4, 20), call(SKB_LOAD_BYTES)]);
    vec![
        Operation {
            name: "nothing (the loop alone)",
            setup: Vec::new(),
            body: vec![mov_imm(R0, 0)],
            net_of: 0,
        },
        Operation {
            name: "hash lookup, u32 key, 4,096 entries (endpoints, filters)",
            setup: key(7),
            body: lookup(&maps.endpoints),
            net_of: 0,
        },
        Operation {
            name: "LRU hash lookup, 40-byte key, 65,536 entries, found (a connection table)",
            setup: key(7),
            body: lookup(&maps.flows),
            net_of: 0,
        },
        Operation {
            name: "LRU hash lookup, 40-byte key, 65,536 entries, missing",
            setup: key(FLOWS as i32),
            body: lookup(&maps.flows),
            net_of: 0,
        },
        Operation {
            name: "a random key of the 65,536 (bpf_get_prandom_u32, stored)",
            setup: key(0),
            body: random_key.clone(),
            net_of: 0,
        },
        Operation {
            name: "LRU hash lookup, 40-byte key, a random one of 65,536 entries each time (caches cold)",
            setup: key(0),
            body: [random_key, lookup(&maps.flows)].concat(),
            // The operation just above: the random key alone.
            net_of: 4,
        },
        Operation {
            name: "per-CPU array lookup (a feature's scratch)",
            setup: vec![store_imm(-48, 0)],
            body: lookup(&maps.scratch),
            net_of: 0,
        },
        Operation {
            name: "bpf_ktime_get_coarse_ns",
            setup: Vec::new(),
            body: vec![call(KTIME_GET_COARSE_NS)],
            net_of: 0,
        },
        Operation {
            name: "bpf_skb_load_bytes, 20 bytes",
            setup: Vec::new(),
            body: load,
            net_of: 0,
        },
        Operation {
            name: "bpf_skb_store_bytes, 4 bytes (an address)",
            setup: vec![store_imm(-8, SADDR)],
            body: store,
            net_of: 0,
        },
        Operation {
            name: "bpf_l3_csum_replace, 4 bytes",
            setup: Vec::new(),
            body: csum(L3_CSUM_REPLACE, IPV4_CSUM_OFF, 0),
            net_of: 0,
        },
        Operation {
            name: "bpf_l4_csum_replace, 4 bytes of the pseudo-header",
            setup: Vec::new(),
            body: csum(L4_CSUM_REPLACE, TCP_CSUM_OFF, BPF_F_PSEUDO_HDR),
            net_of: 0,
        },
        Operation {
            name: "bpf_fib_lookup with source selection (a container's packet to the outside)",
            setup: fib_params,
            body: fib_body,
            net_of: 0,
        },
        Operation {
            name: "bpf_redirect_peer (records where; the kernel sends after the program)",
            setup: Vec::new(),
            body: vec![mov_imm(R1, 1), mov_imm(R2, 0), call(REDIRECT_PEER)],
            net_of: 0,
        },
    ]
}

/// The program: `r6 = skb; setup; r7 = LOOPS; do { body } while (--r7); return 0`.
fn program(operation: &Operation) -> Vec<u64> {
    let mut program = vec![mov_reg(R6, R1)];
    program.extend(&operation.setup);
    program.push(mov_imm(R7, LOOPS));
    program.extend(&operation.body);
    program.push(add_imm(R7, -1));
    let back = -(operation.body.len() as i16 + 2);
    program.push(instruction(0x55, R7, 0, back, 0));
    program.extend([mov_imm(R0, 0), instruction(0x95, 0, 0, 0, 0)]);
    program
}

/// One row per operation: its price in ns, net of the loop. Run in the namespace whose FIB
/// `route` is in.
pub fn rows(route: &Route) -> Result<Vec<Row>> {
    let input_ifindex = nix::net::if_::if_nametoindex(route.interface.as_str())
        .with_context(|| format!("no interface {}", route.interface))?;
    let maps = Maps::create().context("create the maps to price lookups in")?;
    let operations = operations(&maps, route, input_ifindex);
    let mut means = Vec::new();
    for operation in &operations {
        let program = load_classifier(&program(operation))
            .with_context(|| format!("load the program pricing {}", operation.name))?;
        let samples = (0..SAMPLES)
            .map(|_| {
                test_run(&program, &SEGMENT, REPEAT, None).map(|run| f64::from(run.duration_ns))
            })
            .collect::<Result<Vec<f64>>>()
            .with_context(|| format!("run the program pricing {}", operation.name))?;
        means.push(median(samples));
    }
    Ok(operations
        .iter()
        .zip(&means)
        .skip(1)
        .map(|(operation, mean)| Row {
            scenario: format!("price of one: {}", operation.name),
            metric: "time per call, BPF_PROG_TEST_RUN",
            unit: "ns",
            value: ((mean - means[operation.net_of]) / f64::from(LOOPS)).max(0.0),
            baseline: None,
        })
        .collect())
}

fn create_map(map_type: u32, key_size: u32, value_size: u32, entries: u32) -> Result<OwnedFd> {
    let mut attr = [0u8; 128];
    for (index, field) in [map_type, key_size, value_size, entries].iter().enumerate() {
        attr[index * 4..index * 4 + 4].copy_from_slice(&field.to_ne_bytes());
    }
    Ok(owned(
        bpf(BPF_MAP_CREATE, &mut attr).context("BPF_MAP_CREATE")?,
    )?)
}

fn update(map: &OwnedFd, key: &[u8], value: &[u8]) -> Result<()> {
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&(map.as_raw_fd() as u32).to_ne_bytes());
    attr[8..16].copy_from_slice(&(key.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(value.as_ptr() as u64).to_ne_bytes());
    bpf(BPF_MAP_UPDATE_ELEM, &mut attr).context("BPF_MAP_UPDATE_ELEM")?;
    Ok(())
}

/// What `BPF_PROG_TEST_RUN` answered.
pub(super) struct TestRun {
    /// The kernel's mean time of one run, in ns.
    pub duration_ns: u32,
    /// The program's return value (of its last run).
    pub verdict: i32,
    /// The packet as the (last) run left it.
    pub output: Vec<u8>,
}

/// Runs `program` `repeat` times on `packet`, with the `struct __sk_buff` fields `context` sets
/// (the interface it runs on).
pub(super) fn test_run(
    program: &OwnedFd,
    packet: &[u8],
    repeat: u32,
    context: Option<&[u8; SK_BUFF_SIZE]>,
) -> Result<TestRun> {
    let mut output = vec![0u8; packet.len() + 256];
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&(program.as_raw_fd() as u32).to_ne_bytes());
    attr[8..12].copy_from_slice(&(packet.len() as u32).to_ne_bytes());
    attr[12..16].copy_from_slice(&(output.len() as u32).to_ne_bytes());
    attr[16..24].copy_from_slice(&(packet.as_ptr() as u64).to_ne_bytes());
    attr[24..32].copy_from_slice(&(output.as_mut_ptr() as u64).to_ne_bytes());
    attr[32..36].copy_from_slice(&repeat.to_ne_bytes());
    if let Some(context) = context {
        attr[40..44].copy_from_slice(&(context.len() as u32).to_ne_bytes());
        attr[48..56].copy_from_slice(&(context.as_ptr() as u64).to_ne_bytes());
    }
    bpf(BPF_PROG_TEST_RUN, &mut attr).context("BPF_PROG_TEST_RUN")?;
    let word = |at: usize| attr[at..at + 4].try_into().expect("four bytes");
    output.truncate(u32::from_ne_bytes(word(12)) as usize);
    Ok(TestRun {
        duration_ns: u32::from_ne_bytes(word(36)),
        verdict: i32::from_ne_bytes(word(4)),
        output,
    })
}

/// `sizeof(struct __sk_buff)` (uapi), and where its `ifindex` is.
pub(super) const SK_BUFF_SIZE: usize = 192;
pub(super) const SK_BUFF_IFINDEX_OFF: usize = 40;
