//! Users' SSH public keys: add (or renew), remove.
//!
//! A key is bound to the DN of the certificate the caller presented and expires with it (the
//! earliest notAfter of its chain), so a grid proxy's lifetime bounds SSH access too. A key
//! registered with a bearer token expires with the token, or, when the site sets its issuer's
//! `key_lifetime`, that long after it was registered (tokens live minutes to hours). A limited
//! proxy may remove keys but not add one, unless the config's
//! `limited_proxies_may_register_keys` allows it: SSH access is a way to start processes, which
//! a limited proxy is meant not to grant. Adding a key the caller already has renews it; a key
//! registered by someone else is refused, as is a 33rd key. Users remove only their own keys;
//! admins any.
//!
//! No long-poll watches keys (the gateway re-checks the keys of open connections on its own
//! schedule, `gateway::check_keys`), so these writes have no [`super::Effect`].

use ongrid_core::api::AddKey;

use super::caller::CurrentUser;
use super::{ApiError, AppState};
use crate::keys::SshPublicKey;
use crate::store::{KeyAdded, KeyRecord, NewKey, StoreError};

/// The most keys one user may have.
pub const MAX_KEYS_PER_USER: usize = 32;

/// Registers the caller's key, or renews it when the caller has it already.
pub async fn add(
    state: &AppState,
    caller: &CurrentUser,
    body: AddKey,
) -> Result<KeyAdded, ApiError> {
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
        fqans: caller.fqans_text(),
        token_issuer: token.map(|token| token.issuer_name.clone()),
    };
    let user = &caller.user.user_name;
    let added = match state.store.add_key(new, MAX_KEYS_PER_USER).await {
        Ok(added) => added,
        Err(StoreError::KeyTaken { fingerprint }) => {
            return Err(ApiError::conflict(format!(
                "key {fingerprint} is registered to another user: make a key of your own with \
                 `ssh-keygen -t ed25519` and add it"
            )))
        }
        Err(StoreError::TooManyKeys { max }) => {
            return Err(ApiError::conflict(format!(
                "you already have {max} keys, the most allowed: remove one with \
                 `devctl key rm FINGERPRINT` (see `devctl key ls`)"
            )))
        }
        Err(other) => return Err(other.into()),
    };
    match &added {
        KeyAdded::New(record) => {
            tracing::info!(%user, fingerprint = %record.fingerprint, expires_at = %record.expires_at, "SSH key added.");
        }
        KeyAdded::Renewed(record) => {
            tracing::info!(%user, fingerprint = %record.fingerprint, expires_at = %record.expires_at, "SSH key renewed.");
        }
    }
    Ok(added)
}

/// The caller's keys, or everyone's (admins only).
pub async fn list(
    state: &AppState,
    caller: &CurrentUser,
    everyones: bool,
) -> Result<Vec<KeyRecord>, ApiError> {
    let owner = caller.listing_owner(everyones, "keys")?;
    Ok(state.store.keys(owner).await?)
}

/// Removes the key of `fingerprint` (`SHA256:...`): one of the caller's, or anyone's for an
/// admin; returns it as it was.
pub async fn remove(
    state: &AppState,
    caller: &CurrentUser,
    fingerprint: &str,
) -> Result<KeyRecord, ApiError> {
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
    Ok(removed)
}
