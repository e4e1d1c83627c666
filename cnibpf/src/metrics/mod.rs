//! `cnibpf metrics --listen ADDR` (and `cnibpf install --watch --listen ADDR`): Prometheus
//! metrics, `/healthz` and `/readyz` over HTTP. Everything is read from the kernel and the call
//! statistics file at the moment it is asked for — pinned maps, nft counters, conntrack's fill —
//! so the exporter keeps no state that a restart could lose or that could drift from the
//! datapath.

mod collect;
mod encode;
mod health;

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
};

use axum::{
    Router,
    extract::State,
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};

use crate::{model::BackendChoice, output::say, paths::PinLayout};

pub use self::health::BinaryCheck;

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("could not listen on {address}")]
    Listen {
        address: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("could not serve HTTP")]
    Serve(#[source] std::io::Error),
}

/// What the exporter looks at.
#[derive(Debug)]
pub struct Exporter {
    pub pins: PinLayout,
    pub conf_dir: PathBuf,
    pub bin_dir: PathBuf,
    /// The network cnibpf must be chained into; the runtime's (the first file) when `None`.
    pub network: Option<String>,
    /// The backend the network's entry asks for, for readiness.
    pub backend: BackendChoice,
    /// The installed binary last found identical to this one (hashing it on every probe
    /// would read megabytes every few seconds).
    pub binary_check: Mutex<BinaryCheck>,
}

/// Serves the exporter on `address` until SIGTERM or SIGINT.
pub fn serve(address: SocketAddr, exporter: Exporter) -> Result<(), MetricsError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(MetricsError::Serve)?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(address)
            .await
            .map_err(|source| MetricsError::Listen { address, source })?;
        // fail-closed: the address bound, for the message; the configured one otherwise.
        let bound = listener.local_addr().unwrap_or(address);
        say!("serving /metrics, /healthz and /readyz on http://{bound}");
        axum::serve(listener, router(Arc::new(exporter)))
            .with_graceful_shutdown(terminated())
            .await
            .map_err(MetricsError::Serve)
    })
}

/// Serves the exporter on `address` from a thread of its own, for as long as the process
/// runs (`install --watch`, whose own loop takes the signals).
pub fn serve_in_background(address: SocketAddr, exporter: Exporter) -> Result<(), MetricsError> {
    // Bound here, so that a port in use fails the command rather than a thread.
    let listener = std::net::TcpListener::bind(address)
        .and_then(|listener| listener.set_nonblocking(true).map(|()| listener))
        .map_err(|source| MetricsError::Listen { address, source })?;
    // fail-closed: the address bound, for the message; the configured one otherwise.
    let bound = listener.local_addr().unwrap_or(address);
    say!("serving /metrics, /healthz and /readyz on http://{bound}");
    std::thread::Builder::new()
        .name("metrics".to_owned())
        .spawn(move || {
            let served = tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .build()
                .and_then(|runtime| {
                    runtime.block_on(async move {
                        let listener = tokio::net::TcpListener::from_std(listener)?;
                        axum::serve(listener, router(Arc::new(exporter))).await
                    })
                });
            if let Err(error) = served {
                crate::output::log_line!("cnibpf: the metrics endpoint stopped: {error}");
            }
        })
        .map(drop)
        .map_err(MetricsError::Serve)
}

fn router(exporter: Arc<Exporter>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(exporter)
}

async fn terminated() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut terminate), Ok(mut interrupt)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // fail-closed: without signal handlers the default action still ends the process.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = terminate.recv() => {}
        _ = interrupt.recv() => {}
    }
}

/// Runs `work` on the blocking pool: every answer reads the kernel with blocking calls.
async fn blocking<T: Send + 'static>(
    exporter: Arc<Exporter>,
    work: impl FnOnce(&Exporter) -> T + Send + 'static,
) -> Result<T, tokio::task::JoinError> {
    tokio::task::spawn_blocking(move || work(&exporter)).await
}

/// The answer when the work behind it died.
fn failed(error: &tokio::task::JoinError) -> Response {
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        format!("the answer failed: {error}\n"),
    )
        .into_response()
}

/// `/metrics`: OpenMetrics when the client asks for it (Prometheus does), else Prometheus'
/// text format 0.0.4.
async fn metrics(State(exporter): State<Arc<Exporter>>, headers: HeaderMap) -> Response {
    let openmetrics = headers
        .get_all(header::ACCEPT)
        .iter()
        // fail-closed: a header that is not text asks for no format we know.
        .filter_map(|value| value.to_str().ok())
        .any(|accepted| accepted.contains("application/openmetrics-text"));
    match blocking(exporter, collect::snapshot).await {
        Ok(snapshot) => match encode::text(snapshot, !openmetrics) {
            Ok(text) => (
                [(
                    header::CONTENT_TYPE,
                    if openmetrics {
                        "application/openmetrics-text; version=1.0.0; charset=utf-8"
                    } else {
                        "text/plain; version=0.0.4; charset=utf-8"
                    },
                )],
                text,
            )
                .into_response(),
            Err(error) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("could not encode the metrics: {error}\n"),
            )
                .into_response(),
        },
        Err(error) => failed(&error),
    }
}

async fn healthz(State(exporter): State<Arc<Exporter>>) -> Response {
    match blocking(exporter, health::healthy).await {
        Ok(Ok(())) => (StatusCode::OK, "ok\n").into_response(),
        Ok(Err(reason)) => (StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")).into_response(),
        Err(error) => failed(&error),
    }
}

async fn readyz(State(exporter): State<Arc<Exporter>>) -> Response {
    match blocking(exporter, health::readiness).await {
        Ok(checks) => {
            // fail-closed: ready only when every check passed.
            let ready = checks.iter().all(|check| check.outcome.is_ok());
            let text: String = checks
                .iter()
                .map(|check| match &check.outcome {
                    Ok(()) => format!("ok {}\n", check.name),
                    Err(reason) => format!("not ready {}: {reason}\n", check.name),
                })
                .collect();
            let status = if ready {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            (status, text).into_response()
        }
        Err(error) => failed(&error),
    }
}
