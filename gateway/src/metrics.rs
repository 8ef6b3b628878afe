//! The gateway's metrics, served by `ongrid_service::metrics` on `[metrics] listen`: SSH
//! connections open and accepted, refusals by reason (before SSH: allowlist, startups, PROXY
//! protocol; at authentication: key, throttle, unavailable manager, address), the time the
//! manager takes to answer for a key, bytes each way and channels by type.
//!
//! The handles are process-wide, like a logger: the accept loop, the connection handler and the
//! channel relays count into them without passing a handle around; gateways started in one test
//! process share them. Labels are closed sets: no address, user or key is ever a label.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use ongrid_core::stream::StreamKind;
use ongrid_service::metrics::{latency_buckets, Exporter, ExporterFuture};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::allowlist::SharedAllowlist;
use crate::auth::RefusalKind;

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ChannelLabels {
    /// `shell`, `exec`, `sftp` (or another subsystem, as `subsystem`) or `direct_tcpip`.
    pub r#type: &'static str,
}

/// Why a connection or an authentication was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The address is in no institute's allowlist (or none was fetched yet).
    Allowlist,
    /// Too many connections not logged in yet (`[startups]`).
    Startups,
    /// A PROXY protocol header missing from a balancer, or sent by a peer that is not one.
    ProxyProtocol,
    /// At authentication: why the key did not log in.
    Auth(RefusalKind),
}

impl Refused {
    fn label(self) -> &'static str {
        match self {
            Self::Allowlist => "allowlist",
            Self::Startups => "startups",
            Self::ProxyProtocol => "proxy_protocol",
            Self::Auth(RefusalKind::Key) => "key",
            Self::Auth(RefusalKind::Throttled) => "throttle",
            Self::Auth(RefusalKind::Unavailable) => "manager_unavailable",
            Self::Auth(RefusalKind::Address) => "address",
        }
    }
}

/// The gateway's metric handles.
pub struct Events {
    connections_open: Gauge,
    connections: Counter,
    refused: Family<ReasonLabels, Counter>,
    auth_duration: Histogram,
    to_container: Counter,
    to_client: Counter,
    channels: Family<ChannelLabels, Counter>,
}

static EVENTS: LazyLock<Events> = LazyLock::new(|| Events {
    connections_open: Gauge::default(),
    connections: Counter::default(),
    refused: Family::default(),
    auth_duration: Histogram::new(latency_buckets()),
    to_container: Counter::default(),
    to_client: Counter::default(),
    channels: Family::default(),
});

/// The process-wide handles.
pub fn events() -> &'static Events {
    &EVENTS
}

/// Counts a connection as open until dropped.
pub struct OpenConnection(());

impl Drop for OpenConnection {
    fn drop(&mut self) {
        events().connections_open.dec();
    }
}

impl Events {
    /// A connection passed the checks before SSH; open until the guard is dropped.
    pub fn connection(&self) -> OpenConnection {
        self.connections.inc();
        self.connections_open.inc();
        OpenConnection(())
    }

    pub fn refused(&self, why: Refused) {
        self.refused
            .get_or_create(&ReasonLabels {
                reason: why.label(),
            })
            .inc();
    }

    /// How long the manager (or the 1 s cache) took to answer for a key.
    pub fn authenticated_in(&self, elapsed: Duration) {
        self.auth_duration.observe(elapsed.as_secs_f64());
    }

    pub fn to_container(&self, bytes: usize) {
        self.to_container.inc_by(bytes as u64);
    }

    pub fn to_client(&self, bytes: usize) {
        self.to_client.inc_by(bytes as u64);
    }

    /// A channel started its program on the agent.
    pub fn channel(&self, kind: &StreamKind) {
        let r#type = match kind {
            StreamKind::Shell { .. } => "shell",
            StreamKind::Exec { .. } => "exec",
            StreamKind::Subsystem { name } if name == "sftp" => "sftp",
            StreamKind::Subsystem { .. } => "subsystem",
            StreamKind::DirectTcpip { .. } => "direct_tcpip",
        };
        self.channels.get_or_create(&ChannelLabels { r#type }).inc();
    }
}

/// The gateway's `/metrics`.
pub struct GatewayExporter {
    registry: Registry,
    allowlist: Arc<SharedAllowlist>,
}

impl GatewayExporter {
    /// `/readyz` is ready once `allowlist` was fetched from the manager.
    pub fn new(allowlist: Arc<SharedAllowlist>) -> Self {
        let events = events();
        let mut registry = Registry::with_prefix("ongrid_gateway");
        registry.register(
            "connections_open",
            "SSH connections open (past the allowlist and the start-up cap)",
            events.connections_open.clone(),
        );
        registry.register(
            "connections",
            "SSH connections accepted (past the allowlist and the start-up cap)",
            events.connections.clone(),
        );
        registry.register(
            "refusals",
            "Connections refused before SSH (allowlist, startups, proxy_protocol) and keys \
             refused at authentication (key, throttle, manager_unavailable, address)",
            events.refused.clone(),
        );
        registry.register_with_unit(
            "auth_duration",
            "Time to decide on an offered or signed key (manager lookup, cached 1 s)",
            Unit::Seconds,
            events.auth_duration.clone(),
        );
        registry.register_with_unit(
            "received",
            "Bytes from SSH clients to containers, over all channels",
            Unit::Bytes,
            events.to_container.clone(),
        );
        registry.register_with_unit(
            "sent",
            "Bytes from containers to SSH clients (stdout and stderr), over all channels",
            Unit::Bytes,
            events.to_client.clone(),
        );
        registry.register(
            "channels",
            "SSH channels started on an agent, by type",
            events.channels.clone(),
        );
        Self {
            registry,
            allowlist,
        }
    }
}

impl Exporter for GatewayExporter {
    fn registry(&self) -> &Registry {
        &self.registry
    }

    fn ready(&self) -> ExporterFuture<'_, Result<(), String>> {
        let ready = if self.allowlist.is_loaded() {
            Ok(())
        } else {
            Err("no allowlist fetched from the manager yet: every connection is refused".to_owned())
        };
        Box::pin(std::future::ready(ready))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metrics_are_named_by_convention() {
        let exporter = GatewayExporter::new(Arc::new(SharedAllowlist::new()));
        let open = events().connection();
        events().refused(Refused::Auth(RefusalKind::Throttled));
        events().channel(&StreamKind::Subsystem {
            name: "sftp".into(),
        });
        events().to_client(10);
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, exporter.registry())
            .unwrap();
        for name in [
            "# TYPE ongrid_gateway_connections_open gauge",
            "# TYPE ongrid_gateway_connections_total counter",
            "# TYPE ongrid_gateway_refusals_total counter",
            "# TYPE ongrid_gateway_auth_duration_seconds histogram",
            "# TYPE ongrid_gateway_received_bytes_total counter",
            "# TYPE ongrid_gateway_sent_bytes_total counter",
            "# TYPE ongrid_gateway_channels_total counter",
            "ongrid_gateway_refusals_total{reason=\"throttle\"}",
            "ongrid_gateway_channels_total{type=\"sftp\"}",
        ] {
            assert!(text.contains(name), "{name} missing from\n{text}");
        }
        drop(open);
    }

    #[tokio::test]
    async fn ready_once_the_allowlist_is_loaded() {
        let allowlist = Arc::new(SharedAllowlist::new());
        let exporter = GatewayExporter::new(allowlist.clone());
        let not_ready = exporter.ready().await.unwrap_err();
        assert!(not_ready.starts_with("no allowlist fetched"), "{not_ready}");
        allowlist.replace(ongrid_core::network::Allowlist::default());
        assert_eq!(exporter.ready().await, Ok(()));
    }
}
