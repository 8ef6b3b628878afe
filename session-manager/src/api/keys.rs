//! Routes for users' SSH public keys: `devctl key add | ls | rm`.
//!
//! A key is bound to the DN of the certificate the caller presented and expires with it (the
//! earliest notAfter of its chain), so a grid proxy's lifetime bounds SSH access too. A key
//! registered with a bearer token expires with the token, or, when the site sets its issuer's
//! `key_lifetime`, that long after it was registered (tokens live minutes to hours). A limited
//! proxy may list and remove keys but not add one, unless the config's
//! `limited_proxies_may_register_keys` allows it: SSH access is a way to start processes, which
//! a limited proxy is meant not to grant. Adding a key the caller already
//! has renews it (200); a key registered by someone else is a 409, as is a 33rd key. Users see
//! and remove only their own keys; admins list everyone's with `?all=true` and remove any.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use ongrid_core::api::{AddKey, KeyView};
use serde::Deserialize;

use super::callers::CurrentUser;
use super::{ApiError, ApiJson, ApiQuery, AppState};
use crate::keys::SshPublicKey;
use crate::store::{KeyAdded, KeyRecord, NewKey, StoreError};

/// The most keys one user may have.
pub const MAX_KEYS_PER_USER: usize = 32;

pub async fn add_key(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiJson(body): ApiJson<AddKey>,
) -> Result<(StatusCode, Json<KeyView>), ApiError> {
    if caller.is_limited() && !state.config.limited_proxies_may_register_keys {
        return Err(ApiError::forbidden(
            "a limited proxy cannot register SSH keys: make a full proxy (voms-proxy-init or \
             grid-proxy-init without -limited) and run `devctl key add` again",
        ));
    }
    let key = SshPublicKey::parse_for_registration(&body.public_key)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let now = state.clock.now();
    let token = caller.identity.token.as_ref();
    let expires_at = match token.and_then(|token| token.key_lifetime) {
        Some(lifetime) => now + chrono::Duration::from_std(lifetime).unwrap_or_default(),
        None => caller.not_after,
    };
    let new = NewKey {
        fingerprint: key.fingerprint.clone(),
        owner: caller.user.dn.clone(),
        algorithm: key.algorithm,
        public_key: key.openssh,
        comment: key.comment,
        at: now,
        expires_at,
        fqans: caller
            .identity
            .fqans
            .iter()
            .map(ToString::to_string)
            .collect(),
        token_issuer: token.map(|token| token.issuer_name.clone()),
    };
    let user = &caller.user.user_name;
    match state.store.add_key(new, MAX_KEYS_PER_USER).await {
        Ok(KeyAdded::New(record)) => {
            tracing::info!(%user, fingerprint = %record.fingerprint, expires_at = %record.expires_at, "SSH key added.");
            Ok((StatusCode::CREATED, Json(key_view(record))))
        }
        Ok(KeyAdded::Renewed(record)) => {
            tracing::info!(%user, fingerprint = %record.fingerprint, expires_at = %record.expires_at, "SSH key renewed.");
            Ok((StatusCode::OK, Json(key_view(record))))
        }
        Err(StoreError::KeyTaken { fingerprint }) => Err(ApiError::conflict(format!(
            "key {fingerprint} is registered to another user: make a key of your own with \
             `ssh-keygen -t ed25519` and add it"
        ))),
        Err(StoreError::TooManyKeys { max }) => Err(ApiError::conflict(format!(
            "you already have {max} keys, the most allowed: remove one with \
             `devctl key rm FINGERPRINT` (see `devctl key ls`)"
        ))),
        Err(other) => Err(other.into()),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    #[serde(default)]
    all: bool,
}

pub async fn list_keys(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiQuery(query): ApiQuery<ListQuery>,
) -> Result<Json<Vec<KeyView>>, ApiError> {
    let owner = if query.all {
        if !caller.admin {
            return Err(ApiError::forbidden(
                "only admins can list everyone's keys (?all=true); leave it out to list yours",
            ));
        }
        None
    } else {
        Some(&caller.user.dn)
    };
    let keys = state.store.keys(owner).await?;
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
    let fingerprint = fingerprint.trim();
    if !fingerprint.starts_with("SHA256:") {
        return Err(ApiError::bad_request(
            "say which key with ?fingerprint=SHA256:..., as `devctl key ls` shows it",
        ));
    }
    let owner = (!caller.admin).then_some(&caller.user.dn);
    let removed = state
        .store
        .remove_key(fingerprint, owner)
        .await?
        .ok_or_else(|| {
            if caller.admin {
                ApiError::not_found(format!(
                    "no key {fingerprint} is registered: see `devctl key ls`"
                ))
            } else {
                ApiError::not_found(format!(
                    "you have no key {fingerprint}: list yours with `devctl key ls`"
                ))
            }
        })?;
    tracing::info!(by = %caller.user.user_name, owner = %removed.owner, fingerprint = %removed.fingerprint, "SSH key removed.");
    Ok(Json(key_view(removed)))
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
