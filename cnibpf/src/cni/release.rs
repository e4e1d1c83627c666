//! Release-only mode: the entry `cnibpf uninstall` leaves in cnibpf's conflist, after the
//! restored network, while pods cnibpf set up remain (see `install`). New pods are the
//! restored network's: ADD passes the previous result on, CHECK and STATUS accept. DEL and GC
//! release attachments as ever, and the call that releases the last one removes the instance
//! whole — the datapath, its files, the conflist and the binary — so nothing of cnibpf is left
//! on the node and the runtime reads the primary's own file again.

use super::{Command, Env, error::Error};
use crate::{
    backend::purge,
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
            Ok(Some(output.to_string()))
        }
        Command::Check | Command::Status => {
            journal::network(&NetConf::parse(stdin)?.name);
            Ok(None)
        }
        Command::Del => {
            super::del(env, stdin)?;
            release_if_last(stdin, release)?;
            Ok(None)
        }
        Command::Gc => {
            super::gc(stdin)?;
            release_if_last(stdin, release)?;
            Ok(None)
        }
        Command::Version => unreachable!("answered before the mode is read"),
    }
}

/// Once no backend holds an attachment, removes the instance whole, then the conflist and the
/// binary the entry names (only files of those names: cnibpf's own conflist, a `cnibpf`
/// binary). Under the instance lock: an ADD cannot come between the look and the removal
/// (none would add anything in this mode, but a DEL of a retried pod could).
fn release_if_last(stdin: &[u8], release: &ReleaseOnly) -> Result<(), Error> {
    let conf = CleanupConf::parse(stdin)?;
    let pins = PinLayout::new(&conf.pin_path);
    let _lock = InstanceLock::acquire(&pins.lock_file(), lock_timeout())?;
    if purge::holds_attachments(&pins)? {
        return Ok(());
    }
    let mut removed = purge::purge(&pins)?;
    let conflist = release.file.as_deref().filter(|path| is_own_conflist(path));
    let binary = release
        .binary
        .as_deref()
        .filter(|path| path.file_name().is_some_and(|name| name == PLUGIN_NAME));
    for path in [conflist, binary].into_iter().flatten() {
        if purge::remove_file(path)? {
            removed.push(path.display().to_string());
        }
    }
    for item in removed {
        journal::note(journal::Change::Uninstalled(item));
    }
    Ok(())
}
