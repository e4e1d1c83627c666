//! Where a CNI call's time goes: with `CNIBPF_PHASES=1` in its environment, the plugin prints one
//! line to stderr when it is done — `cnibpf: ADD phases (ms): decode 0.21, plan 0.31, …, total
//! 47.60` — the time from `main` to the first mark, then from each mark to the next (what the
//! process spends before `main` and after the report is the wall time less the total).
//! `cargo xtask bench portmap` reads it; a runtime never sets it, and then marking costs one
//! relaxed load.

use crate::output::log_line;
use std::{
    sync::{
        Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

/// The environment variable that turns the report on.
pub const ENV: &str = "CNIBPF_PHASES";

static ENABLED: AtomicBool = AtomicBool::new(false);
static SPENT: Mutex<Vec<(&'static str, Duration)>> = Mutex::new(Vec::new());
static LAST: Mutex<Option<Instant>> = Mutex::new(None);

/// Starts the clock when the report is asked for.
pub fn begin() {
    if std::env::var_os(ENV).is_none_or(|value| value != "1") {
        return;
    }
    ENABLED.store(true, Ordering::Relaxed);
    *lock(&LAST) = Some(Instant::now());
}

/// Ends the phase `name` here.
pub fn mark(name: &'static str) {
    if !ENABLED.load(Ordering::Relaxed) {
        return;
    }
    let now = Instant::now();
    let last = lock(&LAST).replace(now);
    if let Some(last) = last {
        record(name, now - last);
    }
}

/// Prints the report of `verb`, if it was asked for.
pub fn report(verb: &str) {
    if !ENABLED.load(Ordering::Relaxed) {
        return;
    }
    let spent = lock(&SPENT);
    let total: Duration = spent.iter().map(|(_, duration)| *duration).sum();
    let phases: Vec<String> = spent
        .iter()
        .map(|(name, duration)| format!("{name} {:.2}", duration.as_secs_f64() * 1e3))
        .collect();
    log_line!(
        "cnibpf: {verb} phases (ms): {}, total {:.2}",
        phases.join(", "),
        total.as_secs_f64() * 1e3
    );
}

fn record(name: &'static str, duration: Duration) {
    let mut spent = lock(&SPENT);
    match spent.iter_mut().find(|(held, _)| *held == name) {
        Some((_, total)) => *total += duration,
        None => spent.push((name, duration)),
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        // fail-closed: a poisoned lock of timings still holds timings.
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
