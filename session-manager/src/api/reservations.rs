//! Routes for owned GPUs and reservations (site policy). Admins only change them:
//! `PUT|DELETE /v1/gpus/{uuid}/owner` and `PUT|DELETE /v1/nodes/{name}/owner` (`devctl admin gpu
//! owner`, `admin node owner`), `POST /v1/reservations` and `DELETE /v1/reservations/{name}`
//! (`devctl admin reservation add|rm`). Everyone may read them (`GET /v1/owners`,
//! `GET /v1/reservations`, `GET /v1/reservations/{name}`), so users know why their work waits
//! and which reservation to name. The rules are in
//! [`crate::domain::policy::reservations`]; what the scheduler does with them, in
//! `ongrid_scheduler`.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use ongrid_core::reservation::{NewReservation, OwnerView, ReservationView, SetOwner};
use ongrid_core::{GpuUuid, NodeName};

use super::callers::{Admin, CurrentUser};
use super::{AdminJson, ApiError, ApiPath, AppState};
use crate::app::Effect;
use crate::domain::policy::reservations::{check_new, ReservationName, ReservationRecord};
use crate::domain::policy::GroupName;
use crate::gpu_policy::GpuPolicy;

fn admins_only(caller: &CurrentUser, what: &str) -> Result<Admin, ApiError> {
    caller.admin_or(|| {
        ApiError::forbidden(format!(
            "only admins can {what}; admins are listed in the manager's config"
        ))
    })
}

const GPU_OWNERS: &str = "give GPUs owners";
const NODE_OWNERS: &str = "give nodes owners";

fn group(text: &str) -> Result<GroupName, ApiError> {
    GroupName::parse(text.trim()).map_err(ApiError::bad_request)
}

fn reservation_name(text: &str) -> Result<ReservationName, ApiError> {
    ReservationName::parse(text.trim()).map_err(ApiError::bad_request)
}

fn gpu_uuid(text: &str) -> Result<GpuUuid, ApiError> {
    GpuUuid::parse(text).map_err(|e| ApiError::bad_request(e.to_string()))
}

fn node_name(text: &str) -> Result<NodeName, ApiError> {
    NodeName::parse(text).map_err(|e| ApiError::bad_request(e.to_string()))
}

async fn gpu_owner(
    state: &AppState,
    caller: &CurrentUser,
    uuid: &str,
    owner: Option<GroupName>,
) -> Result<Json<OwnerView>, ApiError> {
    admins_only(caller, GPU_OWNERS)?;
    let uuid = gpu_uuid(uuid)?;
    if !state
        .store
        .gpu_policy()
        .set_gpu_owner(&uuid, owner.as_ref())
        .await?
    {
        return Err(ApiError::not_found(format!(
            "no GPU {uuid} is registered: see `devctl gpus`"
        )));
    }
    let node = state
        .site()
        .await?
        .nodes
        .iter()
        .find(|n| n.gpus.iter().any(|g| g.info.uuid == uuid))
        .map(|n| n.name.clone())
        .ok_or_else(|| ApiError::internal(format!("GPU {uuid} has no node")))?;
    tracing::info!(gpu = %uuid, owner = ?owner.as_ref().map(GroupName::as_str), by = %caller.user.user_name, "GPU owner set.");
    state.committed(&[Effect::Scheduling]);
    Ok(Json(OwnerView {
        node,
        gpu: Some(uuid),
        group: owner.map(|g| g.to_string()),
    }))
}

async fn node_owner(
    state: &AppState,
    caller: &CurrentUser,
    name: &str,
    owner: Option<GroupName>,
) -> Result<Json<OwnerView>, ApiError> {
    admins_only(caller, NODE_OWNERS)?;
    let name = node_name(name)?;
    if !state
        .store
        .gpu_policy()
        .set_node_owner(&name, owner.as_ref())
        .await?
    {
        return Err(ApiError::not_found(format!(
            "no node {name} is registered: see `devctl admin node ls`"
        )));
    }
    tracing::info!(node = %name, owner = ?owner.as_ref().map(GroupName::as_str), by = %caller.user.user_name, "Node owner set.");
    state.committed(&[Effect::Scheduling]);
    Ok(Json(OwnerView {
        node: name,
        gpu: None,
        group: owner.map(|g| g.to_string()),
    }))
}

pub async fn set_gpu_owner(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(uuid): ApiPath<String>,
    body: AdminJson<SetOwner>,
) -> Result<Json<OwnerView>, ApiError> {
    let body = body.parse(admins_only(&caller, GPU_OWNERS)?).await?;
    gpu_owner(&state, &caller, &uuid, Some(group(&body.group)?)).await
}

pub async fn clear_gpu_owner(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(uuid): ApiPath<String>,
) -> Result<Json<OwnerView>, ApiError> {
    gpu_owner(&state, &caller, &uuid, None).await
}

pub async fn set_node_owner(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
    body: AdminJson<SetOwner>,
) -> Result<Json<OwnerView>, ApiError> {
    let body = body.parse(admins_only(&caller, NODE_OWNERS)?).await?;
    node_owner(&state, &caller, &name, Some(group(&body.group)?)).await
}

pub async fn clear_node_owner(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<OwnerView>, ApiError> {
    node_owner(&state, &caller, &name, None).await
}

/// `GET /v1/owners`: owned nodes, then owned GPUs, by name.
pub async fn list_owners(
    State(state): State<AppState>,
    _caller: CurrentUser,
) -> Result<Json<Vec<OwnerView>>, ApiError> {
    let policy = GpuPolicy::load(state.store.as_ref()).await?;
    let site = state.site().await?;
    let mut views: Vec<OwnerView> = policy
        .owners
        .nodes
        .iter()
        .map(|(node, group)| OwnerView {
            node: node.clone(),
            gpu: None,
            group: Some(group.to_string()),
        })
        .collect();
    for node in &site.nodes {
        for gpu in &node.gpus {
            if let Some(group) = policy.owners.gpus.get(&gpu.info.uuid) {
                views.push(OwnerView {
                    node: node.name.clone(),
                    gpu: Some(gpu.info.uuid.clone()),
                    group: Some(group.to_string()),
                });
            }
        }
    }
    Ok(Json(views))
}

pub async fn list_reservations(
    State(state): State<AppState>,
    _caller: CurrentUser,
) -> Result<Json<Vec<ReservationView>>, ApiError> {
    let policy = GpuPolicy::load(state.store.as_ref()).await?;
    let site = state.site().await?;
    let now = state.clock.now();
    Ok(Json(
        policy
            .reservations_with_gpus(&site)
            .into_iter()
            .map(|(r, gpus)| r.view(gpus, now))
            .collect(),
    ))
}

pub async fn show_reservation(
    State(state): State<AppState>,
    _caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<ReservationView>, ApiError> {
    let name = reservation_name(&name)?;
    let policy = GpuPolicy::load(state.store.as_ref()).await?;
    let site = state.site().await?;
    policy
        .reservations_with_gpus(&site)
        .into_iter()
        .find(|(r, _)| r.name == name)
        .map(|(r, gpus)| Json(r.view(gpus, state.clock.now())))
        .ok_or_else(|| no_such_reservation(&name))
}

fn no_such_reservation(name: &ReservationName) -> ApiError {
    ApiError::not_found(format!(
        "there is no reservation {name}: `devctl admin reservation ls` lists them"
    ))
}

pub async fn add_reservation(
    State(state): State<AppState>,
    caller: CurrentUser,
    body: AdminJson<NewReservation>,
) -> Result<(StatusCode, Json<ReservationView>), ApiError> {
    let body = body.parse(admins_only(&caller, "reserve GPUs")?).await?;
    let store = state.store.gpu_policy();
    let now = state.clock.now();
    let record = ReservationRecord {
        name: reservation_name(&body.name)?,
        group: group(&body.group)?,
        node: body.node.clone(),
        gpus: body.gpus.clone(),
        from: body.from,
        to: body.to,
        created_by: caller.user.user_name.clone(),
        created_at: now,
    };
    let site = state.site().await?;
    let gpus = match (&body.node, body.gpus.is_empty()) {
        (Some(node), true) => site
            .nodes
            .iter()
            .find(|n| n.name == *node)
            .ok_or_else(|| {
                ApiError::not_found(format!(
                    "no node {node} is registered: see `devctl admin node ls`"
                ))
            })?
            .gpus
            .iter()
            .map(|g| g.info.uuid.clone())
            .collect(),
        (None, false) => {
            let known = |uuid: &GpuUuid| {
                site.nodes
                    .iter()
                    .any(|n| n.gpus.iter().any(|g| g.info.uuid == *uuid))
            };
            if let Some(unknown) = body.gpus.iter().find(|uuid| !known(uuid)) {
                return Err(ApiError::not_found(format!(
                    "no GPU {unknown} is registered: see `devctl gpus`"
                )));
            }
            body.gpus.clone()
        }
        _ => {
            return Err(ApiError::bad_request(
                "name the GPUs with --gpus or a whole node with --node, not both",
            ))
        }
    };
    let policy = GpuPolicy::load(state.store.as_ref()).await?;
    check_new(&record, &gpus, &policy.reservations_with_gpus(&site), now)?;
    if !store.add_reservation(&record).await? {
        return Err(ApiError::conflict(format!(
            "reservation {} already exists: pick another name",
            record.name
        )));
    }
    tracing::info!(reservation = %record.name, group = %record.group, gpus = gpus.len(), from = %record.from, to = %record.to, by = %caller.user.user_name, "Reservation added.");
    state.committed(&[Effect::Scheduling]);
    Ok((StatusCode::CREATED, Json(record.view(gpus, now))))
}

pub async fn remove_reservation(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<ReservationView>, ApiError> {
    admins_only(&caller, "remove reservations")?;
    let name = reservation_name(&name)?;
    let site = state.site().await?;
    let removed = state
        .store
        .gpu_policy()
        .remove_reservation(&name)
        .await?
        .ok_or_else(|| no_such_reservation(&name))?;
    tracing::info!(reservation = %name, by = %caller.user.user_name, "Reservation removed.");
    state.committed(&[Effect::Scheduling]);
    let policy = GpuPolicy {
        reservations: vec![removed],
        ..GpuPolicy::default()
    };
    let (record, gpus) = policy
        .reservations_with_gpus(&site)
        .into_iter()
        .next()
        .ok_or_else(|| ApiError::internal("the removed reservation vanished"))?;
    Ok(Json(record.view(gpus, state.clock.now())))
}
