//! Routes for the site's nodes and GPUs: `GET /v1/nodes` and `GET /v1/nodes/{name}` (every
//! user; others' sessions are counted but not named), and the admins' operations: GPU modes,
//! draining and undraining nodes and GPUs, forgetting a node.
//!
//! A drain only stops new placements (the scheduler leaves drained nodes and GPUs out); what
//! runs there keeps running. `GET /v1/nodes/{name}?wait_empty=true` answers once nothing holds
//! the node's GPUs any more (no running session, no job holding GPUs) or after `timeout`
//! seconds: `devctl admin node drain --wait` asks it again until the node is empty.

use std::time::Duration;

use axum::extract::State;
use axum::Json;
use ongrid_core::api::{DrainRequest, GpuView, NodeView, SetGpuMode};
use ongrid_core::{GpuMode, GpuUuid, NodeName};
use serde::Deserialize;

use super::callers::CurrentUser;
use super::{AdminJson, ApiError, ApiPath, ApiQuery, AppState};
use crate::app::nodes::{DrainChange, NodeError};
use crate::app::{self, Via};
use crate::site::SiteSnapshot;
use crate::store::{GpuRecord, NodeRecord};

/// The longest `wait_empty` waits in one request.
pub const MAX_NODE_WAIT: Duration = Duration::from_secs(60);

pub async fn list_nodes(
    State(state): State<AppState>,
    caller: CurrentUser,
) -> Result<Json<Vec<NodeView>>, ApiError> {
    let site = state.site().await?;
    let views = site
        .nodes
        .iter()
        .map(|node| node_view(&site, &caller, node))
        .collect();
    Ok(Json(views))
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
    let name = parse_node(&name)?;
    let wait = query
        .timeout
        .map_or(MAX_NODE_WAIT, Duration::from_secs)
        .min(MAX_NODE_WAIT);
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        // Subscribed before the read, so no change between the read and the wait is missed.
        let mut changes = state.changes.subscribe();
        let view = find_node(&state, &caller, &name).await?;
        let empty = view.sessions == 0 && view.jobs == 0;
        if !query.wait_empty || empty {
            return Ok(Json(view));
        }
        match tokio::time::timeout_at(deadline, changes.changed(Some(&name))).await {
            Ok(true) => {}
            Ok(false) | Err(_) => return Ok(Json(view)),
        }
    }
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
    Ok(Json(find_node(&state, &caller, &name).await?))
}

pub async fn undrain_node(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<NodeView>, ApiError> {
    let name = app::nodes::drain_node(&state, &caller, &name, DrainChange::Undrain, Via::Api)
        .await
        .map_err(node_refused)?;
    Ok(Json(find_node(&state, &caller, &name).await?))
}

pub async fn remove_node(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<NodeView>, ApiError> {
    caller.require_admin("can remove a node")?;
    let name = parse_node(&name)?;
    let view = find_node(&state, &caller, &name).await?;
    app::nodes::remove(&state, &caller, &name)
        .await
        .map_err(node_refused)?;
    Ok(Json(view))
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
    find_gpu(&state, &caller, &uuid).await
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
    find_gpu(&state, &caller, &gpu.info.uuid).await
}

pub async fn undrain_gpu(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(uuid): ApiPath<String>,
) -> Result<Json<GpuView>, ApiError> {
    let gpu = app::nodes::drain_gpu(&state, &caller, &uuid, DrainChange::Undrain, Via::Api)
        .await
        .map_err(node_refused)?;
    find_gpu(&state, &caller, &gpu.info.uuid).await
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

async fn find_node(
    state: &AppState,
    caller: &CurrentUser,
    name: &NodeName,
) -> Result<NodeView, ApiError> {
    let site = state.site().await?;
    site.nodes
        .iter()
        .find(|node| node.name == *name)
        .map(|node| node_view(&site, caller, node))
        .ok_or_else(|| no_such_node(name))
}

async fn find_gpu(
    state: &AppState,
    caller: &CurrentUser,
    uuid: &GpuUuid,
) -> Result<Json<GpuView>, ApiError> {
    let site = state.site().await?;
    site.nodes
        .iter()
        .find_map(|node| {
            let gpu = node.gpus.iter().find(|g| g.info.uuid == *uuid)?;
            Some(Json(gpu_view(&site, caller, node, gpu)))
        })
        .ok_or_else(|| no_such_gpu(uuid))
}

fn node_view(site: &SiteSnapshot, caller: &CurrentUser, node: &NodeRecord) -> NodeView {
    let on_node = |n: &Option<NodeName>| n.as_ref() == Some(&node.name);
    NodeView {
        name: node.name.clone(),
        online: site.is_online(node),
        last_seen: node.last_seen,
        gpu_backend: node.gpu_backend.clone(),
        gpus: node
            .gpus
            .iter()
            .map(|gpu| gpu_view(site, caller, node, gpu))
            .collect(),
        agent_version: node.agent_version.clone(),
        drain: node.drain.clone(),
        sessions: count(site.holding.iter().filter(|s| on_node(&s.node))),
        jobs: count(
            site.jobs
                .iter()
                .filter(|j| j.state().holds_gpus() && on_node(&j.node)),
        ),
    }
}

fn count<T>(items: impl Iterator<Item = T>) -> u32 {
    u32::try_from(items.count()).unwrap_or(u32::MAX)
}

/// A GPU as `caller` may see it: sessions of others are counted but not named (admins see all).
fn gpu_view(
    site: &SiteSnapshot,
    caller: &CurrentUser,
    node: &NodeRecord,
    gpu: &GpuRecord,
) -> GpuView {
    let mut view = GpuView {
        info: gpu.info.clone(),
        node: node.name.clone(),
        mode: gpu.mode,
        used: site.used(&gpu.info.uuid),
        free: site.free(node, gpu),
        sessions: site
            .sessions_on(&gpu.info.uuid)
            .filter(|s| caller.admin || s.owner == caller.user.dn)
            .map(|s| s.name.clone())
            .collect(),
        drain: gpu.drain.clone(),
        mig_sessions: Default::default(),
    };
    if let Some(layout) = gpu.mode.mig_layout() {
        // A GPU in MIG mode: its places are its devices.
        let slots: Vec<_> = site
            .reported_mig_slots()
            .into_iter()
            .filter(|slot| slot.parent == gpu.info.uuid)
            .collect();
        let held = slots.iter().filter(|slot| slot.used).count();
        view.used = u32::try_from(held).unwrap_or(u32::MAX);
        let out_of_service = !gpu.info.health.is_healthy()
            || !site.is_online(node)
            || gpu.drain.is_some()
            || node.drain.is_some()
            || !layout.is_made_by(&gpu.info.mig_devices);
        view.free = if out_of_service {
            0
        } else {
            u32::try_from(slots.len() - held).unwrap_or(u32::MAX)
        };
        for session in site
            .holding_sessions()
            .filter(|s| caller.admin || s.owner == caller.user.dn)
        {
            for id in &session.gpus {
                if let ongrid_core::GpuId::Mig(mig) = id {
                    if slots.iter().any(|slot| &slot.uuid == mig) {
                        view.mig_sessions.insert(mig.clone(), session.name.clone());
                        if !view.sessions.contains(&session.name) {
                            view.sessions.push(session.name.clone());
                        }
                    }
                }
            }
        }
    }
    view
}
