//! [`Services`]: what every connection of the gateway shares — the SSH settings, the
//! authentication policy, the allowlist, the manager and agent clients, the audit queue, the
//! cap on unauthenticated connections, and the settings connections read. Built once by
//! [`crate::run`], then shared (`Arc`) by the accept loop (`server.rs`) and every connection
//! (`connection.rs`).

use std::sync::Arc;
use std::time::Duration;

use crate::allowlist::SharedAllowlist;
use crate::audit::AuditSender;
use crate::auth::Authenticator;
use crate::config::ProxyProtocol;
use crate::manager::GatewayRoutes;
use crate::revocations::OpenKeys;
use crate::startups::Startups;
use ongrid_service::agent_stream::AgentConnector;

/// Everything connections share.
pub struct Services {
    pub ssh_config: Arc<russh::server::Config>,
    pub auth: Authenticator,
    pub allowlist: Arc<SharedAllowlist>,
    pub manager: GatewayRoutes,
    pub agents: AgentConnector,
    pub audit: AuditSender,
    /// The keys of logged-in connections, checked again every second (`revocations.rs`).
    pub open_keys: Arc<OpenKeys>,
    pub proxy_protocol: Option<ProxyProtocol>,
    /// Unauthenticated connections in progress, per source and in total.
    pub startups: Startups,
    /// How often open connections report their traffic to the manager.
    pub activity_report: Duration,
    /// How long before a planned hold interactive shells are warned.
    pub warn_before: Duration,
}
