//! The SQL of `token_links`: token identities (issuer URL, subject) an admin linked to the user
//! of a DN, so that a user with both a certificate and a token is one user.

use ongrid_core::Dn;
use sqlx::Row;

use super::{parse, parse_timestamp, timestamp, DbRow, SqlStore};
use crate::store::{StoreResult, TokenLink};

impl SqlStore {
    pub(super) async fn token_link(&self, issuer: &str, subject: &str) -> StoreResult<Option<Dn>> {
        let dn: Option<String> =
            sqlx::query_scalar("SELECT dn FROM token_links WHERE issuer = $1 AND subject = $2")
                .bind(issuer)
                .bind(subject)
                .fetch_optional(&self.pool)
                .await?;
        dn.map(|dn| parse(&dn, "linked DN")).transpose()
    }

    pub(super) async fn link_token(&self, link: &TokenLink) -> StoreResult<bool> {
        let mut tx = self.write().await?;
        let user: Option<Option<String>> =
            sqlx::query_scalar("SELECT removed_at FROM users WHERE dn = $1")
                .bind(link.dn.as_str())
                .fetch_optional(&mut *tx)
                .await?;
        if !matches!(user, Some(None)) {
            return Ok(false);
        }
        sqlx::query(
            "INSERT INTO token_links (issuer, subject, dn, linked_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (issuer, subject) DO UPDATE SET dn = $3, linked_at = $4",
        )
        .bind(&link.issuer)
        .bind(&link.subject)
        .bind(link.dn.as_str())
        .bind(timestamp(link.linked_at))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    pub(super) async fn unlink_token(
        &self,
        issuer: &str,
        subject: &str,
    ) -> StoreResult<Option<TokenLink>> {
        let mut tx = self.write().await?;
        let row = sqlx::query(
            "DELETE FROM token_links WHERE issuer = $1 AND subject = $2 \
             RETURNING issuer, subject, dn, linked_at",
        )
        .bind(issuer)
        .bind(subject)
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        row.as_ref().map(link_from_row).transpose()
    }

    pub(super) async fn token_links(&self) -> StoreResult<Vec<TokenLink>> {
        let rows = sqlx::query(
            "SELECT issuer, subject, dn, linked_at FROM token_links ORDER BY dn, issuer, subject",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(link_from_row).collect()
    }
}

fn link_from_row(row: &DbRow) -> StoreResult<TokenLink> {
    Ok(TokenLink {
        issuer: row.try_get("issuer")?,
        subject: row.try_get("subject")?,
        dn: parse(&row.try_get::<String, _>("dn")?, "linked DN")?,
        linked_at: parse_timestamp(&row.try_get::<String, _>("linked_at")?)?,
    })
}
