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

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use ongrid_core::job::{JobId, JobView, LogChunk, SubmitJob, TargetInfo};
use serde::Deserialize;

use super::callers::CurrentUser;
use super::{poll_timeout, ApiError, ApiJson, ApiPath, ApiQuery, AppState, RequestKey};
use crate::app::jobs::JobActionError;
use crate::app::lookup::ListQuery;
use crate::app::views::{job_view_now, job_views, removed_job_view};
use crate::app::{self, Via};

pub async fn submit_job(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiQuery(query): ApiQuery<crate::app::lookup::ReservationQuery>,
    RequestKey(key): RequestKey,
    ApiJson(body): ApiJson<SubmitJob>,
) -> Result<(StatusCode, Json<JobView>), ApiError> {
    let job = app::jobs::submit(&state, &caller, body, query, key.as_ref(), Via::Api).await?;
    let view = job_view_now(&state, job).await?;
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

pub async fn list_jobs(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiQuery(query): ApiQuery<ListQuery>,
) -> Result<Json<Vec<JobView>>, ApiError> {
    let records = app::jobs::list(&state, &caller, query.all).await?;
    Ok(Json(job_views(&state, records).await?))
}

pub async fn show_job(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<JobView>, ApiError> {
    let job = find_job(&state, &caller, &id).await?;
    Ok(Json(job_view_now(&state, job).await?))
}

pub async fn cancel_job(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<JobView>, ApiError> {
    let job = app::jobs::cancel(&state, &caller, &id, Via::Api)
        .await
        .map_err(job_refused)?;
    Ok(Json(job_view_now(&state, job).await?))
}

pub async fn halt_job(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<JobView>, ApiError> {
    let job = app::jobs::halt(&state, &caller, &id, Via::Api)
        .await
        .map_err(job_refused)?;
    Ok(Json(job_view_now(&state, job).await?))
}

pub async fn remove_job(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<JobView>, ApiError> {
    let job = app::jobs::remove(&state, &caller, &id, Via::Api)
        .await
        .map_err(job_refused)?;
    Ok(Json(removed_job_view(&state, job).await?))
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

/// The job's kept output from `offset` (at most [`app::jobs::LOG_READ_MAX`] bytes); `complete` when the
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
    let wait = query
        .wait
        .then(|| poll_timeout(query.timeout, MAX_LOG_WAIT));
    let chunk = app::jobs::logs(&state, &caller, &id, query.offset, wait)
        .await
        .map_err(job_refused)?;
    Ok(Json(chunk))
}

/// The caller's job `id` (an admin: anyone's); the same 404 for a missing job and someone
/// else's.
async fn find_job(
    state: &AppState,
    caller: &CurrentUser,
    id: &str,
) -> Result<crate::domain::jobs::JobRecord, ApiError> {
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
