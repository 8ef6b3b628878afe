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

use axum::extract::State;
use axum::http::{Method, Uri};
use axum::routing::{delete, get, post, put};
use axum::Router;

pub use crate::app::{ApiError, AppState};
pub use error::{AdminJson, AdminQuery, ApiJson, ApiPath, ApiQuery, RequestKey};

/// The `/v1` router.
pub fn router(state: AppState) -> Router {
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
        .route("/v1/agent/register", post(agent::register))
        .route("/v1/agent/sync", post(agent::sync))
        .route("/v1/agent/desired", get(agent::desired))
        .route("/v1/gateway/allowlist", get(gateway::allowlist))
        .route("/v1/gateway/authorize", post(gateway::authorize))
        .route("/v1/gateway/route", post(gateway::route))
        .route("/v1/gateway/connections", post(gateway::connection_event))
        .route("/v1/gateway/keys/check", post(gateway::check_keys))
        .fallback(no_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn(
            crate::request_body::read_whole_body,
        ))
        .layer(axum::middleware::from_fn(error::log_refusals))
        .layer(axum::middleware::from_fn(crate::metrics::count_requests))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            notify_writes,
        ))
        .with_state(state)
}

/// After every successful change a person makes (a session created, removed, held or released,
/// a freeze or an image removed, a job cancelled or halted, a GPU's mode, ...), wakes the
/// long-polls: which nodes such a change concerns is the handler's business, and waiters only
/// answer when what they watch really changed, so one notification for all of them keeps every
/// handler free of it. The agent routes notify where they change something; the gateway's
/// connection events change sessions' states (CONNECTED, IDLE) but no node's desired state.
async fn notify_writes(
    State(state): State<AppState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let write = !matches!(
        *request.method(),
        Method::GET | Method::HEAD | Method::OPTIONS
    );
    let path = request.uri().path();
    let by_person = !path.starts_with("/v1/agent/") && !path.starts_with("/v1/gateway/");
    let connection = path == "/v1/gateway/connections";
    let precise = names_its_nodes(request.method(), path);
    let response = next.run(request).await;
    if write && response.status().is_success() {
        if by_person && !precise {
            state.changes.site();
        } else if by_person || connection {
            state.changes.sessions();
        }
    }
    response
}

/// Whether a person's request is one whose use case wakes the nodes it concerns itself, so
/// that it wakes people's waits here, not every agent's (each of which would read its desired
/// state again: a class of students starting or ending sessions at once would make every node
/// do that per request):
///
/// - a session requested or a job submitted is on no node until the scheduler places it, and
///   the placement wakes that node's long-poll;
/// - a session removed or held names its own node ([`crate::app::sessions`]).
fn names_its_nodes(method: &Method, path: &str) -> bool {
    let session = |rest: &str| !rest.is_empty() && !rest.contains('/');
    match (method, path.strip_prefix("/v1/sessions/")) {
        (&Method::POST, None) => matches!(path, "/v1/sessions" | "/v1/jobs"),
        (&Method::DELETE, Some(rest)) => session(rest),
        (&Method::POST, Some(rest)) => rest.strip_suffix("/hold").is_some_and(session),
        _ => false,
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the routes whose use cases name the nodes they change skip the wake-up of every
    /// agent; anything else a person writes wakes them all.
    #[test]
    fn only_requests_that_name_their_nodes_skip_waking_every_agent() {
        for (method, path) in [
            (Method::POST, "/v1/sessions"),
            (Method::POST, "/v1/jobs"),
            (Method::DELETE, "/v1/sessions/work"),
            (Method::POST, "/v1/sessions/work/hold"),
        ] {
            assert!(names_its_nodes(&method, path), "{method} {path}");
        }
        for (method, path) in [
            (Method::POST, "/v1/sessions/work/release"),
            (Method::POST, "/v1/sessions/work/keep"),
            (Method::DELETE, "/v1/sessions/"),
            (Method::DELETE, "/v1/sessions/work/hold"),
            (Method::POST, "/v1/sessions//hold"),
            (Method::POST, "/v1/jobs/42/cancel"),
            (Method::POST, "/v1/nodes/node1/drain"),
            (Method::PUT, "/v1/sessions"),
        ] {
            assert!(!names_its_nodes(&method, path), "{method} {path}");
        }
    }
}
