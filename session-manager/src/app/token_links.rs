//! Linking a token identity to a user (`devctl admin user link | unlink | links`): the tokens of
//! an issuer's subject then act as the user of a DN, so that a person who used the site with a
//! certificate keeps their login, sessions, keys and images when they come with a token. Admins
//! only; the user must exist (have used the site) and not be removed.
//!
//! No long-poll watches the links (a token is mapped to its user at each request), so these
//! writes have no [`super::Effect`].

use ongrid_core::api::{LinkToken, TokenLinkView};

use super::caller::CurrentUser;
use super::{ApiError, AppState};
use crate::store::TokenLink;

/// What only admins may do, in refusals.
pub const MANAGE: &str = "link token identities to users";

pub async fn link(
    state: &AppState,
    caller: &CurrentUser,
    body: LinkToken,
) -> Result<TokenLinkView, ApiError> {
    let issuer = known_issuer(state, &body.issuer)?;
    let subject = body.subject.trim();
    if subject.is_empty() {
        return Err(ApiError::bad_request(
            "the subject is empty: give the sub claim of the user's tokens (devctl whoami, run \
             with the token, shows it)",
        ));
    }
    let link = TokenLink {
        issuer: issuer.issuer.clone(),
        subject: subject.to_owned(),
        dn: body.dn,
        linked_at: state.clock.now(),
    };
    if !state.store.link_token(&link).await? {
        return Err(ApiError::not_found(format!(
            "no user {} (or they were removed): a DN is linked once its owner has used the site \
             with their certificate (devctl admin user ls)",
            link.dn
        )));
    }
    tracing::info!(admin = %caller.user.dn, issuer = %link.issuer, subject = %link.subject, dn = %link.dn, "Token identity linked to a user.");
    Ok(view(state, link))
}

pub async fn unlink(
    state: &AppState,
    caller: &CurrentUser,
    issuer: &str,
    subject: &str,
) -> Result<TokenLinkView, ApiError> {
    let issuer = known_issuer(state, issuer)?.issuer.clone();
    let removed = state
        .store
        .unlink_token(&issuer, subject)
        .await?
        .ok_or_else(|| {
            ApiError::not_found(format!(
                "no link of {subject} at {issuer}: see devctl admin user links"
            ))
        })?;
    tracing::info!(admin = %caller.user.dn, issuer = %removed.issuer, subject = %removed.subject, dn = %removed.dn, "Token identity unlinked.");
    Ok(view(state, removed))
}

pub async fn list(state: &AppState) -> Result<Vec<TokenLinkView>, ApiError> {
    Ok(state
        .store
        .token_links()
        .await?
        .into_iter()
        .map(|link| view(state, link))
        .collect())
}

fn known_issuer<'a>(
    state: &'a AppState,
    name_or_url: &str,
) -> Result<&'a crate::config::tokens::TokenIssuer, ApiError> {
    state.bearer.issuer(name_or_url).ok_or_else(|| {
        let names = state.bearer.names();
        ApiError::not_found(if names.is_empty() {
            "this manager trusts no token issuer ([[token_issuers]] in its config)".to_owned()
        } else {
            format!(
                "no token issuer {name_or_url:?}: this manager trusts {}",
                names.join(", ")
            )
        })
    })
}

fn view(state: &AppState, link: TokenLink) -> TokenLinkView {
    TokenLinkView {
        issuer_name: state.bearer.issuer(&link.issuer).map(|i| i.name.clone()),
        issuer: link.issuer,
        subject: link.subject,
        dn: link.dn,
        linked_at: link.linked_at,
    }
}
