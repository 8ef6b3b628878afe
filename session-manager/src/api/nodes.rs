//! Routes for the site's nodes and GPUs: `GET /v1/nodes` (every user; others' sessions are
//! counted but not named) and `PUT /v1/gpus/{uuid}/mode` (admins).

use axum::extract::State;
use axum::Json;
use ongrid_core::api::{GpuView, NodeView, SetGpuMode};
use ongrid_core::{GpuMode, GpuUuid};

use super::callers::CurrentUser;
use super::{ApiError, ApiJson, ApiPath, AppState};
use crate::site::SiteSnapshot;
use crate::store::{GpuRecord, NodeRecord};

pub async fn list_nodes(
    State(state): State<AppState>,
    caller: CurrentUser,
) -> Result<Json<Vec<NodeView>>, ApiError> {
    let site = state.site().await?;
    let views = site
        .nodes
        .iter()
        .map(|node| NodeView {
            name: node.name.clone(),
            online: site.is_online(node),
            last_seen: node.last_seen,
            gpu_backend: node.gpu_backend.clone(),
            gpus: node
                .gpus
                .iter()
                .map(|gpu| gpu_view(&site, &caller, node, gpu))
                .collect(),
        })
        .collect();
    Ok(Json(views))
}

/// A GPU as `caller` may see it: sessions of others are counted but not named (admins see all).
fn gpu_view(
    site: &SiteSnapshot,
    caller: &CurrentUser,
    node: &NodeRecord,
    gpu: &GpuRecord,
) -> GpuView {
    GpuView {
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
    }
}

pub async fn set_gpu_mode(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(uuid): ApiPath<String>,
    ApiJson(body): ApiJson<SetGpuMode>,
) -> Result<Json<GpuView>, ApiError> {
    if !caller.admin {
        return Err(ApiError::forbidden(
            "only admins can change a GPU's mode; admins are listed in the manager's config",
        ));
    }
    let uuid = GpuUuid::parse(&uuid).map_err(|e| ApiError::bad_request(e.to_string()))?;
    // The core's parser holds the rules (shared:N with N from 2 to 64).
    let mode: GpuMode = body
        .mode
        .to_string()
        .parse()
        .map_err(|e: ongrid_core::gpu::GpuModeError| ApiError::bad_request(e.to_string()))?;
    state
        .store
        .set_gpu_mode(&uuid, mode)
        .await?
        .ok_or_else(|| {
            ApiError::not_found(format!("no GPU {uuid} is registered: see `devctl gpus`"))
        })?;
    tracing::info!(gpu = %uuid, %mode, by = %caller.user.user_name, "GPU mode changed.");
    state.wake.notify_one();
    let site = state.site().await?;
    site.nodes
        .iter()
        .find_map(|node| {
            let gpu = node.gpus.iter().find(|g| g.info.uuid == uuid)?;
            Some(Json(gpu_view(&site, &caller, node, gpu)))
        })
        .ok_or_else(|| ApiError::internal(format!("GPU {uuid} vanished after its mode was set")))
}
