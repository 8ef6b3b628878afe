//! The HTTPS API under `/v1`, exactly as listed in `ongrid_core::api`'s documentation.
//!
//! - [`users`]: routes for people (TLS client certificate → [`crate::auth::CurrentUser`]).
//! - [`keys`]: people's SSH public keys.
//! - [`lifecycle`]: holding, releasing and keeping sessions alive.
//! - [`admin`]: the institutes allowlist and the audit log (admins only).
//! - [`agent`]: routes for node agents (bearer token → [`crate::auth::AgentNode`]).
//! - [`images`]: frozen images (freeze orders to agents, their reports).
//! - [`gateway`]: routes for the SSH gateway (bearer token → [`crate::auth::GatewayCaller`]).
//! - [`error`]: the one [`ApiError`] and the extractors that never answer in plain text.
//!
//! Handlers hold no state of their own: everything is in the [`Store`]; the scheduler is woken
//! through [`AppState::wake`] whenever something it cares about changed.

pub mod admin;
pub mod agent;
pub mod error;
pub mod gateway;
pub mod images;
pub mod keys;
pub mod lifecycle;
pub mod users;

use std::collections::HashMap;
use std::sync::Arc;

use axum::http::{Method, Uri};
use axum::routing::{get, post, put};
use axum::Router;
use ongrid_core::api::SessionView;
use ongrid_core::{SessionId, Transition};
use tokio::sync::Notify;

pub use error::{ApiError, ApiJson, ApiPath, ApiQuery};

use crate::auth::{AgentTokens, GatewayToken};
use crate::clock::Clock;
use crate::config::Config;
use crate::site::SiteSnapshot;
use crate::store::{SessionRecord, Store};

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    pub store: Arc<dyn Store>,
    pub config: Arc<Config>,
    pub tokens: Arc<AgentTokens>,
    /// `None` when the config has no `gateway_token_file`: gateway routes answer 401.
    pub gateway_token: Option<Arc<GatewayToken>>,
    pub clock: Arc<dyn Clock>,
    /// Wakes the scheduling loop.
    pub wake: Arc<Notify>,
    /// Runs a scheduling round in place, when an answer should reflect it.
    pub scheduler: Arc<crate::scheduler::Scheduler>,
}

impl AppState {
    /// The site as of now.
    pub async fn site(&self) -> Result<SiteSnapshot, ApiError> {
        Ok(SiteSnapshot::load(
            self.store.as_ref(),
            self.clock.now(),
            self.config.node_timeout,
        )
        .await?)
    }

    /// 1-based queue positions of the PENDING sessions.
    pub async fn queue_positions(&self) -> Result<HashMap<SessionId, u32>, ApiError> {
        let order = self.store.pending_order().await?;
        Ok(order.into_iter().zip(1u32..).collect())
    }
}

/// The `/v1` router.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/whoami", get(users::whoami))
        .route(
            "/v1/sessions",
            get(users::list_sessions).post(users::create_session),
        )
        .route(
            "/v1/sessions/{name}",
            get(users::show_session).delete(users::delete_session),
        )
        .route("/v1/sessions/{name}/hold", post(lifecycle::hold))
        .route("/v1/sessions/{name}/release", post(lifecycle::release))
        .route("/v1/sessions/{name}/keep", post(lifecycle::keep))
        .route("/v1/nodes", get(users::list_nodes))
        .route("/v1/gpus/{uuid}/mode", put(users::set_gpu_mode))
        .route(
            "/v1/keys",
            get(keys::list_keys)
                .post(keys::add_key)
                .delete(keys::remove_key),
        )
        .route(
            "/v1/institutes",
            get(admin::list_institutes).post(admin::add_institute),
        )
        .route(
            "/v1/institutes/{name}",
            get(admin::show_institute).delete(admin::remove_institute),
        )
        .route("/v1/audit", get(admin::audit))
        .route(
            "/v1/images",
            get(images::list_images).post(images::create_image),
        )
        .route(
            "/v1/images/{reference}",
            get(images::show_image).delete(images::delete_image),
        )
        .route("/v1/agent/register", post(agent::register))
        .route("/v1/agent/sync", post(agent::sync))
        .route("/v1/gateway/allowlist", get(gateway::allowlist))
        .route("/v1/gateway/authorize", post(gateway::authorize))
        .route("/v1/gateway/route", post(gateway::route))
        .route("/v1/gateway/connections", post(gateway::connection_event))
        .fallback(no_route)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

async fn no_route(uri: Uri) -> ApiError {
    ApiError::not_found(format!(
        "no route {}: the API's routes are listed in ongrid_core::api",
        uri.path()
    ))
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::bad_request(format!("{} does not take {method}", uri.path()))
}

/// A stored session as the API shows it.
pub fn session_view(
    session: SessionRecord,
    queue_position: Option<u32>,
    transitions: Vec<Transition>,
) -> SessionView {
    SessionView {
        container: session.id.container_name(),
        id: session.id,
        name: session.name,
        owner: session.owner,
        user_name: session.user_name,
        state: session.state,
        reason: session.reason,
        request: session.request,
        image: session.image,
        node: session.node,
        gpus: session.gpus,
        created_at: session.created_at,
        queue_position,
        transitions,
        lifecycle: None,
    }
}
