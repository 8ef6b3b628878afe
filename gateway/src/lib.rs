//! ongrid-gateway: the SSH front door of an ongrid site.
//!
//! Users connect with plain OpenSSH (or VS Code Remote-SSH) as `<session>@gateway`. The
//! gateway admits only addresses of allowed institutes ([`allowlist`], checked at accept and
//! at login; [`proxy_protocol`] behind an L4 balancer), authenticates public keys registered
//! with the manager ([`auth`], [`throttle`]), asks the manager which session the user name
//! reaches, and runs each SSH channel as its own stream to the node agent of that session
//! ([`channel`], over `ongrid_service::agent_stream`). The manager is told of every connection for its audit log
//! ([`audit`]), and of its traffic while it is open; its answers (the session's deadlines) become
//! the banner and the hold warning of interactive shells ([`deadlines`]). Open connections whose
//! key was removed or expired are closed with a message ([`revocations`]).
//!
//! Map: [`config`] (TOML), [`hostkeys`] (created on first start), [`services`] (what all
//! connections share), [`server`] (accept loop; [`startups`] caps connections not logged in yet),
//! [`connection`] (the russh handler and the per-connection task), [`requests`] (which channel
//! requests are granted, answered as they arrive), [`input`] (each channel's bounded input
//! queue and why it cannot deadlock), [`manager`] (HTTPS client), [`metrics`] (`/metrics`),
//! TLS roots come from `ca_dir` (`ongrid_service::ca_roots`).

pub mod allowlist;
pub mod audit;
pub mod auth;
pub mod channel;
pub mod config;
pub mod connection;
pub mod deadlines;
pub mod hostkeys;
pub mod input;
pub mod manager;
pub mod metrics;
pub mod proxy_protocol;
pub mod requests;
pub mod revocations;
pub mod server;
pub mod services;
pub mod startups;
#[cfg(test)]
mod test_log;
pub mod throttle;

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use russh::keys::PrivateKey;
use russh::{MethodKind, MethodSet, SshId};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use config::Config;

/// The version string the gateway announces.
pub const SERVER_ID: &str = concat!("SSH-2.0-ongrid_gateway_", env!("CARGO_PKG_VERSION"));
/// How long queued audit events may take to reach the manager at shutdown.
const AUDIT_DRAIN: Duration = Duration::from_secs(10);
/// How long start-up waits for the first allowlist before serving anyway.
const FIRST_ALLOWLIST: Duration = Duration::from_secs(10);

/// Runs the gateway on `listener` until `shutdown`: loads (or creates) the host keys, starts
/// the allowlist refresher and the audit reporter, and serves connections. On shutdown every
/// connection is told to disconnect, and queued audit events are delivered (for a while).
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let metrics_listener = ongrid_service::metrics::bind(config.metrics.as_ref()).await?;
    let roots = ongrid_service::ca_roots::load_ca_dir(&config.ca_dir)?;
    let tls_config = ongrid_service::ca_roots::client_config(&roots)?;
    let manager = manager::GatewayRoutes::new(&config.manager_urls, &roots, config.token.clone())?;
    let host_key_dir = config.host_key_dir.clone();
    let keys = tokio::task::spawn_blocking(move || hostkeys::load_or_create(&host_key_dir))
        .await
        .context("the host key task failed")??;

    let allowlist = Arc::new(allowlist::SharedAllowlist::new());
    // Load the allowlist before accepting anyone, so the first connections after a start are
    // not refused for want of it: meanwhile they wait in the listen backlog. If the manager does
    // not answer in time, the refresher keeps trying and everyone is refused until it does.
    match tokio::time::timeout(FIRST_ALLOWLIST, manager.allowlist()).await {
        Ok(Ok(list)) => {
            allowlist.replace(list);
        }
        Ok(Err(error)) => {
            let error = anyhow::Error::from(error);
            tracing::warn!(error = format!("{error:#}"), "Cannot load the allowlist yet: refusing every connection until the manager answers.");
        }
        Err(_) => tracing::warn!("The manager did not send the allowlist within 10 s: refusing every connection until it does."),
    }
    let tracker = TaskTracker::new();
    tracker.spawn(ongrid_service::metrics::serve_if_bound(
        metrics_listener,
        Arc::new(metrics::GatewayExporter::new(allowlist.clone())),
        shutdown.clone(),
    ));
    tracker.spawn(allowlist::refresh(
        manager.clone(),
        allowlist.clone(),
        config.allowlist_refresh,
        shutdown.clone(),
    ));
    let (audit, audit_events) = audit::queue(audit::QUEUE);
    let reporter = tokio::spawn(audit::report(manager.clone(), audit_events));
    let open_keys = Arc::new(revocations::OpenKeys::default());
    tracker.spawn(revocations::watch(
        manager.clone(),
        open_keys.clone(),
        revocations::RECHECK,
        shutdown.clone(),
    ));

    let services = Arc::new(services::Services {
        ssh_config: Arc::new(ssh_config(keys)),
        auth: auth::Authenticator::new(
            manager.clone(),
            throttle::Throttle::new(throttle::Policies::default()),
            allowlist.clone(),
        ),
        allowlist,
        manager,
        agents: ongrid_service::agent_stream::AgentConnector::new(tls_config, config.token.clone()),
        audit,
        open_keys,
        proxy_protocol: config.proxy_protocol.clone(),
        startups: startups::Startups::new(config.startups),
        activity_report: config.activity_report,
        warn_before: config.warn_before,
    });
    if let Ok(address) = listener.local_addr() {
        tracing::info!(%address, proxy_protocol = config.proxy_protocol.is_some(), "Gateway serving SSH.");
    }
    server::serve(listener, services, tracker.clone(), shutdown.clone()).await;

    tracker.close();
    tracker.wait().await;
    // Every connection is gone, and with them the audit senders: the reporter drains and ends.
    if tokio::time::timeout(AUDIT_DRAIN, reporter).await.is_err() {
        tracing::error!("Audit events still queued at shutdown were not all delivered.");
    }
    tracing::info!("Gateway stopped.");
    Ok(())
}

/// The SSH server settings (see `shared/research/ssh_gateway.md` §0 and §2.5):
/// - public keys only; a rejection costs 500 ms, except OpenSSH's first `none` probe;
/// - no inactivity timeout (idle but open connections stay, as VS Code needs), with a
///   keepalive every 30 s instead so dead peers are noticed after about 2 minutes;
/// - `nodelay` for interactive latency; 2 MiB windows and 64 KiB packets;
/// - bounded queues: each channel's input (`input.rs`; russh's own per-channel queue is unused),
///   64 messages in the connection's outbox, output paced by each channel's window.
pub fn ssh_config(keys: Vec<PrivateKey>) -> russh::server::Config {
    russh::server::Config {
        server_id: SshId::Standard(Cow::Borrowed(SERVER_ID)),
        methods: MethodSet::from(&[MethodKind::PublicKey][..]),
        auth_rejection_time: Duration::from_millis(500),
        auth_rejection_time_initial: Some(Duration::ZERO),
        keys,
        window_size: 2 * 1024 * 1024,
        maximum_packet_size: 65535,
        channel_buffer_size: 64,
        event_buffer_size: 64,
        max_auth_attempts: 10,
        inactivity_timeout: None,
        keepalive_interval: Some(Duration::from_secs(30)),
        keepalive_max: 3,
        nodelay: true,
        ..russh::server::Config::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_connections_stay_and_dead_ones_are_noticed() {
        let config = ssh_config(Vec::new());
        assert_eq!(config.inactivity_timeout, None);
        assert_eq!(config.keepalive_interval, Some(Duration::from_secs(30)));
        assert!(config.keepalive_max > 0);
        assert!(config.nodelay);
        assert_eq!(config.auth_rejection_time_initial, Some(Duration::ZERO));
        assert!(config.maximum_packet_size <= 65535);
        assert_eq!(&*config.methods, &[MethodKind::PublicKey]);
    }
}
