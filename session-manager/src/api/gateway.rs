//! Routes for the SSH gateway (bearer token of `gateway_token_file`); each answers what
//! [`crate::app::gateway`] decides.

use axum::extract::State;
use axum::Json;
use ongrid_core::api::{
    Allowlist, ConnectionEvent, HeldKeys, KeyCheck, KeyOwner, RevokedKeys, Route, RouteRequest,
};
use ongrid_core::holds::SessionDeadlines;

use super::callers::GatewayCaller;
use super::{ApiError, ApiJson, AppState};
use crate::app::gateway;

pub async fn allowlist(
    State(state): State<AppState>,
    _gateway: GatewayCaller,
) -> Result<Json<Allowlist>, ApiError> {
    gateway::allowlist(&state).await.map(Json)
}

pub async fn authorize(
    State(state): State<AppState>,
    _gateway: GatewayCaller,
    ApiJson(check): ApiJson<KeyCheck>,
) -> Result<Json<KeyOwner>, ApiError> {
    gateway::authorize(&state, check).await.map(Json)
}

pub async fn check_keys(
    State(state): State<AppState>,
    _gateway: GatewayCaller,
    ApiJson(held): ApiJson<HeldKeys>,
) -> Result<Json<RevokedKeys>, ApiError> {
    gateway::check_keys(&state, held).await.map(Json)
}

pub async fn route(
    State(state): State<AppState>,
    _gateway: GatewayCaller,
    ApiJson(request): ApiJson<RouteRequest>,
) -> Result<Json<Route>, ApiError> {
    gateway::route(&state, request).await.map(Json)
}

pub async fn connection_event(
    State(state): State<AppState>,
    _gateway: GatewayCaller,
    ApiJson(event): ApiJson<ConnectionEvent>,
) -> Result<Json<SessionDeadlines>, ApiError> {
    gateway::connection_event(&state, event).await.map(Json)
}
