//! What the web dashboard stores (migration 0016): single-use login links and browser logins,
//! each by the SHA-256 of its token. A store offers them through [`super::Store::dashboard`];
//! one that does not yet (`None`) leaves the dashboard to browsers with a client certificate.

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use ongrid_core::api::CredentialKind;
use ongrid_core::Dn;

use super::StoreResult;

/// Who a login link or browser login is for: the identity of the credential `devctl dashboard`
/// was run with. Admin rights and admission are decided again from it on every request, as for
/// a certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DashboardIdentity {
    pub dn: Dn,
    /// The verified FQANs of that credential, primary first.
    pub fqans: Vec<String>,
    pub kind: CredentialKind,
    /// Until when the credential was valid; no login outlives it.
    pub not_after: DateTime<Utc>,
}

/// A browser's login, named by the SHA-256 of its cookie.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DashboardLogin {
    pub identity: DashboardIdentity,
    /// The token every state-changing form of this login must carry.
    pub csrf_token: String,
    pub expires_at: DateTime<Utc>,
}

/// The dashboard's logins. Every method is one transaction.
pub trait DashboardStore: Send + Sync {
    /// Stores a login link by the SHA-256 of its token, valid until `expires_at`; forgets links
    /// and logins that expired before `now`.
    fn create_dashboard_link<'a>(
        &'a self,
        token_hash: &'a str,
        identity: &'a DashboardIdentity,
        now: DateTime<Utc>,
        expires_at: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<()>>;

    /// The identity of an unused link that has not expired, without using it.
    fn dashboard_link<'a>(
        &'a self,
        token_hash: &'a str,
        now: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<Option<DashboardIdentity>>>;

    /// Uses a link once: the identity of an unused, unexpired link, which is marked used in the
    /// same statement (so two redemptions never both succeed); `None` otherwise.
    fn redeem_dashboard_link<'a>(
        &'a self,
        token_hash: &'a str,
        now: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<Option<DashboardIdentity>>>;

    /// Stores a browser login by the SHA-256 of its cookie.
    fn create_dashboard_login<'a>(
        &'a self,
        token_hash: &'a str,
        login: &'a DashboardLogin,
        now: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<()>>;

    /// The browser login of a cookie, unless it expired before `now`.
    fn dashboard_login<'a>(
        &'a self,
        token_hash: &'a str,
        now: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<Option<DashboardLogin>>>;

    /// Ends a browser login (log out).
    fn end_dashboard_login<'a>(&'a self, token_hash: &'a str) -> BoxFuture<'a, StoreResult<()>>;
}
