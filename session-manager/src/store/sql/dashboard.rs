//! The [`DashboardStore`](crate::store::DashboardStore): the web dashboard's logins (migration
//! 0016): `dashboard_links`, the single-use login links `devctl dashboard` prints, and
//! `dashboard_logins`, the browser logins they become. Only SHA-256 digests of the tokens are
//! stored; the dashboard (`crate::dashboard::auth`) makes the tokens and decides lifetimes.

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use ongrid_core::api::CredentialKind;

use super::{parse, parse_timestamp, timestamp, SqlStore};
use crate::store::{DashboardIdentity, DashboardLogin, DashboardStore, StoreError, StoreResult};

fn fqans_text(fqans: &[String]) -> StoreResult<String> {
    serde_json::to_string(fqans).map_err(|e| StoreError::Corrupt(format!("FQANs: {e}")))
}

fn kind_text(kind: CredentialKind) -> StoreResult<String> {
    serde_json::to_string(&kind).map_err(|e| StoreError::Corrupt(format!("credential kind: {e}")))
}

fn identity(dn: &str, fqans: &str, kind: &str, not_after: &str) -> StoreResult<DashboardIdentity> {
    Ok(DashboardIdentity {
        dn: parse(dn, "user DN")?,
        fqans: serde_json::from_str(fqans)
            .map_err(|e| StoreError::Corrupt(format!("dashboard FQANs {fqans:?}: {e}")))?,
        kind: serde_json::from_str(kind)
            .map_err(|e| StoreError::Corrupt(format!("credential kind {kind:?}: {e}")))?,
        not_after: parse_timestamp(not_after)?,
    })
}

impl SqlStore {
    async fn create_dashboard_link(
        &self,
        token_hash: &str,
        identity: &DashboardIdentity,
        now: DateTime<Utc>,
        expires_at: DateTime<Utc>,
    ) -> StoreResult<()> {
        let mut tx = self.write().await?;
        sqlx::query("DELETE FROM dashboard_links WHERE expires_at < $1")
            .bind(timestamp(now))
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM dashboard_logins WHERE expires_at < $1")
            .bind(timestamp(now))
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO dashboard_links (token_hash, user_dn, fqans, credential_kind, \
             credential_not_after, created_at, expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(token_hash)
        .bind(identity.dn.as_str())
        .bind(fqans_text(&identity.fqans)?)
        .bind(kind_text(identity.kind)?)
        .bind(timestamp(identity.not_after))
        .bind(timestamp(now))
        .bind(timestamp(expires_at))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn dashboard_link(
        &self,
        token_hash: &str,
        now: DateTime<Utc>,
    ) -> StoreResult<Option<DashboardIdentity>> {
        let row: Option<(String, String, String, String)> = sqlx::query_as(
            "SELECT user_dn, fqans, credential_kind, credential_not_after FROM dashboard_links \
             WHERE token_hash = $1 AND used_at IS NULL AND expires_at > $2",
        )
        .bind(token_hash)
        .bind(timestamp(now))
        .fetch_optional(&self.pool)
        .await?;
        row.map(|(dn, fqans, kind, not_after)| identity(&dn, &fqans, &kind, &not_after))
            .transpose()
    }

    async fn redeem_dashboard_link(
        &self,
        token_hash: &str,
        now: DateTime<Utc>,
    ) -> StoreResult<Option<DashboardIdentity>> {
        // One statement: of two concurrent redemptions, only one finds used_at NULL.
        let row: Option<(String, String, String, String)> = sqlx::query_as(
            "UPDATE dashboard_links SET used_at = $1 \
             WHERE token_hash = $2 AND used_at IS NULL AND expires_at > $3 \
             RETURNING user_dn, fqans, credential_kind, credential_not_after",
        )
        .bind(timestamp(now))
        .bind(token_hash)
        .bind(timestamp(now))
        .fetch_optional(self.writes())
        .await?;
        row.map(|(dn, fqans, kind, not_after)| identity(&dn, &fqans, &kind, &not_after))
            .transpose()
    }

    async fn create_dashboard_login(
        &self,
        token_hash: &str,
        login: &DashboardLogin,
        now: DateTime<Utc>,
    ) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO dashboard_logins (token_hash, user_dn, fqans, credential_kind, csrf_token, \
             created_at, expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(token_hash)
        .bind(login.identity.dn.as_str())
        .bind(fqans_text(&login.identity.fqans)?)
        .bind(kind_text(login.identity.kind)?)
        .bind(&login.csrf_token)
        .bind(timestamp(now))
        .bind(timestamp(login.expires_at))
        .execute(self.writes())
        .await?;
        Ok(())
    }

    async fn dashboard_login(
        &self,
        token_hash: &str,
        now: DateTime<Utc>,
    ) -> StoreResult<Option<DashboardLogin>> {
        let row: Option<(String, String, String, String, String)> = sqlx::query_as(
            "SELECT user_dn, fqans, credential_kind, csrf_token, expires_at FROM dashboard_logins \
             WHERE token_hash = $1 AND expires_at > $2",
        )
        .bind(token_hash)
        .bind(timestamp(now))
        .fetch_optional(&self.pool)
        .await?;
        row.map(|(dn, fqans, kind, csrf_token, expires_at)| {
            Ok(DashboardLogin {
                identity: identity(&dn, &fqans, &kind, &expires_at)?,
                csrf_token,
                expires_at: parse_timestamp(&expires_at)?,
            })
        })
        .transpose()
    }

    async fn end_dashboard_login(&self, token_hash: &str) -> StoreResult<()> {
        sqlx::query("DELETE FROM dashboard_logins WHERE token_hash = $1")
            .bind(token_hash)
            .execute(self.writes())
            .await?;
        Ok(())
    }
}

impl DashboardStore for SqlStore {
    boxed! {
        fn create_dashboard_link(
            token_hash: &'a str,
            identity: &'a DashboardIdentity,
            now: DateTime<Utc>,
            expires_at: DateTime<Utc>,
        ) -> ();
        fn dashboard_link(token_hash: &'a str, now: DateTime<Utc>) -> Option<DashboardIdentity>;
        fn redeem_dashboard_link(token_hash: &'a str, now: DateTime<Utc>) -> Option<DashboardIdentity>;
        fn create_dashboard_login(
            token_hash: &'a str,
            login: &'a DashboardLogin,
            now: DateTime<Utc>,
        ) -> ();
        fn dashboard_login(token_hash: &'a str, now: DateTime<Utc>) -> Option<DashboardLogin>;
        fn end_dashboard_login(token_hash: &'a str) -> ();
    }
}
