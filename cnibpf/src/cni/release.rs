//! Release-only mode: the entry `cnibpf uninstall` leaves in cnibpf's conflist, after the
//! restored network, while pods cnibpf set up remain (see `install`). New pods are the
//! restored network's: ADD passes the previous result on, CHECK and STATUS accept. DEL and GC
//! release attachments as ever, and the call that releases the last one removes the instance
//! whole — the datapath, its files, the conflist and the binary — so nothing of cnibpf is left
//! on the node and the runtime reads the primary's own file again.
//!
//! Runtimes differ in the configuration a DEL carries. containerd reads the conf dir again:
//! its DELs come through the release-only entry, and once cnibpf's conflist is gone, through
//! the primary's file alone. CRI-O and podman DEL with the configuration they cached at ADD:
//! a pod cnibpf set up comes back with cnibpf's ordinary entry (so the instance's release file,
//! `PinLayout::release_file`, tells that DEL the instance is being taken off), and a pod made
//! in release-only mode comes back through cnibpf's binary, which must then still be there.
//! So the release file also records the pods made in release-only mode, and when the last
//! attachment's DEL came with a cached ordinary entry, the binary stays until the last of
//! those pods is gone.

use super::{Command, Env, error::Error};
use crate::{
    backend::purge::{self, PassThrough, Pending},
    config::{CleanupConf, NetConf, ReleaseOnly},
    journal,
    lock::{InstanceLock, lock_timeout},
    paths::{PLUGIN_NAME, PinLayout, is_own_conflist},
};

pub fn dispatch(
    command: Command,
    env: &Env,
    stdin: &[u8],
    release: &ReleaseOnly,
) -> Result<Option<String>, Error> {
    match command {
        Command::Add => {
            let (_, _, output) = super::decode_add(stdin)?;
            settle(
                stdin,
                release,
                Change::Made(PassThrough {
                    container_id: env.container_id.clone(),
                    ifname: env.ifname.clone(),
                    netns: env.netns.clone(),
                }),
            )?;
            Ok(Some(output.to_string()))
        }
        Command::Check | Command::Status => {
            journal::network(&NetConf::parse(stdin)?.name);
            Ok(None)
        }
        Command::Del => {
            super::del(env, stdin)?;
            settle(
                stdin,
                release,
                Change::Removed {
                    container_id: env.container_id.clone(),
                    ifname: env.ifname.clone(),
                    cached_ordinary_entry: false,
                },
            )?;
            Ok(None)
        }
        Command::Gc => {
            super::gc(stdin)?;
            settle(stdin, release, Change::Collected)?;
            Ok(None)
        }
        Command::Version => unreachable!("answered before the mode is read"),
    }
}

/// After a DEL or GC through cnibpf's ordinary entry: when `cnibpf uninstall` left the
/// instance to its last DEL (its release file is there), the runtime passed the configuration
/// it cached at ADD; what release-only mode does then follows.
pub fn if_uninstalled(env: &Env, stdin: &[u8], command: Command) -> Result<(), Error> {
    let conf = CleanupConf::parse(stdin)?;
    let pins = PinLayout::new(&conf.pin_path);
    let Some(pending) = Pending::read(&pins)? else {
        return Ok(());
    };
    let change = match command {
        Command::Del => Change::Removed {
            container_id: env.container_id.clone(),
            ifname: env.ifname.clone(),
            cached_ordinary_entry: true,
        },
        _ => Change::Collected,
    };
    settle(stdin, &pending.release_only, change)
}

/// What a call in release-only mode (or through a cached ordinary entry) did.
enum Change {
    Made(PassThrough),
    Removed {
        container_id: String,
        ifname: String,
        /// The DEL came with cnibpf's ordinary entry although the instance is being taken off:
        /// its runtime DELs with the configuration it cached at ADD.
        cached_ordinary_entry: bool,
    },
    Collected,
}

/// Records `change` in the release file and, once no backend holds an attachment, removes the
/// instance whole, then the conflist and the binary the release names (only files of those
/// names: cnibpf's own conflist, a `cnibpf` binary) — the binary not while pods of a runtime
/// that DELs with cached configurations may still need it. Under the instance lock: a DEL
/// cannot come between the look and the removal.
fn settle(stdin: &[u8], release: &ReleaseOnly, change: Change) -> Result<(), Error> {
    let conf = CleanupConf::parse(stdin)?;
    let pins = PinLayout::new(&conf.pin_path);
    let _lock = InstanceLock::acquire(&pins.lock_file(), lock_timeout())?;
    let mut pending = Pending::read(&pins)?
        // fail-closed: an Option (errors went above): an uninstall of an older build wrote none.
        .unwrap_or_else(|| Pending::of(release));
    let mut cached = pending.binary_kept;
    match change {
        // Nothing is released by an ADD.
        Change::Made(pod) => {
            if !pending.pass_through.contains(&pod) {
                pending.pass_through.push(pod);
            }
            return Ok(pending.write(&pins)?);
        }
        Change::Removed {
            container_id,
            ifname,
            cached_ordinary_entry,
        } => {
            pending
                .pass_through
                .retain(|pod| pod.container_id != container_id || pod.ifname != ifname);
            cached |= cached_ordinary_entry;
        }
        Change::Collected => {}
    }
    if purge::holds_attachments(&pins)? {
        return Ok(pending.write(&pins)?);
    }
    let mut removed = purge::purge(&pins)?;
    let release = pending.release_only.clone();
    let conflist = release.file.as_deref().filter(|path| is_own_conflist(path));
    if let Some(path) = conflist
        && purge::remove_file(path)?
    {
        removed.push(path.display().to_string());
    }
    pending.pass_through.retain(PassThrough::lives);
    let binary = release
        .binary
        .as_deref()
        .filter(|path| path.file_name().is_some_and(|name| name == PLUGIN_NAME));
    match binary {
        Some(binary) if cached && !pending.pass_through.is_empty() => {
            pending.binary_kept = true;
            pending.write(&pins)?;
            removed.push(format!(
                "all but {}: {} pod(s) made while cnibpf was being uninstalled still name it in the configuration their runtime cached, and the last one's DEL removes it",
                binary.display(),
                pending.pass_through.len()
            ));
        }
        Some(binary) if purge::remove_file(binary)? => {
            removed.push(binary.display().to_string());
        }
        Some(_) | None => {}
    }
    for item in removed {
        journal::note(journal::Change::Uninstalled(item));
    }
    Ok(())
}
