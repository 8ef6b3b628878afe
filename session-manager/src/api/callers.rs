//! Who is calling, as axum extractors: a user by TLS client certificate ([`CurrentUser`]), an
//! agent by its node's bearer token ([`AgentNode`]), the SSH gateway by its own bearer token
//! ([`GatewayCaller`]); anything else is refused with 401 saying what to set. A user an admin
//! removed is refused with 403 saying how to be re-admitted; so is a certificate the site's
//! `[policy]` does not admit, before any user record is made for it.
//!
//! The accept loop ([`crate::server`]) puts a [`Peer`] into every request's extensions; the
//! credentials are checked with [`crate::auth`].

use axum::extract::FromRequestParts;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use chrono::{DateTime, Utc};
use ongrid_core::api::CredentialKind;
use ongrid_core::NodeName;

use super::{ApiError, AppState};
use crate::auth::Peer;
use crate::domain::policy::Admitted;
use crate::domain::users;
use crate::grid_identity::Identity;
use crate::store::UserRecord;

/// A user authenticated by certificate, with their stored login and UID.
#[derive(Debug, Clone)]
pub struct CurrentUser {
    pub user: UserRecord,
    /// Listed in the config's `admins`, by DN or by one of the credential's FQANs.
    pub admin: bool,
    /// Until when the credential presented on this connection is valid.
    pub not_after: DateTime<Utc>,
    /// The credential presented on this connection: its kind, VOs and FQANs.
    pub identity: Identity,
    /// The site's `[policy]` admits them: their accounting group and the rule that said so.
    pub admitted: Admitted,
}

impl FromRequestParts<AppState> for CurrentUser {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let identity = parts
            .extensions
            .get::<Peer>()
            .and_then(|peer| peer.identity.as_ref())
            .ok_or_else(|| {
                ApiError::unauthenticated(
                    "this route needs your grid certificate: connect with a TLS client \
                     certificate (or proxy) issued by a CA the site trusts",
                )
            })?;
        Self::for_identity(state, identity).await
    }
}

impl CurrentUser {
    /// The user of a verified `identity` (a certificate on this connection, or the one a web
    /// dashboard login was made with): admin or not, admitted by the site's `[policy]` or
    /// refused, not removed.
    pub async fn for_identity(state: &AppState, identity: &Identity) -> Result<Self, ApiError> {
        let admin = state.config.admins.admits(&identity.dn, &identity.fqans);
        // Before the user record is made: a certificate the site does not admit leaves none.
        // Logged with the caller, as every 403 is (`error::log_refusals`).
        let admitted = state
            .config
            .admission
            .admit(&identity.dn, &identity.fqans, admin)?;
        let user = state
            .store
            .user(&identity.dn, state.config.first_uid)
            .await?;
        users::admission(&user.dn, user.removed.as_ref())?;
        state
            .store
            .set_accounting_group(&user.dn, &admitted.group, state.clock.now())
            .await?;
        Ok(Self {
            user,
            admin,
            not_after: identity.not_after,
            identity: identity.clone(),
            admitted,
        })
    }

    /// Only admins may do `what` (like "remove users"): 403 for the others.
    pub fn require_admin(&self, what: &str) -> Result<Admin, ApiError> {
        self.admin_or(|| {
            ApiError::forbidden(format!(
                "only admins {what}; admins are listed in the manager's config"
            ))
        })
    }

    /// The proof that the caller is an admin, or `refusal` (a 403 in the route's words).
    pub fn admin_or(&self, refusal: impl FnOnce() -> ApiError) -> Result<Admin, ApiError> {
        if self.admin {
            Ok(Admin(()))
        } else {
            Err(refusal())
        }
    }

    /// Whether the credential is a limited proxy.
    pub fn is_limited(&self) -> bool {
        self.identity.kind == CredentialKind::Limited
    }
}

/// Proof that the caller is an admin, made only by [`CurrentUser::admin_or`] (and
/// [`CurrentUser::require_admin`]); an admin route's body ([`super::error::AdminJson`]) is
/// parsed only with it, so the caller is authorised before the body is looked at.
#[derive(Debug, Clone, Copy)]
pub struct Admin(());

/// The node whose agent is calling, named by its bearer token.
#[derive(Debug, Clone)]
pub struct AgentNode(pub NodeName);

impl FromRequestParts<AppState> for AgentNode {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let token = bearer(
            parts,
            "agent routes need `Authorization: Bearer <node token>`: set the agent's token_file",
            "node token",
        )?;
        let node = state.tokens.node_for(token).ok_or_else(|| {
            ApiError::unauthenticated(
                "unknown node token: it must match a line of the manager's agent_tokens_file",
            )
        })?;
        Ok(Self(node.clone()))
    }
}

/// The SSH gateway, authenticated by the token of the manager's `gateway_token_file`.
#[derive(Debug, Clone, Copy)]
pub struct GatewayCaller;

impl FromRequestParts<AppState> for GatewayCaller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let expected = state.gateway_token.as_ref().ok_or_else(|| {
            ApiError::unauthenticated(
                "gateway routes are not enabled on this manager: set gateway_token_file in its \
                 config to the gateway's token",
            )
        })?;
        let token = bearer(
            parts,
            "gateway routes need `Authorization: Bearer <gateway token>`: set the gateway's \
             token_file",
            "gateway token",
        )?;
        if !expected.matches(token) {
            return Err(ApiError::unauthenticated(
                "wrong gateway token: it must equal the one in the manager's gateway_token_file",
            ));
        }
        Ok(Self)
    }
}

/// The token of `Authorization: Bearer <token>`, or 401 with `missing` (no header) or a message
/// naming `what` (another scheme).
fn bearer<'a>(parts: &'a Parts, missing: &str, what: &str) -> Result<&'a str, ApiError> {
    let header = parts
        .headers
        .get(AUTHORIZATION)
        .ok_or_else(|| ApiError::unauthenticated(missing))?
        .to_str()
        .unwrap_or_default();
    header
        .strip_prefix("Bearer ")
        .map(str::trim)
        .ok_or_else(|| {
            ApiError::unauthenticated(format!(
                "the Authorization header must be `Bearer <{what}>`"
            ))
        })
}
