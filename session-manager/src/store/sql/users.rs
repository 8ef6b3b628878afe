//! The SQL of removing and restoring users (migration 0010): `users.removed_at` and
//! `removed_by` while a user is removed, and `user_events`, what admins did to each user. What a
//! removal does and when it is refused is decided by [`crate::domain::users`]; this stores it.

use chrono::{DateTime, Utc};
use ongrid_core::api::{UserAction, UserEvent};
use ongrid_core::Dn;
use sqlx::Transaction;

use super::gateway::{key_from_row, KEY_COLUMNS};
use super::{find_user, parse, parse_timestamp, timestamp, Db, SqlStore};
use crate::domain::users::Removal;
use crate::store::{KeyRecord, StoreError, StoreResult, UserRecord};

const USER_COLUMNS: &str = "dn, user_name, uid, removed_at, removed_by FROM users";

impl SqlStore {
    pub(super) async fn existing_user(&self, dn: &Dn) -> StoreResult<Option<UserRecord>> {
        find_user(&self.pool, dn).await
    }

    pub(super) async fn users(&self) -> StoreResult<Vec<UserRecord>> {
        let rows = sqlx::query(&format!("SELECT {USER_COLUMNS} ORDER BY user_name"))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(super::user_from_row).collect()
    }

    pub(super) async fn user_events(&self, dn: Option<&Dn>) -> StoreResult<Vec<(Dn, UserEvent)>> {
        let columns = "dn, at, action, by, details FROM user_events";
        let rows: Vec<(String, String, String, String, String)> = match dn {
            Some(dn) => {
                sqlx::query_as(&format!("SELECT {columns} WHERE dn = $1 ORDER BY seq"))
                    .bind(dn.as_str())
                    .fetch_all(&self.pool)
                    .await?
            }
            None => {
                sqlx::query_as(&format!("SELECT {columns} ORDER BY dn, seq"))
                    .fetch_all(&self.pool)
                    .await?
            }
        };
        rows.into_iter()
            .map(|(dn, at, action, by, details)| {
                let action = match action.as_str() {
                    "removed" => UserAction::Removed,
                    "restored" => UserAction::Restored,
                    other => return Err(StoreError::Corrupt(format!("user action {other:?}"))),
                };
                Ok((
                    parse(&dn, "user DN")?,
                    UserEvent {
                        at: parse_timestamp(&at)?,
                        action,
                        by: parse(&by, "admin DN")?,
                        details,
                    },
                ))
            })
            .collect()
    }

    pub(super) async fn remove_user(
        &self,
        dn: &Dn,
        by: &Dn,
        at: DateTime<Utc>,
        removal: &Removal,
    ) -> StoreResult<Option<Vec<KeyRecord>>> {
        let mut tx = self.write().await?;
        let marked = sqlx::query(
            "UPDATE users SET removed_at = $1, removed_by = $2 WHERE dn = $3 AND removed_at IS NULL",
        )
        .bind(timestamp(at))
        .bind(by.as_str())
        .bind(dn.as_str())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if marked == 0 {
            return Ok(None);
        }
        let rows = sqlx::query(&format!("SELECT {KEY_COLUMNS} WHERE k.owner = $1"))
            .bind(dn.as_str())
            .fetch_all(&mut *tx)
            .await?;
        let keys = rows
            .iter()
            .map(key_from_row)
            .collect::<StoreResult<Vec<_>>>()?;
        sqlx::query("DELETE FROM ssh_keys WHERE owner = $1")
            .bind(dn.as_str())
            .execute(&mut *tx)
            .await?;
        let details = removal.summary(keys.len());
        insert_event(&mut tx, dn, at, UserAction::Removed, by, &details).await?;
        tx.commit().await?;
        Ok(Some(keys))
    }

    pub(super) async fn restore_user(
        &self,
        dn: &Dn,
        by: &Dn,
        at: DateTime<Utc>,
    ) -> StoreResult<Option<UserRecord>> {
        let mut tx = self.write().await?;
        let restored = sqlx::query(
            "UPDATE users SET removed_at = NULL, removed_by = NULL \
             WHERE dn = $1 AND removed_at IS NOT NULL",
        )
        .bind(dn.as_str())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if restored == 0 {
            return Ok(None);
        }
        let details = "may use the manager again; what was removed stays removed";
        insert_event(&mut tx, dn, at, UserAction::Restored, by, details).await?;
        let user = find_user(&mut *tx, dn).await?;
        tx.commit().await?;
        Ok(user)
    }
}

async fn insert_event(
    tx: &mut Transaction<'static, Db>,
    dn: &Dn,
    at: DateTime<Utc>,
    action: UserAction,
    by: &Dn,
    details: &str,
) -> StoreResult<()> {
    let action = match action {
        UserAction::Removed => "removed",
        UserAction::Restored => "restored",
    };
    sqlx::query(
        "INSERT INTO user_events (dn, seq, at, action, by, details) \
         VALUES ($1, (SELECT COALESCE(MAX(seq), -1) + 1 FROM user_events WHERE dn = $1), \
         $2, $3, $4, $5)",
    )
    .bind(dn.as_str())
    .bind(timestamp(at))
    .bind(action)
    .bind(by.as_str())
    .bind(details)
    .execute(&mut **tx)
    .await?;
    Ok(())
}
