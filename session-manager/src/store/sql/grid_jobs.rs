//! The SQL of jobs handed to grid targets (table `grid_jobs`, migrations 0017 and 0020): the
//! row written with the job (in [`super::jobs`]), the engine's job id stored as soon as the
//! engine answers, and what the mirroring loop learns at each poll.

use chrono::{DateTime, Utc};
use ongrid_core::job::{JobId, JobTarget};
use sqlx::{Row, Transaction};

use super::{parse_timestamp, timestamp, Db, DbRow, SqlStore};
use crate::domain::engine_job::EnginePoll;
use crate::domain::grid_jobs::{EngineJobId, GridJob, LocalAccount};
use crate::domain::jobs::JobRecord;
use crate::store::{StoreError, StoreResult};

pub(super) async fn insert_grid(
    tx: &mut Transaction<'static, Db>,
    job: JobId,
    grid: &GridJob,
) -> StoreResult<()> {
    sqlx::query(
        "INSERT INTO grid_jobs (job_id, target, account, engine_id, submit_started_at, \
         engine_restarts, engine_state, engine_waiting, polled_at, engine_final) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    )
    .bind(job.to_string())
    .bind(grid.target.to_string())
    .bind(grid.account.as_str())
    .bind(grid.engine_id.as_ref().map(EngineJobId::as_str))
    .bind(grid.submit_started_at.map(timestamp))
    .bind(i64::from(grid.engine_restarts))
    .bind(grid.engine_state.as_deref())
    .bind(grid.engine_waiting.as_deref())
    .bind(grid.polled_at.map(timestamp))
    .bind(grid.engine_final)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The grid part of a job row (the `g_*` columns of `jobs.rs`' `JOB_COLUMNS`, a `LEFT JOIN
/// grid_jobs g`); `None` for a local job.
pub(super) fn grid_from_row(row: &DbRow) -> StoreResult<Option<GridJob>> {
    let Some(target) = row.try_get::<Option<String>, _>("g_target")? else {
        return Ok(None);
    };
    let corrupt = |what: &str, e: String| StoreError::Corrupt(format!("grid job {what}: {e}"));
    let target: JobTarget = target
        .parse()
        .map_err(|e| corrupt("target", format!("{e}")))?;
    let account = LocalAccount::parse(&row.try_get::<String, _>("g_account")?)
        .map_err(|e| corrupt("account", e))?;
    let engine_id = row
        .try_get::<Option<String>, _>("g_engine_id")?
        .map(|id| EngineJobId::parse(&id).map_err(|e| corrupt("engine id", e)))
        .transpose()?;
    let time = |column: &str| -> StoreResult<Option<DateTime<Utc>>> {
        row.try_get::<Option<String>, _>(column)?
            .map(|t| parse_timestamp(&t))
            .transpose()
    };
    let restarts: i64 = row.try_get("g_engine_restarts")?;
    Ok(Some(GridJob {
        target,
        account,
        engine_id,
        submit_started_at: time("g_submit_started_at")?,
        engine_restarts: u32::try_from(restarts).unwrap_or_default(),
        engine_state: row.try_get("g_engine_state")?,
        engine_waiting: row.try_get("g_engine_waiting")?,
        polled_at: time("g_polled_at")?,
        engine_final: row.try_get("g_engine_final")?,
    }))
}

impl SqlStore {
    pub(super) async fn set_engine_id(
        &self,
        id: JobId,
        engine_id: &EngineJobId,
    ) -> StoreResult<()> {
        let done = sqlx::query("UPDATE grid_jobs SET engine_id = $1 WHERE job_id = $2")
            .bind(engine_id.as_str())
            .bind(id.to_string())
            .execute(self.writes())
            .await?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NoSuchJob(id));
        }
        Ok(())
    }

    pub(super) async fn mark_submit_started(
        &self,
        id: JobId,
        at: Option<DateTime<Utc>>,
    ) -> StoreResult<()> {
        sqlx::query("UPDATE grid_jobs SET submit_started_at = $1 WHERE job_id = $2")
            .bind(at.map(timestamp))
            .bind(id.to_string())
            .execute(self.writes())
            .await?;
        Ok(())
    }

    pub(super) async fn record_engine_poll(
        &self,
        id: JobId,
        poll: EnginePoll<'_>,
    ) -> StoreResult<()> {
        sqlx::query(
            "UPDATE grid_jobs SET engine_state = $1, engine_waiting = $2, polled_at = $3, \
             engine_final = grid_jobs.engine_final OR $4 WHERE job_id = $5",
        )
        .bind(poll.state)
        .bind(poll.waiting)
        .bind(timestamp(poll.at))
        .bind(poll.engine_final)
        .bind(id.to_string())
        .execute(self.writes())
        .await?;
        Ok(())
    }

    pub(super) async fn grid_jobs_to_mirror(&self) -> StoreResult<Vec<JobRecord>> {
        let ids: Vec<String> = sqlx::query(
            "SELECT g.job_id FROM grid_jobs g JOIN jobs j ON j.id = g.job_id \
             WHERE NOT g.engine_final OR NOT j.log_complete ORDER BY j.queued_at, j.id",
        )
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|row| row.try_get::<String, _>("job_id"))
        .collect::<Result<_, _>>()?;
        let mut jobs = Vec::with_capacity(ids.len());
        for id in ids {
            let id: JobId = super::parse(&id, "job id")?;
            if let Some(job) = self.job(id).await? {
                jobs.push(job);
            }
        }
        Ok(jobs)
    }
}
