//! The dashboard's single-use login links (`POST /v1/dashboard/links`, `devctl dashboard`): a
//! random token, good once for [`LINK_LIFETIME`] (never past the credential's end), whose
//! SHA-256 digest is stored with the identity it was made for. The dashboard spends it
//! (`crate::dashboard::auth`) for a browser login; only digests of tokens are ever stored.

use chrono::TimeDelta;
use ongrid_core::api::DashboardLink;
use sha2::{Digest, Sha256};

use super::caller::CurrentUser;
use super::{ApiError, AppState};
use crate::store::DashboardIdentity;
use crate::tokens::Right;

/// How long a login link printed by `devctl dashboard` may be used.
pub const LINK_LIFETIME: TimeDelta = TimeDelta::minutes(5);

/// 32 bytes' worth of hex from the system's random source (two v4 UUIDs: 244 random bits).
pub fn random_token() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// What is stored for a token.
pub fn digest(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// A single-use login link for the caller. A limited proxy may only read, so it gets none; a
/// bearer token needs every `compute.*` scope, since the dashboard does all of it.
pub async fn create_link(
    state: &AppState,
    caller: &CurrentUser,
) -> Result<DashboardLink, ApiError> {
    if caller.is_limited() {
        return Err(ApiError::forbidden(
            "a limited proxy may only read, and the dashboard changes sessions: make a full \
             proxy (grid-proxy-init or voms-proxy-init without -limited) and run devctl \
             dashboard again",
        ));
    }
    if let Some(token) = &caller.identity.token {
        let missing = token.missing(&Right::ALL);
        if !missing.is_empty() {
            return Err(ApiError::forbidden(format!(
                "the dashboard reads, creates, changes and removes, so a login with a bearer \
                 token needs all of compute.read, compute.create, compute.modify and \
                 compute.cancel; this token lacks {}: get one with them (oidc-token --scope \
                 \"compute.read compute.create compute.modify compute.cancel\" ACCOUNT)",
                missing.join(", ")
            )));
        }
    }
    let token = random_token();
    let now = state.clock.now();
    let expires_at = (now + LINK_LIFETIME).min(caller.not_after);
    let identity = DashboardIdentity {
        dn: caller.user.dn.clone(),
        fqans: caller
            .identity
            .fqans
            .iter()
            .map(ToString::to_string)
            .collect(),
        kind: caller.identity.kind,
        not_after: caller.not_after,
    };
    state
        .store
        .dashboard()
        .create_dashboard_link(&digest(&token), &identity, now, expires_at)
        .await?;
    tracing::info!(user = %caller.user.user_name, %expires_at, "Dashboard login link made.");
    Ok(DashboardLink {
        path: format!("/dashboard/login?token={token}"),
        expires_at,
    })
}
