//! Who asks: [`CurrentUser`], a person authenticated by a grid credential (a TLS client
//! certificate on the API, or the one a dashboard login was made with), with their stored login
//! and UID, whether they are an admin, and the site's admission of them. The transports make it
//! (the API's extractor in `crate::api::callers`, the dashboard's `Viewer`); every use case takes
//! it.

use chrono::{DateTime, Utc};
use ongrid_core::api::CredentialKind;

use super::{ApiError, AppState};
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
/// [`CurrentUser::require_admin`]); an admin route's body (the API's `AdminJson`) is parsed
/// only with it, so the caller is authorised before the body is looked at.
#[derive(Debug, Clone, Copy)]
pub struct Admin(());
