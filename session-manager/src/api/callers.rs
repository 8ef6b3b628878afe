//! Who is calling, as axum extractors: a user by TLS client certificate or, without one, by a
//! bearer token of a trusted issuer ([`CurrentUser`]; the token must grant the request's
//! [`Right`]), an agent by its node's bearer token ([`AgentNode`]), the SSH gateway by its own
//! bearer token ([`GatewayCaller`]); anything else is refused with 401 saying what to set. A user an admin
//! removed is refused with 403 saying how to be re-admitted; so is a certificate the site's
//! `[policy]` does not admit, before any user record is made for it.
//!
//! The accept loop ([`crate::server`]) puts a [`Peer`] into every request's extensions; the
//! credentials are checked with [`crate::auth`].

use axum::extract::FromRequestParts;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use ongrid_core::NodeName;

pub use crate::app::caller::{Admin, CurrentUser};
use crate::app::{ApiError, AppState};
use crate::grid_identity::Peer;
use crate::tokens::Right;

impl FromRequestParts<AppState> for CurrentUser {
    type Rejection = ApiError;

    /// The certificate of the connection when there is one (a bearer token beside it is not
    /// looked at), else the bearer token.
    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        if let Some(identity) = parts
            .extensions
            .get::<Peer>()
            .and_then(|peer| peer.identity.as_ref())
        {
            return Self::for_identity(state, identity).await;
        }
        if parts.headers.contains_key(AUTHORIZATION) {
            let token = bearer(
                parts,
                "",
                "token from your issuer (oidc-token ACCOUNT, htgettoken)",
            )?;
            let right = Right::for_request(&parts.method, parts.uri.path());
            return Self::for_token(state, token, &[right]).await;
        }
        let tokens = if state.bearer.accepts_tokens() {
            ", or a bearer token of an issuer the site trusts (Authorization: Bearer)"
        } else {
            ""
        };
        Err(ApiError::unauthenticated(format!(
            "this route needs your grid certificate: connect with a TLS client certificate (or \
             proxy) issued by a CA the site trusts{tokens}"
        )))
    }
}

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
