//! One plugin invocation as libcni makes it: the binary found in `CNI_PATH`, the CNI
//! environment and nothing else of ours, started inside the host's network namespace, its
//! configuration on stdin.

use std::{
    io::Write as _,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use super::{Attachment, PluginOutput};

/// Runs the plugin `plugin_type` from `cni_path` in `host_netns` with raw stdin.
pub fn invoke_plugin(
    cni_path: &str,
    host_netns: &Path,
    plugin_type: &str,
    command: &str,
    attachment: Option<&Attachment>,
    stdin: &str,
) -> PluginOutput {
    let process = plugin_command(cni_path, host_netns, plugin_type, command, attachment);
    run_with_stdin(process, plugin_type, command, stdin)
}

/// The process of one plugin invocation, with the CNI environment and nothing else of ours,
/// for callers that add or remove variables before running it.
pub fn plugin_command(
    cni_path: &str,
    host_netns: &Path,
    plugin_type: &str,
    command: &str,
    attachment: Option<&Attachment>,
) -> Command {
    let mut process = plugin_process(cni_path, plugin_type, command, attachment);
    enter_netns_on_exec(&mut process, host_netns);
    process
}

/// [`plugin_command`] without entering a namespace on exec: the plugin starts where the
/// spawning thread is, and is spawned as a runtime spawns it — `posix_spawn`, which shares
/// the spawner's memory until the exec instead of copying its page tables (what Go's
/// `os/exec` does for containerd; a `pre_exec` step forces a full fork).
pub fn plugin_process(
    cni_path: &str,
    plugin_type: &str,
    command: &str,
    attachment: Option<&Attachment>,
) -> Command {
    let mut process = Command::new(plugin_binary(cni_path, plugin_type));
    set_plugin_environment(&mut process, cni_path, command, attachment);
    process
}

/// The binary of plugin `plugin_type` in `cni_path`.
pub fn plugin_binary(cni_path: &str, plugin_type: &str) -> PathBuf {
    cni_path
        .split(':')
        .map(|dir| Path::new(dir).join(plugin_type))
        .find(|path| path.exists())
        .unwrap_or_else(|| panic!("plugin {plugin_type} not found in {cni_path}"))
}

/// The CNI environment of one invocation and nothing else of ours, with piped stdio.
pub(super) fn set_plugin_environment(
    process: &mut Command,
    cni_path: &str,
    command: &str,
    attachment: Option<&Attachment>,
) {
    process
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("CNI_COMMAND", command)
        .env("CNI_PATH", cni_path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(attachment) = attachment {
        process
            .env("CNI_CONTAINERID", &attachment.container_id)
            .env("CNI_IFNAME", &attachment.ifname)
            .env("CNI_NETNS", &attachment.netns);
        if !attachment.cni_args.is_empty() {
            process.env("CNI_ARGS", &attachment.cni_args);
        }
    }
}

/// Makes `process` start inside `netns` (network namespace only).
pub fn enter_netns_on_exec(process: &mut Command, netns: &Path) {
    let netns = std::fs::File::open(netns)
        .unwrap_or_else(|error| panic!("open {}: {error}", netns.display()));
    // SAFETY: between fork and exec the closure only calls setns(2), which is async-signal-safe,
    // on a descriptor opened before the fork.
    unsafe {
        process.pre_exec(move || {
            use std::os::fd::AsFd as _;
            nix::sched::setns(netns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(std::io::Error::from)
        });
    }
}

pub fn run_with_stdin(
    mut process: Command,
    plugin: &str,
    command: &str,
    stdin: &str,
) -> PluginOutput {
    let what = format!("{plugin} {command}");
    let mut child = process
        .spawn()
        .unwrap_or_else(|error| panic!("could not start {what}: {error}"));
    let written = child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(stdin.as_bytes());
    // A plugin may exit before reading its configuration; what it printed still tells why.
    if let Err(error) = written
        && error.kind() != std::io::ErrorKind::BrokenPipe
    {
        panic!("could not write stdin of {what}: {error}");
    }
    let output = child
        .wait_with_output()
        .unwrap_or_else(|error| panic!("could not wait for {what}: {error}"));
    PluginOutput {
        plugin: plugin.to_owned(),
        command: command.to_owned(),
        exit_code: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// Makes `bpf(2)` fail with `errno` in the process `command` starts, as on a kernel without
/// BPF or in a sandbox that denies it (x86_64 syscall table).
pub fn deny_bpf_syscall(command: &mut Command, errno: i32) {
    use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};
    let rules = [(libc::SYS_bpf, Vec::new())].into_iter().collect();
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(u32::try_from(errno).expect("positive errno")),
        TargetArch::x86_64,
    )
    .expect("valid seccomp filter");
    let program: BpfProgram = filter.try_into().expect("compilable seccomp filter");
    // SAFETY: between fork and exec the closure only calls prctl(2)/seccomp(2) on a program
    // compiled before the fork; it allocates nothing.
    unsafe {
        command.pre_exec(move || {
            seccompiler::apply_filter(&program)
                .map_err(|error| std::io::Error::other(error.to_string()))
        });
    }
}
