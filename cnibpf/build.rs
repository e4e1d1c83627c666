//! Embeds the datapath object built by `cargo xtask build-ebpf`.

use std::{env, path::PathBuf};

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let object = match env::var_os("CNIBPF_EBPF_OBJECT") {
        Some(path) => PathBuf::from(path),
        None => manifest_dir.join("../target/bpfel-unknown-none/release/cnibpf"),
    };
    println!("cargo::rerun-if-env-changed=CNIBPF_EBPF_OBJECT");
    println!("cargo::rerun-if-changed={}", object.display());
    assert!(
        object.exists(),
        "the eBPF object {} does not exist: run `cargo xtask build-ebpf` first",
        object.display()
    );
    println!("cargo::rustc-env=CNIBPF_EBPF_OBJECT={}", object.display());
    // FNV-1a of the object: lets a new cnibpf notice programs pinned by another build.
    let bytes = std::fs::read(&object).expect("readable eBPF object");
    let id = bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    println!("cargo::rustc-env=CNIBPF_EBPF_OBJECT_ID={id}");
}
