//! The SQL of batch jobs (`jobs`, `job_transitions`, migration 0007): a row per job
//! with its spec as JSON and its restart-chain links, and its history with typed reasons. A
//! state changes only through [`SqlStore::job_transition_all`] (for one change,
//! [`SqlStore::job_transition`]), which replays the histories into
//! [`ongrid_core::job::JobLifecycle`]s inside the write transaction, and stores the next jobs of
//! the chains in the same transaction; the many are read and written together by
//! [`super::job_history`]. `pinned_node` (migration 0012) is where a re-queued job must start; a
//! job of a grid target has its row in `grid_jobs` (migration 0017, [`super::grid_jobs`]). An
//! ended job's record is removed by its owner or pruned past the site's retention
//! ([`SqlStore::remove_job`], [`SqlStore::prune_jobs`]), with everything that refers to it.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ongrid_core::job::{JobId, JobImage, JobLifecycle, JobTransition, RestartChain};
use ongrid_core::{Dn, HumanDuration, NodeName};
use sqlx::{Row, Transaction};

use super::job_history::{self, JobWrites};
use super::together::Lock;
use super::{
    from_json, parse, placeholders, planning, query_with, timestamp, Db, DbConnection, DbRow,
    SqlStore, JOB_HISTORY,
};
use crate::domain::jobs::{self, JobChange, JobRecord, NewJob};
use crate::store::{JobFilter, JobRemoval, StoreError, StoreResult};

const JOB_COLUMNS: &str = "j.id, j.owner, u.user_name, u.uid, j.spec, j.max_duration_secs, \
     j.image_digest, j.docker_image, j.node, j.gpus, j.chain_initial, j.restart_count, \
     j.previous_job, j.next_job, j.exit_code, j.log_size, j.log_complete, j.pinned_node, \
     g.target AS g_target, g.account AS g_account, g.engine_id AS g_engine_id, \
     g.submit_started_at AS g_submit_started_at, g.engine_restarts AS g_engine_restarts, \
     g.engine_state AS g_engine_state, g.engine_waiting AS g_engine_waiting, \
     g.polled_at AS g_polled_at, g.engine_final AS g_engine_final \
     FROM jobs j JOIN users u ON u.dn = j.owner LEFT JOIN grid_jobs g ON g.job_id = j.id";

/// The states in which a job holds GPUs or waits for them.
const ACTIVE: &str = "('QUEUED', 'RUNNING', 'MUSTHALT', 'HALTING')";
/// The states that nothing follows ([`JobState::is_final`]).
const FINAL: &str = "('HALTED', 'FINISHED', 'FAILED', 'CANCELLED')";

/// One caller's job changes, each with the next job of its chain when the change makes one.
pub type JobChanges = Vec<(JobId, JobChange, Option<NewJob>)>;

impl SqlStore {
    /// Stores `new` in the write of every submit waiting with it ([`super::together`]); the
    /// job as stored, made from what was written instead of read back.
    pub(super) async fn create_job(&self, new: NewJob) -> StoreResult<JobRecord> {
        let record = JobRecord::from(new.clone());
        self.submits
            .write(self, new, Lock::Site, |store, tx, jobs| {
                Box::pin(store.write_jobs(tx, jobs))
            })
            .await?;
        Ok(record)
    }

    /// Writes `jobs` in the write transaction `tx`: each one's outcome in order, one whose
    /// owner an admin removed refused before anything is written.
    async fn write_jobs(
        &self,
        mut tx: Transaction<'static, Db>,
        jobs: &[NewJob],
    ) -> StoreResult<Vec<StoreResult<()>>> {
        let owners: BTreeSet<&Dn> = jobs.iter().map(|job| &job.owner).collect();
        let removed = super::removed_among(&mut tx, &owners).await?;
        let mut writes = JobWrites::default();
        let mut outcomes = Vec::with_capacity(jobs.len());
        for job in jobs {
            if removed.contains(&job.owner) {
                outcomes.push(Err(StoreError::UserRemoved(job.owner.clone())));
                continue;
            }
            writes.push_job(job)?;
            outcomes.push(Ok(()));
        }
        writes
            .insert(&mut tx, &mut planning::Stamp::default())
            .await?;
        tx.commit().await?;
        Ok(outcomes)
    }

    pub(super) async fn job(&self, id: JobId) -> StoreResult<Option<JobRecord>> {
        let mut conn = self.pool.acquire().await?;
        Ok(read_jobs(&mut conn, "j.id = $1", &[&id.to_string()])
            .await?
            .pop())
    }

    pub(super) async fn jobs(&self, filter: JobFilter) -> StoreResult<Vec<JobRecord>> {
        let (condition, value): (String, Option<String>) = match filter {
            JobFilter::Owner(owner) => ("j.owner = $1".to_owned(), Some(owner.to_string())),
            JobFilter::All => ("TRUE".to_owned(), None),
            JobFilter::Active => {
                let active = self.planning_jobs().await?;
                return Ok(active.iter().map(|job| JobRecord::clone(job)).collect());
            }
            JobFilter::Node(node) => {
                let mut conn = self.pool.acquire().await?;
                return self.node_jobs(&mut conn, &node).await;
            }
        };
        let mut conn = self.pool.acquire().await?;
        let values: Vec<&str> = value.as_deref().into_iter().collect();
        read_jobs(&mut conn, &condition, &values).await
    }

    /// The jobs of `node`, read on `conn`: QUEUED or holding GPUs there, or ended there with
    /// output still to come ([`JobFilter::Node`]), read at every sync of the node and every
    /// answer of its long-poll. A job the kept copy ([`Self::planning_jobs`]) holds as of the
    /// change its row carries takes its lifecycle from there: its history is not read again,
    /// which was the most of the read's cost (the rows' other columns, such as its output's
    /// size, are always read). The copy is not brought up to date for it: a job it holds older,
    /// or not at all, has its history read.
    pub(super) async fn node_jobs(
        &self,
        conn: &mut DbConnection,
        node: &NodeName,
    ) -> StoreResult<Vec<JobRecord>> {
        let condition = format!("j.node = $1 AND (j.state IN {ACTIVE} OR NOT j.log_complete)");
        // A job stamped no later than the copy has seen and still active is in it, as stamped.
        let seen = self.planned_jobs.seen().unwrap_or(-1);
        let sql = format!(
            "SELECT j.change_seq, CASE WHEN j.change_seq > CAST($2 AS BIGINT) \
             OR j.state NOT IN {ACTIVE} THEN {JOB_HISTORY} END AS history, {JOB_COLUMNS} \
             WHERE {condition} ORDER BY j.queued_at, j.id"
        );
        let seen = seen.to_string();
        let rows = query_with(&sql, [node.as_str(), &seen])
            .fetch_all(&mut *conn)
            .await?;
        let mut histories = Vec::with_capacity(rows.len());
        let mut wanted = Vec::new();
        for row in &rows {
            let id: JobId = parse(&row.try_get::<String, _>("id")?, "job id")?;
            let history: Option<String> = row.try_get("history")?;
            if history.is_none() {
                wanted.push((id, row.try_get::<i64, _>("change_seq")?));
            }
            histories.push((id, history));
        }
        let kept = self.planned_jobs.as_stamped(&wanted);
        let mut jobs = Vec::with_capacity(rows.len());
        for (row, (id, history)) in rows.iter().zip(histories) {
            let lifecycle = match history {
                Some(json) => {
                    job_history::lifecycle_of(id, job_history::transitions_from_json(&json)?)?
                }
                None => match kept.get(&id) {
                    Some(job) => job.lifecycle.clone(),
                    // Changed since the copy was last brought up to date: all read again, each
                    // with its history.
                    None => return read_jobs(conn, &condition, &[node.as_str()]).await,
                },
            };
            jobs.push(job_with_lifecycle(row, id, lifecycle)?);
        }
        Ok(jobs)
    }

    /// The jobs QUEUED or holding GPUs, in queue order: those kept for planning
    /// ([`super::planning::KeptJobs`]), brought up to date by one read of the jobs changed
    /// since (every round read each such job's history in a statement of its own), shared with
    /// the kept copy (a round or a job's view takes thousands without copying one).
    pub(super) async fn planning_jobs(&self) -> StoreResult<Vec<Arc<JobRecord>>> {
        self.planned_jobs
            .with_kept(
                || async {
                    // The numbers before the rows: a change read twice is harmless, one missed
                    // is not. The last deletion's too, which no remaining row may carry.
                    let seen: Option<i64> = sqlx::query_scalar(
                        "SELECT MAX(n) FROM (SELECT MAX(change_seq) AS n FROM jobs \
                         UNION ALL SELECT seq FROM job_deletion_seq) numbers",
                    )
                    .fetch_one(&self.pool)
                    .await?;
                    let mut conn = self.pool.acquire().await?;
                    let active =
                        read_stamped_jobs(&mut conn, &format!("j.state IN {ACTIVE}"), &[]).await?;
                    Ok((seen.unwrap_or(0), active))
                },
                |seen| async move {
                    let mut conn = self.read_snapshot().await?;
                    let deleted: Option<i64> =
                        sqlx::query_scalar("SELECT seq FROM job_deletion_seq")
                            .fetch_optional(&mut *conn)
                            .await?;
                    if deleted.is_some_and(|deleted| deleted > seen) {
                        conn.commit().await?;
                        return Ok(None);
                    }
                    let seen = seen.to_string();
                    let changed =
                        read_stamped_jobs(&mut conn, "j.change_seq > CAST($1 AS BIGINT)", &[&seen])
                            .await?;
                    conn.commit().await?;
                    Ok(Some(changed))
                },
                |kept| kept.in_order().cloned().collect(),
            )
            .await
    }

    /// Applies each change through its job's replayed lifecycle, all in one write (see
    /// [`crate::store::Store::job_transition_all`]): the histories of all the jobs are read in
    /// one statement, and what the changes write goes in one `INSERT` of the new jobs of their
    /// chains, one of the transitions and one `UPDATE` of the jobs' rows ([`JobWrites`]). A job
    /// changed again, or created as the next of a chain, is changed as the batch left it.
    ///
    /// The changes of every caller waiting for the write lock meanwhile go in the same write
    /// ([`SqlStore::write_changes`]), each caller's after those of the callers before it: on a
    /// large site the agents' syncs report jobs' ends by the hundred a second.
    pub(super) async fn job_transition_all(
        &self,
        changes: JobChanges,
    ) -> StoreResult<Vec<StoreResult<()>>> {
        Ok(self.write_changes(Vec::new(), changes).await?.jobs)
    }

    /// [`Self::job_transition_all`] of one change, and the job as it leaves it.
    pub(super) async fn job_transition(
        &self,
        id: JobId,
        change: JobChange,
        next: Option<NewJob>,
    ) -> StoreResult<JobRecord> {
        for outcome in self.job_transition_all(vec![(id, change, next)]).await? {
            outcome?;
        }
        self.job(id).await?.ok_or(StoreError::NoSuchJob(id))
    }

    pub(super) async fn remove_job(
        &self,
        id: JobId,
        output_grace: Duration,
        now: DateTime<Utc>,
    ) -> StoreResult<JobRemoval> {
        let mut tx = self.write().await?;
        let Some(job) = read_jobs(&mut tx, "j.id = $1", &[&id.to_string()])
            .await?
            .pop()
        else {
            return Ok(JobRemoval::NoSuchJob);
        };
        if let Err(refusal) = jobs::removal(&job, output_grace, now) {
            return Ok(JobRemoval::Refused(refusal));
        }
        delete_jobs(
            &mut tx,
            &[(id.to_string(), job.chain.initial_job.to_string())],
        )
        .await?;
        tx.commit().await?;
        Ok(JobRemoval::Removed(Box::new(job)))
    }

    pub(super) async fn prune_jobs(
        &self,
        ended_before: DateTime<Utc>,
        limit: u32,
    ) -> StoreResult<Vec<JobId>> {
        let mut tx = self.write().await?;
        // `jobs::removal`'s conditions: ended, no grid engine following it, and (ended before
        // `ended_before`, which `jobs::prune_before` puts past the output grace) output all in.
        let rows: Vec<(String, String)> = sqlx::query_as(&format!(
            "SELECT j.id, j.chain_initial FROM jobs j LEFT JOIN grid_jobs g ON g.job_id = j.id \
             WHERE j.state IN {FINAL} AND (g.job_id IS NULL OR g.engine_final) \
             AND (SELECT MAX(t.at) FROM job_transitions t WHERE t.job_id = j.id) < $1 \
             ORDER BY j.queued_at, j.id LIMIT $2"
        ))
        .bind(timestamp(ended_before))
        .bind(i64::from(limit))
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        delete_jobs(&mut tx, &rows).await?;
        tx.commit().await?;
        rows.iter().map(|(id, _)| parse(id, "job id")).collect()
    }
}

/// Applies each job change through its job's replayed lifecycle in the write `tx`
/// ([`SqlStore::job_transition_all`]); each change's outcome, in order.
pub(super) async fn job_transitions_in(
    tx: &mut Transaction<'static, Db>,
    changes: Vec<(JobId, JobChange, Option<NewJob>)>,
    stamp: &mut planning::Stamp,
) -> StoreResult<Vec<StoreResult<()>>> {
    if changes.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<JobId> = changes.iter().map(|(id, ..)| *id).collect();
    let mut lifecycles = job_history::lifecycles(tx, &ids).await?;
    let mut writes = JobWrites::default();
    let mut outcomes = Vec::with_capacity(changes.len());
    for (id, change, next) in changes {
        // A refusal is decided before anything of the change is added to the writes.
        let Some(lifecycle) = lifecycles.get_mut(&id) else {
            outcomes.push(Err(StoreError::NoSuchJob(id)));
            continue;
        };
        let seq = lifecycle.history().len();
        let transition = match lifecycle.transition(change.to, change.at, change.reason.clone()) {
            Ok(transition) => transition,
            Err(refused) => {
                outcomes.push(Err(refused.into()));
                continue;
            }
        };
        writes.push_transition(id, seq, transition)?;
        writes.set_state(id, &change, next.as_ref().map(|n| n.id))?;
        if let Some(next) = &next {
            let created = writes.push_job(next)?;
            lifecycles.insert(next.id, created);
        }
        outcomes.push(Ok(()));
    }
    writes.insert(tx, stamp).await?;
    Ok(outcomes)
}

/// Deletes the jobs `(id, chain_initial)` with their histories and grid rows, one statement per
/// table: the links to them from the other jobs of their chains are cleared first (the chains'
/// remaining jobs keep their own records), and a chain's reservation goes with its last job.
async fn delete_jobs(
    tx: &mut Transaction<'static, Db>,
    jobs: &[(String, String)],
) -> StoreResult<()> {
    let ids: Vec<&str> = jobs.iter().map(|(id, _)| id.as_str()).collect();
    let chains: Vec<&str> = jobs.iter().map(|(_, chain)| chain.as_str()).collect();
    let list = placeholders(jobs.len());
    // The other jobs of their chains lose their links: stamped, as every change of a job; the
    // deletion's number is kept for the copies that still hold a deleted job.
    let number = planning::next_change(tx).await?;
    sqlx::query(
        "INSERT INTO job_deletion_seq (id, seq) VALUES (1, $1) \
         ON CONFLICT (id) DO UPDATE SET seq = excluded.seq",
    )
    .bind(number)
    .execute(&mut **tx)
    .await?;
    let change = number.to_string();
    let unlinked: Vec<&str> = ids.iter().copied().chain([change.as_str()]).collect();
    let statements = [
        (
            format!("DELETE FROM job_transitions WHERE job_id IN ({list})"),
            &ids,
        ),
        (format!("DELETE FROM grid_jobs WHERE job_id IN ({list})"), &ids),
        (
            format!(
                "UPDATE jobs SET \
                 previous_job = CASE WHEN previous_job IN ({list}) THEN NULL ELSE previous_job END, \
                 next_job = CASE WHEN next_job IN ({list}) THEN NULL ELSE next_job END, \
                 change_seq = CAST(${} AS BIGINT) \
                 WHERE previous_job IN ({list}) OR next_job IN ({list})",
                jobs.len() + 1
            ),
            &unlinked,
        ),
        (format!("DELETE FROM jobs WHERE id IN ({list})"), &ids),
        (
            format!(
                "DELETE FROM job_chain_reservations WHERE chain_initial IN ({list}) \
                 AND NOT EXISTS (SELECT 1 FROM jobs j \
                 WHERE j.chain_initial = job_chain_reservations.chain_initial)"
            ),
            &chains,
        ),
    ];
    for (sql, values) in &statements {
        query_with(sql, values.iter().copied())
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}

/// The jobs `condition` selects (on the jobs' columns as `j`, `values` bound to its
/// parameters) in queue order, each with its history: one statement, whatever their number
/// ([`read_stamped_jobs`]).
async fn read_jobs(
    conn: &mut DbConnection,
    condition: &str,
    values: &[&str],
) -> StoreResult<Vec<JobRecord>> {
    let jobs = read_stamped_jobs(conn, condition, values).await?;
    Ok(jobs.into_iter().map(|(_, job)| job).collect())
}

/// As [`read_jobs`], each job with the change number it was last stamped with.
///
/// A row per job with its history as one JSON array ([`JOB_HISTORY`], oldest first), so a job
/// changed meanwhile is never read half old, half new (a RUNNING job without its GPUs) and no
/// snapshot is begun: a node's jobs are read at every sync of the node and every answer of its
/// long-poll, and the rows, a snapshot and the histories were five round trips to the database;
/// a row per transition, with every column of its job, made four times the rows to decode.
/// Driven by the jobs' condition, each history found by its key.
async fn read_stamped_jobs(
    conn: &mut DbConnection,
    condition: &str,
    values: &[&str],
) -> StoreResult<Vec<(i64, JobRecord)>> {
    let sql = format!(
        "SELECT j.change_seq, {JOB_HISTORY} AS history, {JOB_COLUMNS} WHERE {condition} \
         ORDER BY j.queued_at, j.id"
    );
    let rows = query_with(&sql, values.iter().copied())
        .fetch_all(&mut *conn)
        .await?;
    rows.iter()
        .map(|row| {
            let history: Option<String> = row.try_get("history")?;
            let history = match history {
                Some(json) => job_history::transitions_from_json(&json)?,
                None => Vec::new(),
            };
            Ok((row.try_get("change_seq")?, job_from_row(row, history)?))
        })
        .collect()
}

/// A job from a row of [`JOB_COLUMNS`] and its `history`, oldest first.
fn job_from_row(row: &DbRow, history: Vec<JobTransition>) -> StoreResult<JobRecord> {
    let id: JobId = parse(&row.try_get::<String, _>("id")?, "job id")?;
    job_with_lifecycle(row, id, job_history::lifecycle_of(id, history)?)
}

/// Job `id` from its row of [`JOB_COLUMNS`] and the `lifecycle` its history replays to.
fn job_with_lifecycle(row: &DbRow, id: JobId, lifecycle: JobLifecycle) -> StoreResult<JobRecord> {
    let optional_job = |column: &str| -> StoreResult<Option<JobId>> {
        row.try_get::<Option<String>, _>(column)?
            .map(|text| parse(&text, "job id"))
            .transpose()
    };
    let node: Option<String> = row.try_get("node")?;
    let pinned_node: Option<String> = row.try_get("pinned_node")?;
    let max_duration: Option<i64> = row.try_get("max_duration_secs")?;
    let restart_count: i64 = row.try_get("restart_count")?;
    let log_size: i64 = row.try_get("log_size")?;
    let uid: i64 = row.try_get("uid")?;
    Ok(JobRecord {
        id,
        owner: parse(&row.try_get::<String, _>("owner")?, "owner")?,
        user_name: parse(&row.try_get::<String, _>("user_name")?, "user name")?,
        uid: u32::try_from(uid).map_err(|_| StoreError::Corrupt(format!("uid {uid}")))?,
        spec: from_json(&row.try_get::<String, _>("spec")?, "job spec")?,
        lifecycle,
        max_duration: max_duration
            .map(|s| HumanDuration::from_secs(u64::try_from(s).unwrap_or_default())),
        image: JobImage {
            digest: row.try_get("image_digest")?,
            docker_image: row.try_get("docker_image")?,
        },
        node: node.map(|n| parse::<NodeName>(&n, "node")).transpose()?,
        gpus: from_json(&row.try_get::<String, _>("gpus")?, "gpus")?,
        chain: RestartChain {
            initial_job: parse(&row.try_get::<String, _>("chain_initial")?, "job id")?,
            restart_count: u32::try_from(restart_count).unwrap_or(u32::MAX),
        },
        previous_job: optional_job("previous_job")?,
        next_job: optional_job("next_job")?,
        exit_code: row
            .try_get::<Option<i64>, _>("exit_code")?
            .map(|code| {
                i32::try_from(code).map_err(|_| StoreError::Corrupt(format!("exit code {code}")))
            })
            .transpose()?,
        log_size: u64::try_from(log_size).unwrap_or_default(),
        log_complete: row.try_get("log_complete")?,
        pinned_node: pinned_node
            .map(|n| parse::<NodeName>(&n, "node"))
            .transpose()?,
        grid: super::grid_jobs::grid_from_row(row)?,
    })
}

#[cfg(test)]
mod tests {
    use ongrid_core::job::JobState;

    /// The written-out lists name the states they stand for: the kept jobs' (QUEUED or holding
    /// GPUs, as the copy keeps them), and those nothing follows.
    #[test]
    fn state_lists_name_their_states() {
        let listed = |keep: fn(&JobState) -> bool| {
            format!(
                "({})",
                super::super::states_listed(JobState::ALL.iter().filter(|s| keep(s)))
            )
        };
        assert_eq!(
            super::ACTIVE,
            listed(|s| *s == JobState::Queued || s.holds_gpus())
        );
        assert_eq!(super::FINAL, listed(|s| s.is_final()));
    }
}
