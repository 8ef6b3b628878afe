//! Who asks: [`CurrentUser`], a person authenticated by a grid credential (a TLS client
//! certificate on the API, a bearer token of a trusted issuer, or the credential a dashboard
//! login was made with), with their stored login and UID, whether they are an admin, and the
//! site's admission of them. The transports make it (the API's extractor in
//! `crate::api::callers`, the dashboard's `Viewer`); every use case takes it.
//!
//! A bearer token's user ([`CurrentUser::for_token`]) is the user of the DN an admin linked its
//! issuer and subject to, or else a DN of its own, `/O=ongrid token/OU=<issuer name>/CN=<sub>`
//! (see [`token_user_dn`]); its groups count as FQANs, and each request needs the scope of its
//! [`Right`].

use chrono::{DateTime, Utc};
use ongrid_core::api::CredentialKind;
use ongrid_core::Dn;

use super::{ApiError, AppState};
use crate::domain::policy::Admitted;
use crate::domain::users;
use crate::grid_identity::Identity;
use crate::store::UserRecord;
use crate::tokens::{Right, VerifiedToken};

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

impl CurrentUser {
    /// The user of a verified `identity` (a certificate on this connection, or the one a web
    /// dashboard login was made with): admin or not, admitted by the site's `[policy]` or
    /// refused, not removed.
    pub async fn for_identity(state: &AppState, identity: &Identity) -> Result<Self, ApiError> {
        let admin = state.config.admins.admits(&identity.dn, &identity.fqans);
        // Before the user record is made: a certificate the site does not admit leaves none.
        // Logged with the caller, as every 403 is (`error::log_refusals`).
        let admission = &state.config.admission;
        let admitted = if identity.token.is_some() {
            admission.admit_token(&identity.dn, &identity.fqans, admin)?
        } else {
            admission.admit(&identity.dn, &identity.fqans, admin)?
        };
        let (user, group) = state
            .store
            .user_and_group(&identity.dn, state.config.first_uid)
            .await?;
        users::admission(&user.dn, user.removed.as_ref())?;
        if group.as_ref() != Some(&admitted.group) {
            state
                .store
                .set_accounting_group(&user.dn, &admitted.group, state.clock.now())
                .await?;
        }
        Ok(Self {
            user,
            admin,
            not_after: identity.not_after,
            identity: identity.clone(),
            admitted,
        })
    }

    /// The user of the bearer `token`, which must grant `rights`: 401 when the token is refused,
    /// 403 when it lacks a scope, each saying what to do.
    pub async fn for_token(
        state: &AppState,
        token: &str,
        rights: &[Right],
    ) -> Result<Self, ApiError> {
        let verified = state
            .bearer
            .verify(token, state.clock.now())
            .await
            .map_err(|error| {
                if error.is_forbidden() {
                    ApiError::forbidden(error.to_string())
                } else {
                    ApiError::unauthenticated(error.to_string())
                }
            })?;
        let missing = verified.missing(rights);
        if !missing.is_empty() {
            return Err(ApiError::forbidden(format!(
                "the bearer token of {} ({}) lacks the scope {} this request needs: get a \
                 token with it (oidc-token --scope \"{}\" ACCOUNT)",
                verified.subject,
                verified.issuer_name,
                missing.join(" and "),
                missing.join(" ")
            )));
        }
        let dn = match state
            .store
            .token_link(&verified.issuer, &verified.subject)
            .await?
        {
            Some(dn) => dn,
            None => token_user_dn(&verified),
        };
        let mut vos: Vec<String> = Vec::new();
        for group in &verified.groups {
            if !vos.iter().any(|vo| vo == group.vo()) {
                vos.push(group.vo().to_owned());
            }
        }
        let identity = Identity {
            dn,
            kind: CredentialKind::Token,
            vos,
            fqans: verified.groups.clone(),
            not_after: verified.expires_at,
            token: Some(verified),
        };
        Self::for_identity(state, &identity).await
    }

    /// Only admins may do `what` (like "remove users"): 403 for the others.
    pub fn require_admin(&self, what: &str) -> Result<Admin, ApiError> {
        self.admin_or(|| {
            ApiError::forbidden(format!(
                "only admins {what}; admins are listed in the manager's config"
            ))
        })
    }

    /// Whose `what` (like "jobs") a listing shows: `None` for everyone's, which only admins
    /// may ask for (`?all=true`), else the caller's own DN.
    pub fn listing_owner(&self, everyones: bool, what: &str) -> Result<Option<&Dn>, ApiError> {
        if !everyones {
            return Ok(Some(&self.user.dn));
        }
        self.admin_or(|| {
            ApiError::forbidden(format!(
                "only admins can list everyone's {what} (?all=true); leave it out to list yours"
            ))
        })?;
        Ok(None)
    }

    /// The proof that the caller is an admin, or `refusal` (a 403 in the route's words).
    pub fn admin_or(&self, refusal: impl FnOnce() -> ApiError) -> Result<Admin, ApiError> {
        if self.admin {
            Ok(Admin(()))
        } else {
            Err(refusal())
        }
    }

    /// The credential's FQANs as text, as keys and logins record them.
    pub fn fqans_text(&self) -> Vec<String> {
        self.identity
            .fqans
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    /// Whether the credential is a limited proxy.
    pub fn is_limited(&self) -> bool {
        self.identity.kind == CredentialKind::Limited
    }
}

/// The DN of the user of a token whose identity no admin linked: `/O=ongrid token/OU=<issuer
/// name>/CN=<subject>`, the subject's characters other than letters, digits and `.-_@`
/// percent-encoded (a `/` would end the component). A CA trusted by the site could issue a
/// certificate with this DN, as it could any other: the site's CAs are trusted for every name.
pub fn token_user_dn(token: &VerifiedToken) -> Dn {
    let mut subject = String::with_capacity(token.subject.len());
    for byte in token.subject.bytes() {
        if byte.is_ascii_alphanumeric() || b".-_@".contains(&byte) {
            subject.push(char::from(byte));
        } else {
            subject.push_str(&format!("%{byte:02X}"));
        }
    }
    Dn::from_components([
        ("O", "ongrid token"),
        ("OU", token.issuer_name.as_str()),
        ("CN", subject.as_str()),
    ])
}

/// Proof that the caller is an admin, made only by [`CurrentUser::admin_or`] (and
/// [`CurrentUser::require_admin`]); an admin route's body (the API's `AdminJson`) is parsed
/// only with it, so the caller is authorised before the body is looked at.
#[derive(Debug, Clone, Copy)]
pub struct Admin(());
