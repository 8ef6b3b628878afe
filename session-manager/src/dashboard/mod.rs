//! The web dashboard: server-rendered HTML pages under `/dashboard/` for users (their sessions
//! with state, node, GPUs, deadlines and why they are alive, the ssh command, hold / release /
//! keep / remove, freeze with live progress, their images, their jobs and output) and admins
//! (every session and job, nodes and GPUs with drains, institutes, the audit log).
//!
//! - [`auth`]: login links (`devctl dashboard`), browser logins (cookie), certificates, CSRF.
//! - [`routes`]: the pages and forms; [`live`]: server-sent events that keep a page current.
//! - [`data`]: what a page shows, read as the API reads it; [`views`]: the HTML (maud).
//! - [`apps`]: a session's web apps (JupyterLab, its web ports) relayed to its owner's browser.
//! - [`actions`]: what a form does, through the same domain rules as the API's routes (whose
//!   handler modules the dashboard never calls).
//!
//! No JavaScript build: one small script (`static/dashboard.js`, embedded) follows the event
//! stream and asks before removals; every page works without it.

pub mod actions;
mod apps;
pub mod auth;
mod data;
mod live;
mod routes;
mod views;

pub use live::REFRESH as LIVE_REFRESH;

use axum::http::header::CONTENT_TYPE;
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::Router;

use crate::app::AppState;

const CSS: &str = include_str!("static/dashboard.css");
const JS: &str = include_str!("static/dashboard.js");

async fn css() -> Response {
    ([(CONTENT_TYPE, "text/css; charset=utf-8")], CSS).into_response()
}

async fn js() -> Response {
    ([(CONTENT_TYPE, "text/javascript; charset=utf-8")], JS).into_response()
}

/// Headers on every dashboard answer: nothing cached (pages show private data), no framing,
/// scripts and styles from here only, and no `Referer` to other sites (a login link's token
/// must not leak; `no-referrer` would make browsers send `Origin: null`, which
/// [`auth::same_origin`] refuses).
async fn headers(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    for (name, value) in [
        ("cache-control", "no-store"),
        (
            "content-security-policy",
            "default-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
        ),
        ("x-frame-options", "DENY"),
        ("x-content-type-options", "nosniff"),
        ("referrer-policy", "same-origin"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

/// The `/dashboard/` routes, merged beside the API's (`crate::api::router`); the link route
/// `POST /v1/dashboard/links` is the API's ([`auth::create_link`]).
pub fn router(state: AppState) -> Router {
    Router::new()
        .route(
            "/dashboard",
            get(|| async { Redirect::permanent("/dashboard/") }),
        )
        .route("/dashboard/", get(routes::user_page))
        .route("/dashboard/admin", get(routes::admin_page))
        .route("/dashboard/jobs/{id}", get(routes::job_page))
        .route("/dashboard/jobs/{id}/cancel", post(routes::cancel_job))
        .route("/dashboard/jobs/{id}/remove", post(routes::remove_job))
        .route("/dashboard/events", get(live::events))
        .route("/dashboard/login", get(auth::login_page).post(auth::log_in))
        .route("/dashboard/logout", post(auth::log_out))
        .route("/dashboard/sessions", post(routes::new_session))
        .route(
            "/dashboard/sessions/{name}/{action}",
            post(routes::session_action),
        )
        .route("/dashboard/freeze", post(routes::freeze))
        .route("/dashboard/admin/institutes", post(routes::add_institute))
        .route(
            "/dashboard/admin/institutes/{name}/remove",
            post(routes::remove_institute),
        )
        .route(
            "/dashboard/admin/nodes/{name}/{action}",
            post(routes::node_drain),
        )
        .route(
            "/dashboard/admin/gpus/{uuid}/{action}",
            post(routes::gpu_drain),
        )
        .route("/dashboard/static/dashboard.css", get(css))
        .route("/dashboard/static/dashboard.js", get(js))
        .layer(axum::middleware::from_fn(auth::same_origin))
        .layer(axum::middleware::from_fn(
            crate::app::error::log_page_refusals,
        ))
        .layer(axum::middleware::from_fn(headers))
        .layer(axum::middleware::from_fn(
            crate::request_body::read_whole_body,
        ))
        .layer(axum::middleware::from_fn(crate::metrics::count_requests))
        .with_state(state.clone())
        .merge(apps::router(state))
}
