//! The SQL of fair share (migration 0015): `usage_accounts`, each user's accounting
//! group and decayed cost-weighted GPU usage. How usage grows and decays is decided by
//! [`crate::domain::policy::fairshare`]; this stores it.

use chrono::{DateTime, Utc};
use ongrid_core::Dn;
use sqlx::Row;

use super::{parse, parse_timestamp, timestamp, user_from_row, SqlStore};
use crate::domain::policy::fairshare::Account;
use crate::domain::policy::GroupName;
use crate::store::{StoreResult, UserRecord};

impl SqlStore {
    /// The user of `dn` ([`SqlStore::user`], made on first sight) and their accounting group,
    /// in one statement for a user already known. A stored group that is not a group name
    /// counts as none, so the request's admission writes the right one over it.
    pub(super) async fn user_and_group(
        &self,
        dn: &Dn,
        first_uid: u32,
    ) -> StoreResult<(UserRecord, Option<GroupName>)> {
        let row = sqlx::query(
            "SELECT u.dn, u.user_name, u.uid, u.removed_at, u.removed_by, a.accounting_group \
             FROM users u LEFT JOIN usage_accounts a ON a.user_dn = u.dn WHERE u.dn = $1",
        )
        .bind(dn.as_str())
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else {
            return Ok((self.user(dn, first_uid).await?, None));
        };
        let group: Option<String> = row.try_get("accounting_group")?;
        let group = group.and_then(|text| match parse::<GroupName>(&text, "accounting group") {
            Ok(group) => Some(group),
            Err(error) => {
                tracing::warn!(%dn, %error, "A stored accounting group is not a group name; \
                    the request writes its own over it.");
                None
            }
        });
        Ok((user_from_row(&row)?, group))
    }

    pub(super) async fn set_accounting_group(
        &self,
        dn: &Dn,
        group: &GroupName,
        now: DateTime<Utc>,
    ) -> StoreResult<()> {
        // Read first: nearly every request finds the group unchanged and writes nothing.
        let current: Option<(String,)> =
            sqlx::query_as("SELECT accounting_group FROM usage_accounts WHERE user_dn = $1")
                .bind(dn.as_str())
                .fetch_optional(&self.pool)
                .await?;
        if current.is_some_and(|(g,)| g == group.as_str()) {
            return Ok(());
        }
        sqlx::query(
            "INSERT INTO usage_accounts (user_dn, accounting_group, usage, updated_at) \
             VALUES ($1, $2, 0, $3) ON CONFLICT (user_dn) DO UPDATE SET \
             accounting_group = excluded.accounting_group",
        )
        .bind(dn.as_str())
        .bind(group.as_str())
        .bind(timestamp(now))
        .execute(self.writes())
        .await?;
        Ok(())
    }

    pub(super) async fn usage_accounts(&self) -> StoreResult<Vec<Account>> {
        let rows: Vec<(String, String, f64, String)> = sqlx::query_as(
            "SELECT user_dn, accounting_group, usage, updated_at FROM usage_accounts \
             ORDER BY user_dn",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|(dn, group, usage, updated_at)| {
                Ok(Account {
                    user: parse(&dn, "user DN")?,
                    group: parse(&group, "accounting group")?,
                    usage,
                    updated_at: parse_timestamp(&updated_at)?,
                })
            })
            .collect()
    }

    pub(super) async fn save_usage(&self, accounts: &[Account]) -> StoreResult<()> {
        let mut tx = self.write().await?;
        for account in accounts {
            sqlx::query(
                "INSERT INTO usage_accounts (user_dn, accounting_group, usage, updated_at) \
                 VALUES ($1, $2, $3, $4) ON CONFLICT (user_dn) DO UPDATE SET \
                 usage = excluded.usage, updated_at = excluded.updated_at",
            )
            .bind(account.user.as_str())
            .bind(account.group.as_str())
            .bind(account.usage)
            .bind(timestamp(account.updated_at))
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }
}
