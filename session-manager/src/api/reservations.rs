//! Routes for owned GPUs and reservations (site policy). Admins only change them:
//! `PUT|DELETE /v1/gpus/{uuid}/owner` and `PUT|DELETE /v1/nodes/{name}/owner` (`devctl admin gpu
//! owner`, `admin node owner`), `POST /v1/reservations` and `DELETE /v1/reservations/{name}`
//! (`devctl admin reservation add|rm`). Everyone may read them (`GET /v1/owners`,
//! `GET /v1/reservations`, `GET /v1/reservations/{name}`), so users know why their work waits
//! and which reservation to name. The use cases are [`crate::app::reservations`]'s.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use ongrid_core::reservation::{NewReservation, OwnerView, ReservationView, SetOwner};

use super::callers::CurrentUser;
use super::{AdminJson, ApiError, ApiPath, AppState};
use crate::app::reservations::{
    self, admins_only, gpu_owner, group, node_owner, GPU_OWNERS, NODE_OWNERS,
};

pub async fn set_gpu_owner(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(uuid): ApiPath<String>,
    body: AdminJson<SetOwner>,
) -> Result<Json<OwnerView>, ApiError> {
    let body = body.parse(admins_only(&caller, GPU_OWNERS)?).await?;
    Ok(Json(
        gpu_owner(&state, &caller, &uuid, Some(group(&body.group)?)).await?,
    ))
}

pub async fn clear_gpu_owner(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(uuid): ApiPath<String>,
) -> Result<Json<OwnerView>, ApiError> {
    Ok(Json(gpu_owner(&state, &caller, &uuid, None).await?))
}

pub async fn set_node_owner(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
    body: AdminJson<SetOwner>,
) -> Result<Json<OwnerView>, ApiError> {
    let body = body.parse(admins_only(&caller, NODE_OWNERS)?).await?;
    Ok(Json(
        node_owner(&state, &caller, &name, Some(group(&body.group)?)).await?,
    ))
}

pub async fn clear_node_owner(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<OwnerView>, ApiError> {
    Ok(Json(node_owner(&state, &caller, &name, None).await?))
}

/// `GET /v1/owners`: owned nodes, then owned GPUs, by name.
pub async fn list_owners(
    State(state): State<AppState>,
    _caller: CurrentUser,
) -> Result<Json<Vec<OwnerView>>, ApiError> {
    Ok(Json(reservations::owners(&state).await?))
}

pub async fn list_reservations(
    State(state): State<AppState>,
    _caller: CurrentUser,
) -> Result<Json<Vec<ReservationView>>, ApiError> {
    Ok(Json(reservations::list(&state).await?))
}

pub async fn show_reservation(
    State(state): State<AppState>,
    _caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<ReservationView>, ApiError> {
    Ok(Json(reservations::show(&state, &name).await?))
}

pub async fn add_reservation(
    State(state): State<AppState>,
    caller: CurrentUser,
    body: AdminJson<NewReservation>,
) -> Result<(StatusCode, Json<ReservationView>), ApiError> {
    let admin = admins_only(&caller, "reserve GPUs")?;
    let body = body.parse(admin).await?;
    let view = reservations::add(&state, &caller, admin, body).await?;
    Ok((StatusCode::CREATED, Json(view)))
}

pub async fn remove_reservation(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<ReservationView>, ApiError> {
    let admin = admins_only(&caller, "remove reservations")?;
    Ok(Json(
        reservations::remove(&state, &caller, admin, &name).await?,
    ))
}
