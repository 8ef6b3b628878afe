//! The metrics and health listener of the manager, the gateway and the agent: plain HTTP on the
//! address of the binary's `[metrics] listen` key (no section, no listener), serving
//!
//! - `GET /metrics`: the binary's [`Registry`] in the Prometheus text format, encoded by
//!   `prometheus-client` (the [`Exporter`] first brings its scrape-time gauges up to date);
//! - `GET /healthz`: `200 ok` while the process serves (liveness, for systemd and load balancers);
//! - `GET /readyz`: `200 ready`, or `503` with the reason when the [`Exporter`] says the binary
//!   cannot do its work (the manager: its store does not answer).
//!
//! The listener has no TLS and no authentication, like most Prometheus targets: the site keeps it
//! on loopback or behind its firewall. Once bound, the binary prints `metrics on ADDR` on stdout
//! (after its `listening on ADDR`, if it prints one), so tests and scripts learn a port 0's port.

use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use anyhow::Context as _;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// The `[metrics]` section of a binary's config.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// Where `/metrics`, `/healthz` and `/readyz` are served, over plain HTTP without
    /// authentication: a loopback address, or one only the site's Prometheus can reach.
    pub listen: SocketAddr,
}

/// A boxed future of an [`Exporter`].
pub type ExporterFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What one binary exports.
pub trait Exporter: Send + Sync + 'static {
    /// Every metric of the binary, registered once.
    fn registry(&self) -> &Registry;

    /// Brings the gauges computed at scrape time (counts read from a store) up to date; called
    /// before each encoding of [`Exporter::registry`].
    fn refresh(&self) -> ExporterFuture<'_, ()> {
        Box::pin(std::future::ready(()))
    }

    /// `Err(reason)` while the binary cannot do its work.
    fn ready(&self) -> ExporterFuture<'_, Result<(), String>> {
        Box::pin(std::future::ready(Ok(())))
    }
}

/// Binds `config.listen` and prints `metrics on ADDR` on stdout; `None` without a config.
pub async fn bind(config: Option<&MetricsConfig>) -> anyhow::Result<Option<TcpListener>> {
    let Some(config) = config else {
        return Ok(None);
    };
    let listener = TcpListener::bind(config.listen).await.with_context(|| {
        format!(
            "binding the metrics listener {} ([metrics] listen)",
            config.listen
        )
    })?;
    announce(&listener, &mut std::io::stdout().lock())?;
    Ok(Some(listener))
}

fn announce(listener: &TcpListener, out: &mut impl Write) -> anyhow::Result<SocketAddr> {
    let address = listener.local_addr().context("reading the bound address")?;
    writeln!(out, "metrics on {address}").context("writing to stdout")?;
    out.flush().context("writing to stdout")?;
    Ok(address)
}

/// The routes of the listener.
pub fn router(exporter: Arc<dyn Exporter>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(exporter)
}

/// Serves [`router`] on `listener` until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    exporter: Arc<dyn Exporter>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let address = listener.local_addr().ok();
    tracing::info!(address = ?address, "Serving /metrics, /healthz and /readyz.");
    axum::serve(listener, router(exporter))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
        .context("serving metrics")
}

/// [`serve`] when `listener` is set; logs a failure instead of stopping the binary, whose work
/// does not depend on being watched.
pub async fn serve_if_bound(
    listener: Option<TcpListener>,
    exporter: Arc<dyn Exporter>,
    shutdown: CancellationToken,
) {
    if let Some(listener) = listener {
        if let Err(e) = serve(listener, exporter, shutdown).await {
            tracing::error!("{e:#}; metrics are not served until the restart.");
        }
    }
}

async fn metrics(State(exporter): State<Arc<dyn Exporter>>) -> Response {
    exporter.refresh().await;
    let mut text = String::new();
    match prometheus_text::encode(&mut text, exporter.registry()) {
        Ok(()) => (
            [(header::CONTENT_TYPE, prometheus_text::CONTENT_TYPE)],
            text,
        )
            .into_response(),
        Err(e) => {
            tracing::error!(error = %e, "Cannot encode the metrics.");
            (StatusCode::INTERNAL_SERVER_ERROR, "internal error\n").into_response()
        }
    }
}

async fn readyz(State(exporter): State<Arc<dyn Exporter>>) -> Response {
    match exporter.ready().await {
        Ok(()) => "ready\n".into_response(),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {reason}\n"),
        )
            .into_response(),
    }
}

/// Buckets for latencies from a millisecond to about a minute, in seconds.
pub fn latency_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.5, 13)
}

/// Buckets for waits from a second to about two days, in seconds (a session's time to
/// running includes its time in the queue).
pub fn wait_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(1.0, 3.0, 12)
}

/// Buckets for sizes from 1 MiB to about 1 TiB, in bytes.
pub fn size_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(1_048_576.0, 4.0, 11)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use prometheus_client::metrics::counter::Counter;
    use tower::ServiceExt as _;

    struct Fixed {
        registry: Registry,
        ready: Result<(), String>,
        refreshed: Counter,
    }

    impl Exporter for Fixed {
        fn registry(&self) -> &Registry {
            &self.registry
        }
        fn refresh(&self) -> ExporterFuture<'_, ()> {
            self.refreshed.inc();
            Box::pin(std::future::ready(()))
        }
        fn ready(&self) -> ExporterFuture<'_, Result<(), String>> {
            Box::pin(std::future::ready(self.ready.clone()))
        }
    }

    fn exporter(ready: Result<(), String>) -> Arc<dyn Exporter> {
        let mut registry = Registry::default();
        let refreshed = Counter::default();
        registry.register("test_refreshes", "Refreshes", refreshed.clone());
        Arc::new(Fixed {
            registry,
            ready,
            refreshed,
        })
    }

    async fn get(exporter: Arc<dyn Exporter>, path: &str) -> (StatusCode, String, String) {
        let response = router(exporter)
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let content_type = response
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        (
            status,
            content_type,
            String::from_utf8(body.to_vec()).unwrap(),
        )
    }

    #[tokio::test]
    async fn metrics_are_refreshed_then_encoded_as_prometheus_text() {
        let exporter = exporter(Ok(()));
        let (status, content_type, body) = get(exporter.clone(), "/metrics").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(content_type, "text/plain; version=0.0.4; charset=utf-8");
        assert!(
            body.contains("# TYPE test_refreshes_total counter\n"),
            "{body}"
        );
        assert!(body.contains("\ntest_refreshes_total 1\n"), "{body}");
        let (_, _, body) = get(exporter, "/metrics").await;
        assert!(body.contains("\ntest_refreshes_total 2\n"), "{body}");
    }

    #[tokio::test]
    async fn healthz_is_ok_and_readyz_says_why_not() {
        let (status, _, body) = get(exporter(Ok(())), "/healthz").await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ok\n"));
        let (status, _, body) = get(exporter(Ok(())), "/readyz").await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ready\n"));
        let (status, _, body) =
            get(exporter(Err("the store does not answer".into())), "/readyz").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body, "not ready: the store does not answer\n");
    }

    #[tokio::test]
    async fn bind_announces_the_bound_port() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut out = Vec::new();
        let address = announce(&listener, &mut out).unwrap();
        assert_ne!(address.port(), 0);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            format!("metrics on {address}\n")
        );
        assert!(bind(None).await.unwrap().is_none());
    }

    #[test]
    fn the_section_refuses_unknown_keys() {
        let config: MetricsConfig = toml::from_str("listen = \"127.0.0.1:9470\"").unwrap();
        assert_eq!(config.listen.port(), 9470);
        let error = toml::from_str::<MetricsConfig>("listen = \"127.0.0.1:9470\"\nport = 1")
            .unwrap_err()
            .to_string();
        assert!(error.contains("unknown field `port`"), "{error}");
    }
}
