//! The SQL of node and GPU operations (migration 0013): `nodes.drain` and `gpus.drain`
//! (the admin's [`Drain`] as JSON while drained) and `nodes.removed_at` (forgotten nodes stay
//! as rows for the history of what ran there, unlisted).

use std::time::Duration;

use chrono::{DateTime, Utc};
use ongrid_core::gpu::Drain;
use ongrid_core::{GpuUuid, NodeName, SessionName, SessionState};
use sqlx::{Row, Transaction};

use super::{
    from_json, gpu_from_row, parse, parse_timestamp, timestamp, to_json, Db, DbRow, SqlStore,
};
use crate::domain::nodes;
use crate::store::{GpuRecord, NodeContents, NodeRemoval, StoreResult};

/// The `drain` column of a `nodes` or `gpus` row.
pub(super) fn drain_from_row(row: &DbRow) -> StoreResult<Option<Drain>> {
    row.try_get::<Option<String>, _>("drain")?
        .map(|text| from_json(&text, "drain"))
        .transpose()
}

impl SqlStore {
    pub(super) async fn set_node_drain(
        &self,
        node: &NodeName,
        drain: Option<Drain>,
    ) -> StoreResult<bool> {
        let mut tx = self.write().await?;
        let json = drain.as_ref().map(to_json).transpose()?;
        // A drain in place keeps its reason and time; undrain clears it.
        let updated = sqlx::query(
            "UPDATE nodes SET drain = CASE WHEN $1 IS NULL THEN NULL ELSE COALESCE(drain, $2) END \
             WHERE name = $3 AND removed_at IS NULL",
        )
        .bind(&json)
        .bind(&json)
        .bind(node.as_str())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if updated == 1 {
            super::inventory::bump(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(updated == 1)
    }

    pub(super) async fn set_gpu_drain(
        &self,
        uuid: &GpuUuid,
        drain: Option<Drain>,
    ) -> StoreResult<Option<GpuRecord>> {
        let mut tx = self.write().await?;
        let json = drain.as_ref().map(to_json).transpose()?;
        let row = sqlx::query(
            "UPDATE gpus SET drain = CASE WHEN $1 IS NULL THEN NULL ELSE COALESCE(drain, $2) END \
             WHERE uuid = $3 AND node IN (SELECT name FROM nodes WHERE removed_at IS NULL) \
             RETURNING node, info, mode, drain",
        )
        .bind(&json)
        .bind(&json)
        .bind(uuid.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        if row.is_some() {
            super::inventory::bump(&mut tx).await?;
        }
        tx.commit().await?;
        row.as_ref().map(gpu_from_row).transpose()
    }

    pub(super) async fn remove_node(
        &self,
        node: &NodeName,
        at: DateTime<Utc>,
        node_timeout: Duration,
    ) -> StoreResult<NodeRemoval> {
        let mut tx = self.write().await?;
        let Some(last_seen) = last_seen(&mut tx, node).await? else {
            return Ok(NodeRemoval::NoSuchNode);
        };
        let session_rows: Vec<(String, String)> = sqlx::query_as(
            "SELECT name, state FROM sessions WHERE node = $1 AND state <> 'ENDED' \
             ORDER BY created_at, id",
        )
        .bind(node.as_str())
        .fetch_all(&mut *tx)
        .await?;
        let job_rows: Vec<String> = sqlx::query_scalar(
            "SELECT id FROM jobs WHERE node = $1 AND state IN ('RUNNING', 'MUSTHALT', 'HALTING') \
             ORDER BY queued_at, id",
        )
        .bind(node.as_str())
        .fetch_all(&mut *tx)
        .await?;
        let contents = NodeContents {
            sessions: session_rows
                .iter()
                .map(|(name, state)| {
                    Ok((
                        parse::<SessionName>(name, "session name")?,
                        parse::<SessionState>(state, "session state")?,
                    ))
                })
                .collect::<StoreResult<_>>()?,
            jobs: job_rows
                .iter()
                .map(|id| parse(id, "job id"))
                .collect::<StoreResult<_>>()?,
            last_seen,
        };
        if let Err(refusal) = nodes::removal(node, &contents, node_timeout, at) {
            return Ok(NodeRemoval::Refused(refusal));
        }
        sqlx::query("UPDATE nodes SET removed_at = $1, drain = NULL WHERE name = $2")
            .bind(timestamp(at))
            .bind(node.as_str())
            .execute(&mut *tx)
            .await?;
        super::inventory::bump(&mut tx).await?;
        tx.commit().await?;
        Ok(NodeRemoval::Removed)
    }
}

/// When `node` was last seen, inside `tx`; `None` when it is not registered (or was removed).
pub(super) async fn last_seen(
    tx: &mut Transaction<'static, Db>,
    node: &NodeName,
) -> StoreResult<Option<DateTime<Utc>>> {
    let last_seen: Option<String> =
        sqlx::query_scalar("SELECT last_seen FROM nodes WHERE name = $1 AND removed_at IS NULL")
            .bind(node.as_str())
            .fetch_optional(&mut **tx)
            .await?;
    last_seen.as_deref().map(parse_timestamp).transpose()
}
