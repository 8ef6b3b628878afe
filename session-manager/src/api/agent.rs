//! Routes for node agents: registration, the periodic sync and the long-poll of the desired
//! state, as [`crate::app::agent_sync`] decides them. Every answer carrying a desired state names
//! its version in `ETag`; the long-poll (`GET /v1/agent/desired?after=<version>&timeout=<s>`)
//! answers 204 with the same version when nothing changed in time.

use std::time::Duration;

use axum::extract::State;
use axum::http::header::{CONTENT_TYPE, ETAG};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use ongrid_core::api::{NodeReport, RegisterNode};
use serde::Deserialize;

use super::callers::AgentNode;
use super::{ApiError, ApiJson, ApiQuery, AppState};
use crate::app::agent_sync::{self, Desired, Versioned, DESIRED_WAIT};

pub async fn register(
    State(state): State<AppState>,
    AgentNode(node): AgentNode,
    ApiJson(body): ApiJson<RegisterNode>,
) -> Result<Response, ApiError> {
    agent_sync::register(&state, &node, body)
        .await
        .map(versioned)
}

pub async fn sync(
    State(state): State<AppState>,
    AgentNode(node): AgentNode,
    ApiJson(report): ApiJson<NodeReport>,
) -> Result<Response, ApiError> {
    agent_sync::sync(&state, &node, report).await.map(versioned)
}

/// `GET /v1/agent/desired?after=<version>&timeout=<seconds>`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DesiredQuery {
    /// The version (`ETag`) of the desired state the agent has; none: answer at once.
    after: Option<String>,
    /// How long to wait for a change, in seconds.
    timeout: Option<u64>,
}

/// The long-poll: the node's desired state once it differs from `after`, else 204 with the
/// same version.
pub async fn desired(
    State(state): State<AppState>,
    AgentNode(node): AgentNode,
    ApiQuery(query): ApiQuery<DesiredQuery>,
) -> Result<Response, ApiError> {
    let wait = query.timeout.map_or(DESIRED_WAIT, Duration::from_secs);
    match agent_sync::next_desired(&state, &node, query.after.as_deref(), wait).await? {
        Desired::Changed(desired) => Ok(versioned(desired)),
        Desired::Unchanged(version) => {
            Ok((StatusCode::NO_CONTENT, [(ETAG, etag(&version))]).into_response())
        }
    }
}

fn etag(version: &str) -> HeaderValue {
    // Hex digits only: always a valid header value.
    HeaderValue::from_str(&format!("\"{version}\"")).unwrap_or(HeaderValue::from_static("\"\""))
}

/// The desired state as JSON with its version in `ETag`.
fn versioned(desired: Versioned) -> Response {
    let headers = [
        (ETAG, etag(&desired.version)),
        (CONTENT_TYPE, HeaderValue::from_static("application/json")),
    ];
    (headers, desired.json).into_response()
}
