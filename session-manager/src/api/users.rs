//! Admin routes of users (`devctl admin user ls | rm | restore | link | unlink | links`):
//! `GET /v1/users`, `DELETE /v1/users/{dn}[?force=true]`, `POST /v1/users/{dn}/restore`; the DN
//! is one percent-encoded path segment. `GET | PUT /v1/token-links` and `DELETE
//! /v1/token-links/{issuer}/{subject}`: token identities linked to users
//! ([`crate::app::token_links`]).
//!
//! What a removal does, and why it is refused, is [`crate::app::users`]'s.

use axum::extract::State;
use axum::Json;
use ongrid_core::api::{LinkToken, TokenLinkView, UserRemoved, UserView};
use serde::Deserialize;

use super::callers::CurrentUser;
use super::{AdminJson, AdminQuery, ApiError, ApiPath, AppState};
use crate::app::{token_links, users as app_users};

pub async fn list_users(
    State(state): State<AppState>,
    caller: CurrentUser,
) -> Result<Json<Vec<UserView>>, ApiError> {
    let admin = caller.require_admin("list users")?;
    Ok(Json(app_users::list(&state, admin).await?))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoveQuery {
    /// End the user's sessions and cancel their running jobs instead of refusing.
    #[serde(default)]
    force: bool,
}

pub async fn remove_user(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(dn): ApiPath<String>,
    query: AdminQuery<RemoveQuery>,
) -> Result<Json<UserRemoved>, ApiError> {
    let admin = caller.require_admin("remove users")?;
    let query = query.parse(admin)?;
    Ok(Json(
        app_users::remove(&state, &caller, admin, &dn, query.force).await?,
    ))
}

pub async fn restore_user(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(dn): ApiPath<String>,
) -> Result<Json<UserView>, ApiError> {
    let admin = caller.require_admin("restore users")?;
    Ok(Json(app_users::restore(&state, &caller, admin, &dn).await?))
}

/// `GET /v1/token-links` (admins): the token identities linked to users.
pub async fn list_token_links(
    State(state): State<AppState>,
    caller: CurrentUser,
) -> Result<Json<Vec<TokenLinkView>>, ApiError> {
    caller.require_admin(token_links::MANAGE)?;
    Ok(Json(token_links::list(&state).await?))
}

/// `PUT /v1/token-links` (admins): the tokens of an issuer's subject act as the user of a DN.
pub async fn link_token(
    State(state): State<AppState>,
    caller: CurrentUser,
    body: AdminJson<LinkToken>,
) -> Result<Json<TokenLinkView>, ApiError> {
    let body = body
        .parse(caller.require_admin(token_links::MANAGE)?)
        .await?;
    Ok(Json(token_links::link(&state, &caller, body).await?))
}

/// `DELETE /v1/token-links/{issuer}/{subject}` (admins): the issuer by name or URL and the
/// subject, each one percent-encoded path segment.
pub async fn unlink_token(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath((issuer, subject)): ApiPath<(String, String)>,
) -> Result<Json<TokenLinkView>, ApiError> {
    caller.require_admin(token_links::MANAGE)?;
    Ok(Json(
        token_links::unlink(&state, &caller, &issuer, &subject).await?,
    ))
}
