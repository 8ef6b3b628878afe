//! Routes for batch jobs: `POST /v1/jobs` (submit; a job of a grid target is handed to its
//! engine, whose id is stored, before the answer), `GET /v1/targets` (where jobs may run),
//! `GET /v1/jobs[?all=true]`,
//! `GET /v1/jobs/{id}`, `DELETE /v1/jobs/{id}` (an ended job's record and output, answered with
//! the job as it was), `POST /v1/jobs/{id}/cancel`, `POST /v1/jobs/{id}/halt` and
//! `GET /v1/jobs/{id}/logs?offset=N[&wait=true]` (with `wait`, a long-poll answered once there
//! is output from `N` or the output is complete). The jobs' part of an agent's sync is in
//! [`crate::app::job_reports`].
//!
//! A job runs a READY frozen image its owner may run (their own, or one shared by its owner),
//! named as `devctl image` names them (`name:version`, `login/name:version` or `sha256:`
//! digest), resolved at submit into the digest and Docker image the agents run; an unknown
//! image and someone else's private one get the same 403, as for sessions, so a submission
//! tells nobody whether another user has an image. Like sessions, a user sees and changes only
//! their own jobs (others' answer the same 404 as missing ones); admins see all. Every
//! transition is decided by [`crate::domain::jobs`]; the scheduling loop starts, halts and
//! cancels jobs.

use std::collections::HashMap;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use chrono::{DateTime, Utc};
use ongrid_core::job::{GridJobView, JobId, JobState, JobView, LogChunk, SubmitJob, TargetInfo};
use serde::Deserialize;

use super::callers::CurrentUser;
use super::{ApiError, ApiJson, ApiPath, ApiQuery, AppState, RequestKey};
use crate::app::jobs::JobActionError;
use crate::app::{self, Via};
use crate::domain::jobs::{self, JobRecord};
use crate::job_logs::JobLogs;
use crate::store::JobFilter;

/// At most this many bytes of output in one answer of the logs route.
pub const LOG_READ_MAX: usize = 1024 * 1024;

pub async fn submit_job(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiQuery(query): ApiQuery<crate::app::lookup::ReservationQuery>,
    RequestKey(key): RequestKey,
    ApiJson(body): ApiJson<SubmitJob>,
) -> Result<(StatusCode, Json<JobView>), ApiError> {
    let job = app::jobs::submit(&state, &caller, body, query, key.as_ref(), Via::Api).await?;
    let view = view(&state, job).await?;
    Ok((StatusCode::CREATED, Json(view)))
}

/// `GET /v1/targets`: where the caller's jobs may run, and under which local account.
pub async fn list_targets(
    State(state): State<AppState>,
    caller: CurrentUser,
) -> Json<Vec<TargetInfo>> {
    Json(
        state
            .grid
            .targets()
            .describe_for(&caller.user.dn, &caller.admitted.group),
    )
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    #[serde(default)]
    all: bool,
}

pub async fn list_jobs(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiQuery(query): ApiQuery<ListQuery>,
) -> Result<Json<Vec<JobView>>, ApiError> {
    let filter = if query.all {
        if !caller.admin {
            return Err(ApiError::forbidden(
                "only admins can list everyone's jobs (?all=true); leave it out to list yours",
            ));
        }
        JobFilter::All
    } else {
        JobFilter::Owner(caller.user.dn.clone())
    };
    let records = state.store.jobs(filter).await?;
    let active = state.store.jobs(JobFilter::Active).await?;
    let positions = queue_positions(&state, &active).await?;
    let now = state.clock.now();
    let views = records
        .into_iter()
        .map(|job| job_view(job, &active, &positions, now))
        .collect();
    Ok(Json(views))
}

/// 1-based queue positions of the QUEUED jobs among `active`, in the order the scheduler
/// serves them (fair-share priority, then time queued). Jobs of grid targets wait in their
/// engines' queues, not in this one: they have no position.
async fn queue_positions(
    state: &AppState,
    active: &[JobRecord],
) -> Result<HashMap<JobId, u32>, ApiError> {
    let waiting: Vec<_> = active
        .iter()
        .filter(|j| j.state() == JobState::Queued && j.grid.is_none())
        .map(|j| (j.owner.clone(), j.queued_at(), j.id))
        .collect();
    let accounts = match &state.config.fair_share {
        Some(_) => state.store.usage_accounts().await?,
        None => Vec::new(),
    };
    let order = crate::scheduling::fair_share::serve_order(
        &waiting,
        &accounts,
        state.config.fair_share.as_ref(),
    );
    Ok(order.into_iter().zip(1u32..).collect())
}

pub async fn show_job(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<JobView>, ApiError> {
    let job = find_job(&state, &caller, &id).await?;
    Ok(Json(view(&state, job).await?))
}

pub async fn cancel_job(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<JobView>, ApiError> {
    let job = app::jobs::cancel(&state, &caller, &id, Via::Api)
        .await
        .map_err(job_refused)?;
    Ok(Json(view(&state, job).await?))
}

pub async fn halt_job(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<JobView>, ApiError> {
    let job = app::jobs::halt(&state, &caller, &id, Via::Api)
        .await
        .map_err(job_refused)?;
    Ok(Json(view(&state, job).await?))
}

pub async fn remove_job(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<JobView>, ApiError> {
    let job = app::jobs::remove(&state, &caller, &id, Via::Api)
        .await
        .map_err(job_refused)?;
    let active = state.store.jobs(JobFilter::Active).await?;
    Ok(Json(job_view(
        job,
        &active,
        &HashMap::new(),
        state.clock.now(),
    )))
}

/// A job use case's refusal as devctl users read it.
fn job_refused(error: JobActionError) -> ApiError {
    match error {
        JobActionError::NotFound(id) => no_such_job(&id),
        JobActionError::ChangedMeanwhile { cause, .. } => ApiError::conflict(format!(
            "{cause}: it changed meanwhile, see `devctl job show`"
        )),
        JobActionError::Api(error) => error,
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogQuery {
    #[serde(default)]
    offset: u64,
    /// A long-poll: answer once output from `offset` exists or the output is complete, or when
    /// `timeout` passes, whichever comes first.
    #[serde(default)]
    wait: bool,
    /// How long `wait` waits, in seconds (default and maximum: [`MAX_LOG_WAIT`]).
    timeout: Option<u64>,
}

/// The longest a logs long-poll waits.
pub const MAX_LOG_WAIT: Duration = Duration::from_secs(60);

/// The job's kept output from `offset` (at most [`LOG_READ_MAX`] bytes); `complete` when the
/// job has ended, its output is all in and these bytes reach its end. With `wait`, a long-poll
/// that `devctl job logs -f` follows: the agents' syncs append output and change jobs, then
/// notify ([`crate::notify::Changes`]), and so do the scheduler and the owner's cancel and
/// halt; an answer without new bytes that is not complete means the timeout passed.
pub async fn job_logs(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(id): ApiPath<String>,
    ApiQuery(query): ApiQuery<LogQuery>,
) -> Result<Json<LogChunk>, ApiError> {
    // Subscribed before the first read, so no report between the read and the wait is missed.
    let mut changes = state.changes.subscribe();
    let mut job = find_job(&state, &caller, &id).await?;
    let wait = query
        .timeout
        .map_or(MAX_LOG_WAIT, Duration::from_secs)
        .min(MAX_LOG_WAIT);
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let chunk = read_logs(&state, &job, query.offset).await?;
        if !query.wait || !chunk.data.is_empty() || chunk.complete {
            return Ok(Json(chunk));
        }
        // An ended job's output is complete when the agent says so or when `output_grace`
        // passes, which nothing notifies: wake then too.
        let until = match grace_left(&state, &job) {
            Some(left) => deadline.min(tokio::time::Instant::now() + left),
            None => deadline,
        };
        match tokio::time::timeout_at(until, changes.changed(None)).await {
            Ok(true) => {}
            // Shutting down: answer what there is.
            Ok(false) => return Ok(Json(chunk)),
            Err(_) if until >= deadline => {
                return Ok(Json(read_logs(&state, &job, query.offset).await?))
            }
            Err(_) => {}
        }
        match state.store.job(job.id).await? {
            Some(now) => job = now,
            None => return Ok(Json(chunk)),
        }
    }
}

/// The output of `job` from `offset` as stored now.
async fn read_logs(state: &AppState, job: &JobRecord, offset: u64) -> Result<LogChunk, ApiError> {
    let logs = JobLogs::new(state.config.job_log_dir.clone());
    let (data, size) = logs
        .read(job.id, offset, LOG_READ_MAX)
        .await
        .map_err(|e| ApiError::internal(format!("reading the output of job {}: {e}", job.id)))?;
    let end = offset.saturating_add(data.len() as u64) >= size;
    let complete =
        end && jobs::output_complete(job, state.config.job_limits.output_grace, state.clock.now());
    Ok(LogChunk {
        offset,
        data,
        complete,
    })
}

/// How long until an ended job's output counts as complete without the agent saying so; `None`
/// while it runs or once the agent said so.
fn grace_left(state: &AppState, job: &JobRecord) -> Option<Duration> {
    if job.log_complete {
        return None;
    }
    let grace = chrono::TimeDelta::from_std(state.config.job_limits.output_grace).ok()?;
    let left = job.finished_at()? + grace - state.clock.now();
    // At least a little, so a clock a test holds still cannot make it spin.
    Some(left.to_std().unwrap_or_default().max(GRACE_RECHECK))
}

/// The shortest wait for an output grace to end.
const GRACE_RECHECK: Duration = Duration::from_millis(100);

/// The caller's job `id` (an admin: anyone's); the same 404 for a missing job and someone
/// else's.
async fn find_job(state: &AppState, caller: &CurrentUser, id: &str) -> Result<JobRecord, ApiError> {
    app::jobs::find(state, caller, id)
        .await
        .map_err(job_refused)
}

/// A job id that does not parse or names no job the caller may see.
fn no_such_job(id: &str) -> ApiError {
    if id.parse::<JobId>().is_err() {
        return ApiError::bad_request(format!(
            "{id:?} is not a job id: `devctl job ls` lists them"
        ));
    }
    ApiError::not_found(format!(
        "you have no job {id}: list yours with `devctl job ls`"
    ))
}

/// The QUEUED jobs in queue order.
async fn view(state: &AppState, job: JobRecord) -> Result<JobView, ApiError> {
    let active = state.store.jobs(JobFilter::Active).await?;
    let note = if job.state() == JobState::Queued && job.grid.is_none() {
        let asker = crate::app::views::PolicyAsker {
            owner: &job.owner,
            session: None,
            job: Some(&job),
            max_duration: job.max_duration.map(|d| d.as_duration()),
        };
        let reads = crate::app::views::Reads::new(state);
        crate::app::views::gpu_policy_note(&reads, &job.spec.gpus, &asker).await?
    } else {
        None
    };
    let held_back = (job.state() == JobState::Queued && job.grid.is_none())
        .then(|| {
            state
                .scheduler
                .limit_wait(crate::scheduling::limits::Waiting::Job(job.id))
        })
        .flatten();
    let positions = queue_positions(state, &active).await?;
    let mut view = job_view(job, &active, &positions, state.clock.now());
    if let (Some(limit), Some(waiting)) = (held_back, view.waiting.as_mut()) {
        // A QUEUED job over a `[limits]` maximum says which one holds it.
        *waiting = format!("waits for a limit: {limit}");
    } else if let (Some(note), Some(waiting)) = (note, view.waiting.as_mut()) {
        // Owned GPUs and reservations that keep it off GPUs that would fit it.
        *waiting = format!("{waiting}; {note}");
    }
    Ok(view)
}

/// A job as the API shows it, with its place among the site's QUEUED jobs (`positions`) and
/// why it waits (from `active`: the site's jobs QUEUED or holding GPUs).
fn job_view(
    job: JobRecord,
    active: &[JobRecord],
    positions: &HashMap<JobId, u32>,
    now: DateTime<Utc>,
) -> JobView {
    let position = positions.get(&job.id).copied();
    let waiting = jobs::waiting_reason(&job, active, now);
    JobView {
        id: job.id,
        owner: job.owner.clone(),
        user_name: job.user_name.clone(),
        state: job.state(),
        reason: job.lifecycle.last().reason.to_string(),
        max_duration: job.max_duration,
        image_digest: Some(job.image.digest.clone()),
        node: job.node.clone(),
        gpus: job.gpus.clone(),
        chain: job.chain,
        previous_job: job.previous_job,
        next_job: job.next_job,
        exit_code: job.exit_code,
        queued_at: job.queued_at(),
        started_at: job.lifecycle.started_at(),
        finished_at: job.finished_at(),
        queue_position: position,
        waiting,
        transitions: job.lifecycle.history().to_vec(),
        grid: job.grid.as_ref().map(|g| GridJobView {
            target: g.target,
            account: g.account.to_string(),
            engine_id: g.engine_id.as_ref().map(ToString::to_string),
            engine_state: g.engine_state.clone(),
            polled_at: g.polled_at,
        }),
        output_complete: job.log_complete,
        spec: job.spec,
    }
}
