//! Job histories (`job_transitions`) read and written by the many in one statement: the
//! histories of a list of jobs in one `SELECT`, and a batch of changes ([`JobWrites`]) as one
//! `INSERT` of its new jobs, one of its transitions and one `UPDATE` of its jobs' rows, where
//! one job's change took a statement for each. Session histories are [`super::history`]'s.

use std::collections::HashMap;

use ongrid_core::job::{JobId, JobLifecycle, JobReason, JobState, JobTransition};
use ongrid_core::NodeName;
use sqlx::{QueryBuilder, Row, Transaction};

use super::history::{execute, PER_STATEMENT};
use super::{
    from_json, parse, parse_timestamp, placeholders, query_with, timestamp, to_json, Db,
    DbConnection, DbRow,
};
use crate::domain::grid_jobs::GridJob;
use crate::domain::jobs::{JobChange, NewJob};
use crate::store::{StoreError, StoreResult};

/// The histories of the jobs `condition` selects, each oldest first, in one statement, for the
/// changes of a write ([`lifecycles`]); the reads of whole jobs take their histories in the
/// statement of their rows, as JSON (`jobs::read_stamped_jobs`, [`transitions_from_json`]).
/// `condition` is on the jobs' columns as `j` (`j.id IN (...)`), with `values` bound to its
/// parameters; a job without a history (there is no such job) is left out.
pub(super) async fn histories(
    conn: &mut DbConnection,
    condition: &str,
    values: &[&str],
) -> StoreResult<HashMap<JobId, Vec<JobTransition>>> {
    // The jobs first, then each one's history by the index on (job_id, seq): written as a join
    // ordered by `t.job_id, t.seq`, SQLite chose to walk every job's history in that index's
    // order and look up each one's job, 40 ms with 30,000 rows.
    let sql = format!(
        "SELECT t.job_id, t.from_state, t.to_state, t.at, t.reason FROM job_transitions t \
         WHERE t.job_id IN (SELECT j.id FROM jobs j WHERE {condition}) ORDER BY t.job_id, t.seq"
    );
    // A list of ids makes a statement of its own length: kept out of the statement cache.
    let rows = query_with(&sql, values.iter().copied())
        .persistent(values.len() <= 1)
        .fetch_all(&mut *conn)
        .await?;
    let mut histories: HashMap<JobId, Vec<JobTransition>> = HashMap::new();
    for row in &rows {
        let id: JobId = parse(&row.try_get::<String, _>("job_id")?, "job id")?;
        histories
            .entry(id)
            .or_default()
            .push(transition_from_row(row)?);
    }
    Ok(histories)
}

/// The lifecycles of `ids` as stored, each replayed from its history, read [`PER_STATEMENT`]
/// jobs a statement; a job without one (there is no such job) is left out.
pub(super) async fn lifecycles(
    tx: &mut Transaction<'static, Db>,
    ids: &[JobId],
) -> StoreResult<HashMap<JobId, JobLifecycle>> {
    let mut ids: Vec<String> = ids.iter().map(JobId::to_string).collect();
    ids.sort_unstable();
    ids.dedup();
    let mut lifecycles = HashMap::with_capacity(ids.len());
    for chunk in ids.chunks(PER_STATEMENT) {
        let values: Vec<&str> = chunk.iter().map(String::as_str).collect();
        let condition = format!("j.id IN ({})", placeholders(values.len()));
        for (id, history) in histories(tx, &condition, &values).await? {
            lifecycles.insert(id, lifecycle_of(id, history)?);
        }
    }
    Ok(lifecycles)
}

/// The lifecycle job `id`'s stored `history` replays to.
pub(super) fn lifecycle_of(id: JobId, history: Vec<JobTransition>) -> StoreResult<JobLifecycle> {
    JobLifecycle::from_history(history)
        .map_err(|e| StoreError::Corrupt(format!("history of job {id}: {e}")))
}

/// A job's history from the JSON array of [`super::JOB_HISTORY`]: `[from, to, at, reason]` each,
/// oldest first, as [`transition_from_row`] reads the columns.
pub(super) fn transitions_from_json(json: &str) -> StoreResult<Vec<JobTransition>> {
    let rows: Vec<(Option<String>, String, String, JobReason)> = from_json(json, "job history")?;
    rows.into_iter()
        .map(|(from, to, at, reason)| {
            Ok(JobTransition {
                from: from.map(|f| parse(&f, "job state")).transpose()?,
                to: parse(&to, "job state")?,
                at: parse_timestamp(&at)?,
                reason,
            })
        })
        .collect()
}

/// A job transition from `from_state, to_state, at, reason`.
pub(super) fn transition_from_row(row: &DbRow) -> StoreResult<JobTransition> {
    let from: Option<String> = row.try_get("from_state")?;
    Ok(JobTransition {
        from: from.map(|f| parse(&f, "job state")).transpose()?,
        to: parse(&row.try_get::<String, _>("to_state")?, "job state")?,
        at: parse_timestamp(&row.try_get::<String, _>("at")?)?,
        reason: from_json::<JobReason>(&row.try_get::<String, _>("reason")?, "job reason")?,
    })
}

/// New jobs, transitions and the jobs' new rows, written together by [`Self::insert`]: a
/// round's three hundred job starts in one `INSERT` and one `UPDATE`. Everything is encoded as
/// it is added, so a value that cannot be stored fails the batch before anything is written.
#[derive(Debug, Default)]
pub(super) struct JobWrites {
    jobs: Vec<NewJobRow>,
    grid: Vec<(JobId, GridJob)>,
    transitions: Vec<NewTransition>,
    states: Vec<NewState>,
    /// Where each changed job's entry is in `states`.
    changed: HashMap<JobId, usize>,
}

/// A new job's row, QUEUED.
#[derive(Debug)]
struct NewJobRow {
    id: String,
    owner: String,
    spec: String,
    max_duration_secs: Option<i64>,
    image_digest: String,
    docker_image: String,
    chain_initial: String,
    restart_count: i64,
    previous_job: Option<String>,
    queued_at: String,
    pinned_node: Option<String>,
}

#[derive(Debug)]
struct NewTransition {
    id: String,
    seq: i64,
    from: Option<JobState>,
    to: JobState,
    at: String,
    reason: String,
}

/// A job's row as the batch's changes of it leave it; `None` keeps what is stored.
#[derive(Debug)]
struct NewState {
    id: String,
    state: JobState,
    exit_code: Option<i64>,
    node: Option<String>,
    /// The GPUs given, as JSON, when placed.
    gpus: Option<String>,
    next_job: Option<String>,
}

/// What follows the values of [`JobWrites::insert`]'s `UPDATE` of the jobs' rows: a change sets
/// the state, and the exit code, placement and next job where it has them.
/// The write's change number ([`super::planning::next_change`]) follows, then [`FROM_STATES`].
const SET_STATES: &str = ") UPDATE jobs SET state = v.state, \
     exit_code = COALESCE(v.exit_code, jobs.exit_code), node = COALESCE(v.node, jobs.node), \
     gpus = COALESCE(v.gpus, jobs.gpus), next_job = COALESCE(v.next_job, jobs.next_job), \
     change_seq = ";
const FROM_STATES: &str = " FROM v WHERE jobs.id = v.id";

impl JobWrites {
    /// Adds `new`, QUEUED with its first transition; returns its lifecycle.
    pub(super) fn push_job(&mut self, new: &NewJob) -> StoreResult<JobLifecycle> {
        self.jobs.push(NewJobRow {
            id: new.id.to_string(),
            owner: new.owner.to_string(),
            spec: to_json(&new.spec)?,
            max_duration_secs: new
                .max_duration
                .map(|d| super::clamp(d.as_duration().as_secs())),
            image_digest: new.image.digest.clone(),
            docker_image: new.image.docker_image.clone(),
            chain_initial: new.chain.initial_job.to_string(),
            restart_count: i64::from(new.chain.restart_count),
            previous_job: new.previous_job.map(|j| j.to_string()),
            queued_at: timestamp(new.at),
            pinned_node: new.pinned_node.as_ref().map(NodeName::to_string),
        });
        if let Some(grid) = &new.grid {
            self.grid.push((new.id, grid.clone()));
        }
        let created = JobLifecycle::new(new.at, new.reason.clone());
        self.push_transition(new.id, 0, created.last())?;
        Ok(created)
    }

    /// Adds `transition` as number `seq` of job `id`'s history.
    pub(super) fn push_transition(
        &mut self,
        id: JobId,
        seq: usize,
        transition: &JobTransition,
    ) -> StoreResult<()> {
        self.transitions.push(NewTransition {
            id: id.to_string(),
            seq: i64::try_from(seq)
                .map_err(|_| StoreError::Corrupt("history too long".to_owned()))?,
            from: transition.from,
            to: transition.to,
            at: timestamp(transition.at),
            reason: to_json(&transition.reason)?,
        });
        Ok(())
    }

    /// Sets job `id`'s row as `change` leaves it, linked to `next`, the next job of its chain.
    /// A job changed again in the same batch keeps one entry: the later change's state, and its
    /// exit code, placement and next job where it has them, else the earlier's (what the two
    /// `UPDATE`s one after the other would leave).
    pub(super) fn set_state(
        &mut self,
        id: JobId,
        change: &JobChange,
        next: Option<JobId>,
    ) -> StoreResult<()> {
        let (node, gpus) = match &change.place {
            Some((node, gpus)) => (Some(node.to_string()), Some(to_json(gpus)?)),
            None => (None, None),
        };
        let new = NewState {
            id: id.to_string(),
            state: change.to,
            exit_code: change.exit_code.map(i64::from),
            node,
            gpus,
            next_job: next.map(|n| n.to_string()),
        };
        match self.changed.get(&id) {
            Some(&at) => {
                let earlier = &mut self.states[at];
                earlier.state = new.state;
                earlier.exit_code = new.exit_code.or(earlier.exit_code);
                if new.node.is_some() {
                    (earlier.node, earlier.gpus) = (new.node, new.gpus);
                }
                earlier.next_job = new.next_job.or(earlier.next_job.take());
            }
            None => {
                self.changed.insert(id, self.states.len());
                self.states.push(new);
            }
        }
        Ok(())
    }

    /// Writes everything added, [`PER_STATEMENT`] rows a statement: the new jobs first (the
    /// transitions and the links to them refer to them), then their grid rows (one statement
    /// each: a new grid job, or a grid job's chain going on, has one), the transitions and the
    /// jobs' rows. The jobs created or changed are stamped with the write's change number
    /// (`stamp`'s), which the jobs kept for planning follow ([`super::planning::KeptJobs`]).
    pub(super) async fn insert(
        self,
        tx: &mut Transaction<'static, Db>,
        stamp: &mut super::planning::Stamp,
    ) -> StoreResult<()> {
        let stamp = match self.jobs.is_empty() && self.states.is_empty() {
            true => 0,
            false => stamp.get(tx).await?,
        };
        for chunk in self.jobs.chunks(PER_STATEMENT) {
            let mut query = QueryBuilder::<Db>::new(
                "INSERT INTO jobs (id, owner, state, spec, max_duration_secs, image_digest, \
                 docker_image, chain_initial, restart_count, previous_job, queued_at, \
                 pinned_node, change_seq) ",
            );
            query.push_values(chunk, |mut values, job| {
                values
                    .push_bind(job.id.as_str())
                    .push_bind(job.owner.as_str())
                    .push_bind(JobState::Queued.as_str())
                    .push_bind(job.spec.as_str())
                    .push_bind(job.max_duration_secs)
                    .push_bind(job.image_digest.as_str())
                    .push_bind(job.docker_image.as_str())
                    .push_bind(job.chain_initial.as_str())
                    .push_bind(job.restart_count)
                    .push_bind(job.previous_job.as_deref())
                    .push_bind(job.queued_at.as_str())
                    .push_bind(job.pinned_node.as_deref())
                    .push_bind(stamp);
            });
            execute(query, chunk.len(), tx).await?;
        }
        for (id, grid) in &self.grid {
            super::grid_jobs::insert_grid(tx, *id, grid).await?;
        }
        for chunk in self.transitions.chunks(PER_STATEMENT) {
            let mut query = QueryBuilder::<Db>::new(
                "INSERT INTO job_transitions (job_id, seq, from_state, to_state, at, reason) ",
            );
            query.push_values(chunk, |mut values, row| {
                values
                    .push_bind(row.id.as_str())
                    .push_bind(row.seq)
                    .push_bind(row.from.map(JobState::as_str))
                    .push_bind(row.to.as_str())
                    .push_bind(row.at.as_str())
                    .push_bind(row.reason.as_str());
            });
            execute(query, chunk.len(), tx).await?;
        }
        for chunk in self.states.chunks(PER_STATEMENT) {
            let mut query =
                QueryBuilder::<Db>::new("WITH v (id, state, exit_code, node, gpus, next_job) AS (");
            query.push_values(chunk, |mut values, new| {
                values
                    .push_bind(new.id.as_str())
                    .push_bind(new.state.as_str())
                    .push_bind(new.exit_code)
                    .push_bind(new.node.as_deref())
                    .push_bind(new.gpus.as_deref())
                    .push_bind(new.next_job.as_deref());
            });
            query.push(SET_STATES).push_bind(stamp).push(FROM_STATES);
            execute(query, chunk.len(), tx).await?;
        }
        Ok(())
    }
}
