//! A job submitted (`POST /v1/jobs`), and a person's changes to a batch job, for
//! `POST /v1/jobs/{id}/cancel` and `/halt`,
//! `DELETE /v1/jobs/{id}` and the dashboard's cancel and remove buttons: find the job (a user
//! reaches only their own, an admin anyone's), ask [`crate::domain::jobs`] for the change, store
//! it, and say what it changed ([`Effect`]s: the scheduler's input, and a grid job's engine
//! through the grid mirror). Removing an ended job deletes its record and its output file.

use std::time::Duration;

use chrono::{DateTime, Utc};
use ongrid_core::job::{JobId, JobSpec, JobTarget, LogChunk, SubmitJob};
use ongrid_core::GpuRequest;

use super::caller::CurrentUser;
use super::lookup::{frozen_image_candidates, reservation_to_use, ReservationQuery};
use super::{ApiError, AppState, Effect, Via};
use crate::domain::grid_jobs;
use crate::domain::idempotency::{self, IdempotencyKey};
use crate::domain::jobs::{self, JobRecord, Submitter};
use crate::domain::policy::limits::{Kind as LimitedKind, Request as LimitedRequest};
use crate::domain::Refusal;
use crate::grid_mirror::HandOverError;
use crate::job_logs::JobLogs;
use crate::site::SiteSnapshot;
use crate::store::{JobFilter, JobRemoval, StoreError};

/// Why a job was not changed, where the API and the dashboard give different advice.
#[derive(Debug)]
pub enum JobActionError {
    /// Not a job id, or not a job the caller may see (answered alike: no existence oracle).
    NotFound(String),
    /// The job changed between the decision and the write.
    ChangedMeanwhile { job: JobId, cause: String },
    /// Refused or failed alike for every caller: the domain's refusal, the store.
    Api(ApiError),
}

impl From<ApiError> for JobActionError {
    fn from(error: ApiError) -> Self {
        Self::Api(error)
    }
}

impl From<StoreError> for JobActionError {
    fn from(error: StoreError) -> Self {
        Self::Api(error.into())
    }
}

/// The job `id` names, if the caller may see it: their own, or anyone's for an admin.
pub async fn find(
    state: &AppState,
    caller: &CurrentUser,
    id: &str,
) -> Result<JobRecord, JobActionError> {
    let not_found = || JobActionError::NotFound(id.to_owned());
    let id: JobId = id.parse().map_err(|_| not_found())?;
    let job = state.store.job(id).await?.ok_or_else(not_found)?;
    if job.owner != caller.user.dn && !caller.admin {
        return Err(not_found());
    }
    Ok(job)
}

/// A new job: its durations against the site's caps, where it runs and as whom, the site's
/// `[limits]`, the image the caller may run, whether some GPU of the site could ever run it (a
/// local job; a grid target's engine judges its own), the reservation it names. A local job is
/// queued for the scheduler; a grid target's is handed to its engine, whose id is stored before
/// this returns.
pub async fn submit(
    state: &AppState,
    caller: &CurrentUser,
    body: SubmitJob,
    reservation: ReservationQuery,
    key: Option<&IdempotencyKey>,
    via: Via,
) -> Result<JobRecord, ApiError> {
    // The same request again (its answer was lost): the job the first one made, before any
    // check that the first one's job would now change.
    let id = match key {
        Some(key) => JobId(idempotency::derived_id("job", &caller.user.dn, key)),
        None => JobId::new_random(),
    };
    if key.is_some() {
        if let Some(job) = state.store.job(id).await? {
            tracing::info!(job_id = %job.id, "Job submitted again with the same idempotency key; answered with the one made.");
            return Ok(job);
        }
    }
    // What the spec asks for against the site's caps, before anything is looked up.
    jobs::check_durations(&body.spec, &state.config.job_limits)?;
    // Where it runs, and as whom, before which image: a refused target says so first.
    let now = state.clock.now();
    let targets = state.grid.targets();
    let grid = grid_jobs::choose_target(
        body.spec.target,
        &targets.offered(),
        targets.config().default,
        &targets.config().accounts,
        (&caller.user.dn, &caller.admitted.group),
        now,
    )?;
    let site = match (&state.config.limits, &grid) {
        (None, Some(_)) => None,
        _ => Some(state.inventory().await?),
    };
    if let Some(site) = &site {
        check_limits(state, caller, &body.spec, grid.is_some(), site)?;
    }
    let lookup = body.spec.image.clone();
    let candidates = frozen_image_candidates(state, &caller.user.dn, &lookup).await?;
    // Logged, with the caller, as every 403 is (`error::log_refusals`).
    let image = jobs::resolve_image(&lookup, &candidates, &caller.user.dn)?;
    if let (None, Some(site)) = (&grid, &site) {
        check_the_site_could_run(state, &body.spec.gpus, site)?;
    }
    let named = body.reservation;
    let who = Submitter {
        owner: caller.user.dn.clone(),
        user_name: caller.user.user_name.clone(),
        uid: caller.user.uid,
    };
    let new = jobs::submit(
        id,
        who,
        body.spec,
        image,
        &state.config.job_limits,
        grid,
        now,
    )?;
    if let Some(reservation) = reservation_to_use(state, caller, named, reservation).await? {
        if new.grid.is_some() {
            return Err(ApiError::bad_request(format!(
                "reservation {reservation} holds GPUs of this site: a job for a grid target \
                 cannot use it; leave out --reservation or submit with --to local"
            )));
        }
        // Before the job exists, for its whole chain (restarts keep it).
        state
            .store
            .gpu_policy()
            .set_chain_reservation(new.chain.initial_job, &reservation)
            .await?;
    }
    let job = match state.store.create_job(new).await {
        Ok(job) => job,
        // Its twin, sent at the same time, made it.
        Err(error) => match state.store.job(id).await? {
            Some(job) if key.is_some() => return Ok(job),
            _ => return Err(error.into()),
        },
    };
    tracing::info!(job_id = %job.id, owner = %job.owner, image = %lookup, target = ?job.spec.target, via = via.as_str(), "Job submitted.");
    if job.grid.is_none() {
        state.committed(&[Effect::Scheduling, Effect::People]);
        return Ok(job);
    }
    let job = hand_over(state, job).await?;
    state.committed(&[Effect::People]);
    Ok(job)
}

/// The site's `[limits]` for a new job of `caller`'s (a grid target's job counts as short
/// work: its engine applies its own length limits).
fn check_limits(
    state: &AppState,
    caller: &CurrentUser,
    spec: &JobSpec,
    for_grid: bool,
    site: &SiteSnapshot,
) -> Result<(), ApiError> {
    let Some(limits) = &state.config.limits else {
        return Ok(());
    };
    let length = if for_grid {
        Duration::ZERO
    } else {
        jobs::effective_max_duration(spec, &state.config.job_limits).as_duration()
    };
    let limited = LimitedRequest {
        id: (),
        owner: caller.user.dn.clone(),
        group: caller.admitted.group.clone(),
        kind: LimitedKind::Job,
        gpus: spec.gpus.count,
        length: Some(length),
    };
    match crate::scheduling::limits::refusal(Some(limits), &limited, site) {
        Some(refusal) => Err(ApiError::forbidden(refusal)),
        None => Ok(()),
    }
}

/// A local job some GPU of the site could run one day; else what none has, and where else it
/// may run.
fn check_the_site_could_run(
    state: &AppState,
    gpus: &GpuRequest,
    site: &SiteSnapshot,
) -> Result<(), ApiError> {
    let Some(why) = site.never_meets(gpus) else {
        return Ok(());
    };
    let elsewhere = if state
        .grid
        .targets()
        .offered()
        .iter()
        .any(|t| *t != JobTarget::Local)
    {
        ", or `devctl job targets` for where else it may run (--to)"
    } else {
        ""
    };
    Err(ApiError::unsatisfiable(format!(
        "{why}; see `devctl gpus`{elsewhere}"
    )))
}

/// Hands a grid target's new job to its engine; the engine's id is stored before this answers.
async fn hand_over(state: &AppState, job: JobRecord) -> Result<JobRecord, ApiError> {
    match state.grid.hand_over(job).await {
        Ok(job) => Ok(job),
        Err(HandOverError::Refused {
            target,
            message,
            job,
        }) => Err(ApiError::unsatisfiable(format!(
            "{target} refused job {}: {message}",
            job.id
        ))),
        Err(HandOverError::Unavailable(message, job)) => {
            Err(ApiError::unavailable(format!("job {}: {message}", job.id)))
        }
        Err(HandOverError::Store(e)) => Err(e.into()),
    }
}

/// Cancels the job: a queued job never starts, a running one is stopped by its agent or its
/// grid engine.
pub async fn cancel(
    state: &AppState,
    caller: &CurrentUser,
    id: &str,
    via: Via,
) -> Result<JobRecord, JobActionError> {
    let job = change_by_owner(state, caller, id, jobs::cancel_by_owner).await?;
    tracing::info!(job_id = %job.id, by = %caller.user.user_name, via = via.as_str(), "Job cancelled.");
    Ok(job)
}

/// Halts the job (GPULab's MUSTHALT: SIGUSR1, then exit 123); a restartable one is queued again.
pub async fn halt(
    state: &AppState,
    caller: &CurrentUser,
    id: &str,
    via: Via,
) -> Result<JobRecord, JobActionError> {
    let job = change_by_owner(state, caller, id, jobs::halt_by_owner).await?;
    tracing::info!(job_id = %job.id, by = %caller.user.user_name, via = via.as_str(), "Job halted.");
    Ok(job)
}

/// Removes an ended job: its record (as [`crate::domain::jobs::removal`] allows, decided in the
/// store's transaction) and its output file. Returns the job as it was.
pub async fn remove(
    state: &AppState,
    caller: &CurrentUser,
    id: &str,
    via: Via,
) -> Result<JobRecord, JobActionError> {
    let job = find(state, caller, id).await?;
    let removal = state
        .store
        .remove_job(
            job.id,
            state.config.job_limits.output_grace,
            state.clock.now(),
        )
        .await?;
    let job = match removal {
        JobRemoval::Removed(job) => *job,
        // Removed meanwhile (by its owner elsewhere, or the retention's prune).
        JobRemoval::NoSuchJob => return Err(JobActionError::NotFound(id.to_owned())),
        JobRemoval::Refused(refusal) => return Err(ApiError::from(refusal).into()),
    };
    let logs = JobLogs::new(state.config.job_log_dir.clone());
    if let Err(error) = logs.remove(job.id).await {
        // The record is gone: what is left is disk space, for the operator.
        tracing::warn!(job_id = %job.id, file = %logs.file(job.id).display(), %error, "Could not delete a removed job's output file: delete it by hand.");
    }
    // Nothing runs or waits for it any more: the people's pages that list it are told.
    state.committed(&[Effect::People]);
    tracing::info!(job_id = %job.id, state = %job.state(), by = %caller.user.user_name, via = via.as_str(), "Job removed.");
    Ok(job)
}

/// Finds the job, asks `decide` (the domain's rule) for the change, stores it and says what it
/// changed.
async fn change_by_owner(
    state: &AppState,
    caller: &CurrentUser,
    id: &str,
    decide: fn(&JobRecord, DateTime<Utc>) -> Result<jobs::JobChange, Refusal>,
) -> Result<JobRecord, JobActionError> {
    let job = find(state, caller, id).await?;
    let change = decide(&job, state.clock.now()).map_err(ApiError::from)?;
    let job = store_change(state, job.id, change).await?;
    state.committed(&job_effects(&job));
    Ok(job)
}

/// What a changed job concerns: the scheduler (its GPUs, the queue), and for a job of a grid
/// target its engine, reached through the grid mirror.
pub fn job_effects(job: &JobRecord) -> Vec<Effect> {
    let mut effects = vec![Effect::Scheduling, Effect::Nodes];
    if job.grid.is_some() {
        effects.push(Effect::GridJob);
    }
    effects
}

async fn store_change(
    state: &AppState,
    id: JobId,
    change: jobs::JobChange,
) -> Result<JobRecord, JobActionError> {
    state
        .store
        .job_transition(id, change, None)
        .await
        .map_err(|error| match error {
            StoreError::InvalidJobTransition(e) => JobActionError::ChangedMeanwhile {
                job: id,
                cause: e.to_string(),
            },
            other => other.into(),
        })
}

/// The caller's or everyone's (admins only) jobs.
pub async fn list(
    state: &AppState,
    caller: &CurrentUser,
    everyones: bool,
) -> Result<Vec<JobRecord>, ApiError> {
    let filter = match caller.listing_owner(everyones, "jobs")? {
        None => JobFilter::All,
        Some(dn) => JobFilter::Owner(dn.clone()),
    };
    Ok(state.store.jobs(filter).await?)
}

/// The job's kept output from `offset` (at most [`LOG_READ_MAX`] bytes); `complete` when the
/// job has ended, its output is all in and these bytes reach its end. With `wait`, a long-poll
/// that `devctl job logs -f` follows: the agents' syncs append output and change jobs, then
/// notify ([`crate::notify::Changes`]), and so do the scheduler and the owner's cancel and
/// halt; an answer without new bytes that is not complete means the wait passed.
pub async fn logs(
    state: &AppState,
    caller: &CurrentUser,
    id: &str,
    offset: u64,
    wait: Option<Duration>,
) -> Result<LogChunk, JobActionError> {
    // Subscribed before the first read, so no report between the read and the wait is missed.
    let mut changes = state.changes.subscribe();
    let mut job = find(state, caller, id).await?;
    let deadline = tokio::time::Instant::now() + wait.unwrap_or_default();
    loop {
        let chunk = read_logs(state, &job, offset).await?;
        if wait.is_none() || !chunk.data.is_empty() || chunk.complete {
            return Ok(chunk);
        }
        // An ended job's output is complete when the agent says so or when `output_grace`
        // passes, which nothing notifies: wake then too.
        let until = match grace_left(state, &job) {
            Some(left) => deadline.min(tokio::time::Instant::now() + left),
            None => deadline,
        };
        match tokio::time::timeout_at(until, changes.changed()).await {
            Ok(true) => {}
            // Shutting down: answer what there is.
            Ok(false) => return Ok(chunk),
            Err(_) if until >= deadline => return Ok(read_logs(state, &job, offset).await?),
            Err(_) => {}
        }
        match state.store.job(job.id).await? {
            Some(now) => job = now,
            None => return Ok(chunk),
        }
    }
}

/// At most this many bytes of output in one answer of [`logs`].
pub const LOG_READ_MAX: usize = 1024 * 1024;

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

#[cfg(test)]
mod tests {
    use ongrid_core::job::JobState;

    use super::*;
    use crate::domain::grid_jobs::tests::job;

    /// The API's and the dashboard's cancel and halt are this one use case, so they wake the
    /// same waiters; a grid job's change must reach its engine through the grid mirror (the
    /// dashboard's former copy of the cancel never woke it, so a Slurm or HTCondor job
    /// cancelled from the page reached the engine only at the next poll).
    #[test]
    fn a_grid_jobs_change_wakes_the_grid_mirror_and_a_local_ones_does_not() {
        let grid = job(JobState::Running);
        assert!(grid.grid.is_some());
        assert_eq!(
            job_effects(&grid),
            vec![Effect::Scheduling, Effect::Nodes, Effect::GridJob]
        );
        let mut local = grid;
        local.grid = None;
        assert_eq!(job_effects(&local), vec![Effect::Scheduling, Effect::Nodes]);
    }
}
