//! Owned GPUs and reservations (site policy): admins give GPUs and nodes owners and reserve
//! GPUs for a group; everyone may read them, so users know why their work waits and which
//! reservation to name. The rules are in [`crate::domain::policy::reservations`]; what the
//! scheduler does with them, in `ongrid_scheduler`.

use ongrid_core::reservation::{NewReservation, OwnerView, ReservationView};
use ongrid_core::{GpuUuid, NodeName};

use super::caller::{Admin, CurrentUser};
use super::{ApiError, AppState, Effect};
use crate::domain::policy::reservations::{check_new, ReservationName, ReservationRecord};
use crate::domain::policy::GroupName;
use crate::scheduling::gpu_policy::GpuPolicy;

/// The proof that the caller is an admin, or a 403 saying that only admins can `what`.
pub fn admins_only(caller: &CurrentUser, what: &str) -> Result<Admin, ApiError> {
    caller.admin_or(|| {
        ApiError::forbidden(format!(
            "only admins can {what}; admins are listed in the manager's config"
        ))
    })
}

/// What only admins can do, in refusals.
pub const GPU_OWNERS: &str = "give GPUs owners";
pub const NODE_OWNERS: &str = "give nodes owners";

/// An accounting group as a request names it.
pub fn group(text: &str) -> Result<GroupName, ApiError> {
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

/// Gives the GPU `uuid` to the group `owner` (none: back to everyone).
pub async fn gpu_owner(
    state: &AppState,
    caller: &CurrentUser,
    uuid: &str,
    owner: Option<GroupName>,
) -> Result<OwnerView, ApiError> {
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
    state.committed(&[Effect::Scheduling, Effect::People]);
    Ok(OwnerView {
        node,
        gpu: Some(uuid),
        group: owner.map(|g| g.to_string()),
    })
}

/// Gives the node `name` to the group `owner` (none: back to everyone).
pub async fn node_owner(
    state: &AppState,
    caller: &CurrentUser,
    name: &str,
    owner: Option<GroupName>,
) -> Result<OwnerView, ApiError> {
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
    state.committed(&[Effect::Scheduling, Effect::People]);
    Ok(OwnerView {
        node: name,
        gpu: None,
        group: owner.map(|g| g.to_string()),
    })
}

/// Owned nodes, then owned GPUs, by name.
pub async fn owners(state: &AppState) -> Result<Vec<OwnerView>, ApiError> {
    let policy = GpuPolicy::load(state.store.as_ref(), state.clock.now()).await?;
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
        for gpu in node.gpus.iter() {
            if let Some(group) = policy.owners.gpus.get(&gpu.info.uuid) {
                views.push(OwnerView {
                    node: node.name.clone(),
                    gpu: Some(gpu.info.uuid.clone()),
                    group: Some(group.to_string()),
                });
            }
        }
    }
    Ok(views)
}

/// Every reservation, with its GPUs.
pub async fn list(state: &AppState) -> Result<Vec<ReservationView>, ApiError> {
    let now = state.clock.now();
    let policy = GpuPolicy::load(state.store.as_ref(), now).await?;
    let site = state.site().await?;
    Ok(policy
        .reservations_with_gpus(&site)
        .into_iter()
        .map(|(r, gpus)| r.view(gpus, now))
        .collect())
}

/// The reservation named `name`.
pub async fn show(state: &AppState, name: &str) -> Result<ReservationView, ApiError> {
    let name = reservation_name(name)?;
    let policy = GpuPolicy::load(state.store.as_ref(), state.clock.now()).await?;
    let site = state.site().await?;
    policy
        .reservations_with_gpus(&site)
        .into_iter()
        .find(|(r, _)| r.name == name)
        .map(|(r, gpus)| r.view(gpus, state.clock.now()))
        .ok_or_else(|| no_such_reservation(&name))
}

fn no_such_reservation(name: &ReservationName) -> ApiError {
    ApiError::not_found(format!(
        "there is no reservation {name}: `devctl admin reservation ls` lists them"
    ))
}

/// Reserves GPUs (named, or a whole node's) for a group over a time window.
pub async fn add(
    state: &AppState,
    caller: &CurrentUser,
    _admin: Admin,
    body: NewReservation,
) -> Result<ReservationView, ApiError> {
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
    let policy = GpuPolicy::load(state.store.as_ref(), now).await?;
    check_new(&record, &gpus, &policy.reservations_with_gpus(&site), now)?;
    if !store.add_reservation(&record).await? {
        return Err(ApiError::conflict(format!(
            "reservation {} already exists: pick another name",
            record.name
        )));
    }
    tracing::info!(reservation = %record.name, group = %record.group, gpus = gpus.len(), from = %record.from, to = %record.to, by = %caller.user.user_name, "Reservation added.");
    state.committed(&[Effect::Scheduling, Effect::People]);
    Ok(record.view(gpus, now))
}

/// Removes the reservation named `name`.
pub async fn remove(
    state: &AppState,
    caller: &CurrentUser,
    _admin: Admin,
    name: &str,
) -> Result<ReservationView, ApiError> {
    let name = reservation_name(name)?;
    let site = state.site().await?;
    let removed = state
        .store
        .gpu_policy()
        .remove_reservation(&name)
        .await?
        .ok_or_else(|| no_such_reservation(&name))?;
    tracing::info!(reservation = %name, by = %caller.user.user_name, "Reservation removed.");
    state.committed(&[Effect::Scheduling, Effect::People]);
    let policy = GpuPolicy {
        reservations: vec![removed],
        ..GpuPolicy::default()
    };
    let (record, gpus) = policy
        .reservations_with_gpus(&site)
        .into_iter()
        .next()
        .ok_or_else(|| ApiError::internal("the removed reservation vanished"))?;
    Ok(record.view(gpus, state.clock.now()))
}
