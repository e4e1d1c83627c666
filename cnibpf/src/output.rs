//! Lines for people and runtimes on stdout and stderr. Written unbuffered and never with a
//! panic: `println!` and `eprintln!` panic when a write fails (a closed pipe, an interrupted or
//! refused call), which would turn a finished operation into a crash without its answer, and
//! a buffered line that failed would come out later, glued to the next.

use std::{io, os::fd::AsFd};

use nix::errno::Errno;

/// Writes `text` and a newline to `stream`. A write the kernel refuses for want of memory or
/// buffer space, or because the pipe is full, is tried again a few times: an answer or an
/// error report is all its reader gets.
pub fn write_line(stream: impl AsFd, text: &str) -> io::Result<()> {
    const ATTEMPTS: u32 = 4;
    let mut rest = format!("{text}\n").into_bytes();
    let mut refused = 0;
    while !rest.is_empty() {
        match nix::unistd::write(&stream, &rest) {
            Ok(written) => {
                rest.drain(..written);
            }
            Err(Errno::EINTR) => {}
            Err(Errno::EAGAIN | Errno::ENOMEM | Errno::ENOBUFS) if refused + 1 < ATTEMPTS => {
                refused += 1;
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            Err(errno) => return Err(errno.into()),
        }
    }
    Ok(())
}

/// A line on stdout that reports progress (not the answer a caller parses): one that cannot be
/// written is lost.
macro_rules! say {
    ($($argument:tt)*) => {{
        // fail-closed: a progress line lost changes nothing that was done.
        let _ = $crate::output::write_line(std::io::stdout(), &format!($($argument)*));
    }};
}

/// A line on stderr for whoever reads the log: one that cannot be written is lost.
macro_rules! log_line {
    ($($argument:tt)*) => {{
        // fail-closed: a log line lost changes nothing that was done.
        let _ = $crate::output::write_line(std::io::stderr(), &format!($($argument)*));
    }};
}

pub(crate) use {log_line, say};

/// An error with every cause under it, as one line (`could not read X: Permission denied`).
pub fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
