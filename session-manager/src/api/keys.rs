//! Routes for users' SSH public keys: `devctl key add | ls | rm` ([`crate::app::keys`]).
//! Adding a key the caller already has renews it (200); a new one is 201. Users see their own
//! keys; admins list everyone's with `?all=true`.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use ongrid_core::api::{AddKey, KeyView};
use serde::Deserialize;

use super::callers::CurrentUser;
use super::{ApiError, ApiJson, ApiQuery, AppState};
use crate::app::keys;
use crate::app::lookup::ListQuery;
use crate::store::{KeyAdded, KeyRecord};

pub async fn add_key(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiJson(body): ApiJson<AddKey>,
) -> Result<(StatusCode, Json<KeyView>), ApiError> {
    Ok(match keys::add(&state, &caller, body).await? {
        KeyAdded::New(record) => (StatusCode::CREATED, Json(key_view(record))),
        KeyAdded::Renewed(record) => (StatusCode::OK, Json(key_view(record))),
    })
}

pub async fn list_keys(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiQuery(query): ApiQuery<ListQuery>,
) -> Result<Json<Vec<KeyView>>, ApiError> {
    let keys = keys::list(&state, &caller, query.all).await?;
    Ok(Json(keys.into_iter().map(key_view).collect()))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoveQuery {
    fingerprint: Option<String>,
}

pub async fn remove_key(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiQuery(query): ApiQuery<RemoveQuery>,
) -> Result<Json<KeyView>, ApiError> {
    let fingerprint = query.fingerprint.unwrap_or_default();
    Ok(Json(key_view(
        keys::remove(&state, &caller, &fingerprint).await?,
    )))
}

pub fn key_view(key: KeyRecord) -> KeyView {
    KeyView {
        fingerprint: key.fingerprint,
        algorithm: key.algorithm,
        comment: key.comment,
        owner: key.owner,
        added_at: key.added_at,
        expires_at: key.expires_at,
    }
}
