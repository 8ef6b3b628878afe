//! Routes for the site's nodes and GPUs: `GET /v1/nodes` and `GET /v1/nodes/{name}` (every
//! user; others' sessions are counted but not named), and the admins' operations: GPU modes,
//! draining and undraining nodes and GPUs, forgetting a node.
//!
//! A drain only stops new placements (the scheduler leaves drained nodes and GPUs out); what
//! runs there keeps running. `GET /v1/nodes/{name}?wait_empty=true` answers once nothing holds
//! the node's GPUs any more (no running session, no job holding GPUs) or after `timeout`
//! seconds: `devctl admin node drain --wait` asks it again until the node is empty.

use axum::extract::State;
use axum::Json;
use ongrid_core::api::{DrainRequest, GpuView, NodeView, SetGpuMode};
use ongrid_core::{GpuMode, GpuUuid, NodeName};
use serde::Deserialize;

use super::callers::CurrentUser;
use super::{poll_timeout, AdminJson, ApiError, ApiPath, ApiQuery, AppState};
use crate::app::nodes::{DrainChange, NodeError, MAX_NODE_WAIT};
use crate::app::{self, Via};

pub async fn list_nodes(
    State(state): State<AppState>,
    caller: CurrentUser,
) -> Result<Json<Vec<NodeView>>, ApiError> {
    Ok(Json(app::nodes::list(&state, &caller).await?))
}

/// `GET /v1/nodes/{name}[?wait_empty=true[&timeout=SECONDS]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShowNodeQuery {
    #[serde(default)]
    wait_empty: bool,
    /// How long `wait_empty` waits, in seconds (default and maximum: [`MAX_NODE_WAIT`]).
    timeout: Option<u64>,
}

pub async fn show_node(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
    ApiQuery(query): ApiQuery<ShowNodeQuery>,
) -> Result<Json<NodeView>, ApiError> {
    let wait = query
        .wait_empty
        .then(|| poll_timeout(query.timeout, MAX_NODE_WAIT));
    let view = app::nodes::show(&state, &caller, &name, wait)
        .await
        .map_err(node_refused)?;
    Ok(Json(view))
}

pub async fn drain_node(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
    body: AdminJson<DrainRequest>,
) -> Result<Json<NodeView>, ApiError> {
    let body = body
        .parse(caller.require_admin("can drain a node")?)
        .await?;
    let change = DrainChange::Drain {
        reason: body.reason.as_deref(),
    };
    let name = app::nodes::drain_node(&state, &caller, &name, change, Via::Api)
        .await
        .map_err(node_refused)?;
    node_answer(&state, &caller, &name).await
}

pub async fn undrain_node(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<NodeView>, ApiError> {
    let name = app::nodes::drain_node(&state, &caller, &name, DrainChange::Undrain, Via::Api)
        .await
        .map_err(node_refused)?;
    node_answer(&state, &caller, &name).await
}

pub async fn remove_node(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<NodeView>, ApiError> {
    caller.require_admin("can remove a node")?;
    let name = parse_node(&name)?;
    let view = node_answer(&state, &caller, &name).await?;
    app::nodes::remove(&state, &caller, &name)
        .await
        .map_err(node_refused)?;
    Ok(view)
}

pub async fn set_gpu_mode(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(uuid): ApiPath<String>,
    body: AdminJson<SetGpuMode>,
) -> Result<Json<GpuView>, ApiError> {
    let body = body
        .parse(caller.require_admin("can change a GPU's mode")?)
        .await?;
    let uuid = parse_gpu(&uuid)?;
    // The core's parser holds the rules (shared:N with N from 2 to 64).
    let mode: GpuMode = body
        .mode
        .to_string()
        .parse()
        .map_err(|e: ongrid_core::gpu::GpuModeError| ApiError::bad_request(e.to_string()))?;
    app::nodes::set_gpu_mode(&state, &caller, &uuid, mode)
        .await
        .map_err(node_refused)?;
    gpu_answer(&state, &caller, &uuid).await
}

pub async fn drain_gpu(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(uuid): ApiPath<String>,
    body: AdminJson<DrainRequest>,
) -> Result<Json<GpuView>, ApiError> {
    let body = body.parse(caller.require_admin("can drain a GPU")?).await?;
    let change = DrainChange::Drain {
        reason: body.reason.as_deref(),
    };
    let gpu = app::nodes::drain_gpu(&state, &caller, &uuid, change, Via::Api)
        .await
        .map_err(node_refused)?;
    gpu_answer(&state, &caller, &gpu.info.uuid).await
}

pub async fn undrain_gpu(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(uuid): ApiPath<String>,
) -> Result<Json<GpuView>, ApiError> {
    let gpu = app::nodes::drain_gpu(&state, &caller, &uuid, DrainChange::Undrain, Via::Api)
        .await
        .map_err(node_refused)?;
    gpu_answer(&state, &caller, &gpu.info.uuid).await
}

/// A drain's refusal as devctl users read it.
fn node_refused(error: NodeError) -> ApiError {
    match error {
        NodeError::NoSuchNode(name) => no_such_node(&name),
        NodeError::NoSuchGpu(uuid) => no_such_gpu(&uuid),
        NodeError::Api(error) => error,
    }
}

fn parse_node(name: &str) -> Result<NodeName, ApiError> {
    NodeName::parse(name).map_err(|e| ApiError::bad_request(e.to_string()))
}

fn parse_gpu(uuid: &str) -> Result<GpuUuid, ApiError> {
    GpuUuid::parse(uuid).map_err(|e| ApiError::bad_request(e.to_string()))
}

fn no_such_node(name: &NodeName) -> ApiError {
    ApiError::not_found(format!(
        "no node {name} is registered: see `devctl admin node ls`"
    ))
}

fn no_such_gpu(uuid: &GpuUuid) -> ApiError {
    ApiError::not_found(format!("no GPU {uuid} is registered: see `devctl gpus`"))
}

async fn node_answer(
    state: &AppState,
    caller: &CurrentUser,
    name: &NodeName,
) -> Result<Json<NodeView>, ApiError> {
    let view = app::nodes::find_node(state, caller, name)
        .await
        .map_err(node_refused)?;
    Ok(Json(view))
}

async fn gpu_answer(
    state: &AppState,
    caller: &CurrentUser,
    uuid: &GpuUuid,
) -> Result<Json<GpuView>, ApiError> {
    let view = app::nodes::gpu(state, caller, uuid)
        .await
        .map_err(node_refused)?;
    Ok(Json(view))
}
