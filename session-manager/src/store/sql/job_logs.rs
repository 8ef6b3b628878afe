//! The jobs' output records written together ([`super::sync_records`]): how much of each job's
//! output the manager has, reported by every sync that arrives while a write of the syncs'
//! records waits for the writer, goes in that write, one `UPDATE` for all (for each
//! [`PER_STATEMENT`] jobs).
//!
//! A node's agent sends its running jobs' output with nearly every sync, and a site of 1,000
//! nodes running 20,000 short jobs records their output by the hundred a second. Written one
//! statement each, on SQLite's one writer, they took it for more than a third of its writes
//! (the fleet bench, a build that named who took the writer), ahead of the creates, submits and
//! rounds that wait for it.

use std::collections::BTreeMap;

use ongrid_core::job::JobId;
use sqlx::{QueryBuilder, Transaction};

use super::history::PER_STATEMENT;
use super::{clamp, Db};
use crate::store::{OutputKept, StoreResult};

/// Writes the callers' `lists` in `tx`: one statement for every [`PER_STATEMENT`] jobs, a job
/// recorded more than once stored as the last of its records (the callers taken in the order
/// they came, each caller's records in its own order).
pub(super) async fn write_logs(
    tx: &mut Transaction<'static, Db>,
    lists: &[&Vec<OutputKept>],
) -> StoreResult<()> {
    let latest: Vec<(JobId, (u64, bool))> = lists
        .iter()
        .copied()
        .flatten()
        .map(|log| (log.id, (log.size, log.complete)))
        .collect::<BTreeMap<_, _>>()
        .into_iter()
        .collect();
    for chunk in latest.chunks(PER_STATEMENT) {
        let mut query = QueryBuilder::<Db>::new("WITH logs (id, size, complete) AS (");
        query.push_values(chunk, |mut row, (id, (size, complete))| {
            row.push_bind(id.to_string())
                .push_bind(clamp(*size))
                .push_bind(*complete);
        });
        query.push(
            ") UPDATE jobs SET log_size = logs.size, log_complete = logs.complete FROM logs \
             WHERE jobs.id = logs.id",
        );
        // A statement of the batch's length: kept out of the statement cache but for one.
        query
            .build()
            .persistent(chunk.len() == 1)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}
