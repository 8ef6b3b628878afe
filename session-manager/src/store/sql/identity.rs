//! Which copy of the store this is: the one row of `store_identity`
//! ([`ongrid_core::store_identity`]), read by the manager for the header of its answers and
//! raised when the database becomes a new copy (a restore; `copy-store` raises its own in the
//! copy's transaction).

use ongrid_core::store_identity::StoreIdentity;

use super::SqlStore;
use crate::store::{StoreError, StoreResult};

impl SqlStore {
    pub(super) async fn identity(&self) -> StoreResult<StoreIdentity> {
        let row: Option<(String, i64)> =
            sqlx::query_as("SELECT store_id, generation FROM store_identity WHERE only_row = 1")
                .fetch_optional(&self.pool)
                .await?;
        identity_from_row(row)
    }

    pub(super) async fn mark_restored(&self, at_least: Option<u64>) -> StoreResult<StoreIdentity> {
        let mut tx = self.write().await?;
        let row: Option<(String, i64)> =
            sqlx::query_as("SELECT store_id, generation FROM store_identity WHERE only_row = 1")
                .fetch_optional(&mut *tx)
                .await?;
        let mut identity = identity_from_row(row)?;
        identity.generation = (identity.generation + 1).max(at_least.unwrap_or(0));
        let generation = i64::try_from(identity.generation).map_err(|_| {
            StoreError::Corrupt(format!("generation {} is too large", identity.generation))
        })?;
        sqlx::query("UPDATE store_identity SET generation = $1 WHERE only_row = 1")
            .bind(generation)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(identity)
    }
}

fn identity_from_row(row: Option<(String, i64)>) -> StoreResult<StoreIdentity> {
    let (id, generation) = row.ok_or_else(|| {
        StoreError::Corrupt("the store_identity table has no row (migration 0021)".to_owned())
    })?;
    let text = format!("{id}.{generation}");
    text.parse()
        .map_err(|e| StoreError::Corrupt(format!("store identity: {e}")))
}
