//! The HTTPS API under `/v1`, exactly as listed in `ongrid_core::api`'s documentation.
//!
//! A handler authenticates (an extractor of [`callers`]), parses the request, and either calls
//! the use case of [`crate::app`] (which decides through [`crate::domain`], writes and says what
//! changed) and renders its answer as JSON, or, where no use case is written yet, does those
//! steps itself; it decides no transition itself. Handler modules, one per family of routes,
//! never call each other and never import the dashboard; what they share is in [`callers`] and
//! [`error`] (the extractors), and in [`crate::app`].
//!
//! - [`whoami`], [`sessions`] (create, list, show, remove, hold, release, keep), [`nodes`]
//!   (nodes and GPU modes), [`keys`] (SSH public keys), [`images`] (frozen images), [`jobs`]
//!   (batch jobs: submit, list, show, cancel, halt, remove, output): people, by TLS client
//!   certificate.
//! - [`admin`]: the institutes allowlist and the audit log (admins only).
//! - [`users`]: removing users and restoring them, the list of users (admins only).
//! - [`share`]: the site's fair share (`devctl share`).
//! - [`reservations`]: owned GPUs and reservations (admins change them, everyone reads them).
//! - [`agent`]: node agents (bearer token): registration, sync and the desired state.
//! - [`gateway`]: the SSH gateway (bearer token): allowlist, keys, routes, connection events.
//!
//! Handlers hold no state of their own: everything is in the [`crate::store::Store`]; a use
//! case's effects wake the scheduler and the long-polls ([`crate::app::Effect`]).

pub mod admin;
pub mod agent;
pub mod callers;
pub mod error;
pub mod gateway;
pub mod images;
pub mod jobs;
pub mod keys;
pub mod logins;
pub mod nodes;
pub mod reservations;
pub mod sessions;
pub mod share;
pub mod users;
pub mod whoami;

use axum::http::{Method, Uri};
use axum::routing::{delete, get, post, put};
use axum::Router;

pub use crate::app::{ApiError, AppState};
pub use error::{AdminJson, AdminQuery, ApiJson, ApiPath, ApiQuery, RequestKey};

/// The `/v1` router.
pub fn router(state: AppState) -> Router {
    Router::new()
        .merge(people_routes())
        .merge(site_routes())
        .merge(work_routes())
        .merge(service_routes())
        .fallback(no_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn(
            crate::request_body::read_whole_body,
        ))
        .layer(axum::middleware::from_fn(error::log_refusals))
        .layer(axum::middleware::from_fn(crate::metrics::count_requests))
        .with_state(state)
}

/// A person's own: who they are, their sessions and their SSH keys.
fn people_routes() -> Router<AppState> {
    Router::new()
        .route("/v1/whoami", get(whoami::whoami))
        .route("/v1/share", get(share::share))
        .route("/v1/dashboard/links", post(logins::create_link))
        .route(
            "/v1/sessions",
            get(sessions::list_sessions).post(sessions::create_session),
        )
        .route(
            "/v1/sessions/{name}",
            get(sessions::show_session).delete(sessions::delete_session),
        )
        .route("/v1/sessions/{name}/hold", post(sessions::hold))
        .route("/v1/sessions/{name}/release", post(sessions::release))
        .route("/v1/sessions/{name}/keep", post(sessions::keep))
        .route(
            "/v1/keys",
            get(keys::list_keys)
                .post(keys::add_key)
                .delete(keys::remove_key),
        )
}

/// The site's nodes, GPUs, owners, reservations, institutes, users and audit log (most for admins).
fn site_routes() -> Router<AppState> {
    Router::new()
        .route("/v1/nodes", get(nodes::list_nodes))
        .route(
            "/v1/nodes/{name}",
            get(nodes::show_node).delete(nodes::remove_node),
        )
        .route(
            "/v1/nodes/{name}/drain",
            post(nodes::drain_node).delete(nodes::undrain_node),
        )
        .route("/v1/gpus/{uuid}/mode", put(nodes::set_gpu_mode))
        .route(
            "/v1/gpus/{uuid}/owner",
            put(reservations::set_gpu_owner).delete(reservations::clear_gpu_owner),
        )
        .route(
            "/v1/nodes/{name}/owner",
            put(reservations::set_node_owner).delete(reservations::clear_node_owner),
        )
        .route("/v1/owners", get(reservations::list_owners))
        .route(
            "/v1/reservations",
            get(reservations::list_reservations).post(reservations::add_reservation),
        )
        .route(
            "/v1/reservations/{name}",
            get(reservations::show_reservation).delete(reservations::remove_reservation),
        )
        .route(
            "/v1/gpus/{uuid}/drain",
            post(nodes::drain_gpu).delete(nodes::undrain_gpu),
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
        .route("/v1/users", get(users::list_users))
        .route("/v1/users/{dn}", delete(users::remove_user))
        .route("/v1/users/{dn}/restore", post(users::restore_user))
        .route(
            "/v1/token-links",
            get(users::list_token_links).put(users::link_token),
        )
        .route(
            "/v1/token-links/{issuer}/{subject}",
            delete(users::unlink_token),
        )
}

/// Frozen images and batch jobs.
fn work_routes() -> Router<AppState> {
    Router::new()
        .route(
            "/v1/images",
            get(images::list_images).post(images::create_image),
        )
        .route("/v1/jobs", get(jobs::list_jobs).post(jobs::submit_job))
        .route(
            "/v1/jobs/{id}",
            get(jobs::show_job).delete(jobs::remove_job),
        )
        .route("/v1/jobs/{id}/cancel", post(jobs::cancel_job))
        .route("/v1/jobs/{id}/halt", post(jobs::halt_job))
        .route("/v1/jobs/{id}/logs", get(jobs::job_logs))
        .route("/v1/targets", get(jobs::list_targets))
        .route(
            "/v1/images/{reference}",
            get(images::show_image).delete(images::delete_image),
        )
        .route("/v1/images/{reference}/share", post(images::share_image))
        .route(
            "/v1/images/{reference}/unshare",
            post(images::unshare_image),
        )
}

/// The agents' and the gateway's routes (bearer tokens).
fn service_routes() -> Router<AppState> {
    Router::new()
        .route("/v1/agent/register", post(agent::register))
        .route("/v1/agent/sync", post(agent::sync))
        .route("/v1/agent/desired", get(agent::desired))
        .route("/v1/gateway/allowlist", get(gateway::allowlist))
        .route("/v1/gateway/authorize", post(gateway::authorize))
        .route("/v1/gateway/route", post(gateway::route))
        .route("/v1/gateway/connections", post(gateway::connection_event))
        .route("/v1/gateway/keys/check", post(gateway::check_keys))
}

/// How long a long-poll waits: its `?timeout=SECONDS`, at most (and by default) `max`.
pub fn poll_timeout(timeout: Option<u64>, max: std::time::Duration) -> std::time::Duration {
    timeout.map_or(max, std::time::Duration::from_secs).min(max)
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
