//! What each dashboard page shows, read from the store exactly as the API reads it for the same
//! caller: a user's own sessions, images and jobs; an admin's view of everything. The page
//! routes and the live updates ([`super::live`]) both render through here, so a live update is
//! always the page's own markup.

use maud::Markup;
use ongrid_core::api::{AuditRecord, SessionView};
use ongrid_core::image::ImageState;
use ongrid_core::job::JobId;
use ongrid_core::{Dn, Institute, SessionState};

use super::auth::{PageError, Viewer};
use super::views;
use crate::app::caller::CurrentUser;
use crate::app::images::Listed;
use crate::app::jobs::JobActionError;
use crate::app::views::{full_session_view, image_view, Reads};
use crate::app::{ApiError, AppState};
use crate::domain::jobs::JobRecord;
use crate::job_logs::JobLogs;

/// The most of a job's output the page shows (its end).
const OUTPUT_SHOWN: u64 = 256 * 1024;
/// The most audit records the admin page shows.
const AUDIT_SHOWN: u32 = 200;

/// Which live part a page has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Live {
    User,
    Admin,
    Job(JobId),
}

impl Live {
    /// `user`, `admin` or `job/<id>` (the page's `data-live`).
    pub fn parse(text: &str) -> Result<Self, PageError> {
        match text {
            "user" => Ok(Self::User),
            "admin" => Ok(Self::Admin),
            other => other
                .strip_prefix("job/")
                .and_then(|id| id.parse().ok())
                .map(Self::Job)
                .ok_or_else(|| {
                    PageError(ApiError::bad_request(format!(
                        "no live view {other:?}: use user, admin or job/<id>"
                    )))
                }),
        }
    }
}

/// The viewer's sessions (`everyones`: all, for an admin) as the API's `session show` sees
/// them, ENDED ones left out.
async fn sessions(
    state: &AppState,
    viewer: &Viewer,
    everyones: bool,
) -> Result<Vec<SessionView>, PageError> {
    let mut views = Vec::new();
    // The site-wide reads once for the page, not once per session.
    let reads = Reads::new(state);
    for session in crate::app::sessions::list(state, &viewer.caller, everyones).await? {
        if session.state == SessionState::Ended {
            continue;
        }
        views.push(full_session_view(&reads, session).await?);
    }
    Ok(views)
}

/// The live part of `live` for `viewer`; `None` when the viewer may not see it (the same
/// refusal as the page's).
pub async fn render(state: &AppState, viewer: &Viewer, live: &Live) -> Result<Markup, PageError> {
    let now = state.clock.now();
    let config = &state.config.dashboard;
    match live {
        Live::User => {
            let sessions = sessions(state, viewer, false).await?;
            let images: Vec<_> = crate::app::images::list(state, &viewer.caller, Listed::Own)
                .await?
                .into_iter()
                .map(image_view)
                .filter(|image| image.state != ImageState::Deleted)
                .collect();
            let jobs = crate::app::jobs::list(state, &viewer.caller, false).await?;
            Ok(views::user_live(
                &sessions,
                &images,
                &jobs,
                config,
                &viewer.csrf,
                now,
            ))
        }
        Live::Admin => {
            viewer.require_admin()?;
            let sessions = sessions(state, viewer, true).await?;
            let jobs = crate::app::jobs::list(state, &viewer.caller, true).await?;
            let site = state.site().await?;
            let nodes = views::nodes_table(&site.nodes, &|node| site.is_online(node), &viewer.csrf);
            Ok(views::admin_live(
                &sessions,
                &jobs,
                nodes,
                config,
                &viewer.csrf,
                now,
            ))
        }
        Live::Job(id) => {
            let job = job(state, viewer, *id).await?;
            let (output, truncated) = output(state, &job).await?;
            Ok(views::job_live(&job, &output, truncated))
        }
    }
}

/// One of the viewer's jobs (admins: anyone's); someone else's is "not found", as in the API.
pub async fn job(state: &AppState, viewer: &Viewer, id: JobId) -> Result<JobRecord, PageError> {
    match crate::app::jobs::find(state, &viewer.caller, &id.to_string()).await {
        Ok(job) => Ok(job),
        Err(JobActionError::NotFound(_)) => Err(PageError(ApiError::not_found(format!(
            "you have no job {id}"
        )))),
        Err(JobActionError::ChangedMeanwhile { cause, .. }) => {
            Err(PageError(ApiError::conflict(cause)))
        }
        Err(JobActionError::Api(error)) => Err(PageError(error)),
    }
}

/// The end of a job's output as text, and whether the start was cut.
async fn output(state: &AppState, job: &JobRecord) -> Result<(String, bool), PageError> {
    let logs = JobLogs::new(state.config.job_log_dir.clone());
    let from = job.log_size.saturating_sub(OUTPUT_SHOWN);
    let (data, _) = logs
        .read(job.id, from, OUTPUT_SHOWN as usize)
        .await
        .map_err(|e| ApiError::internal(format!("reading the output of job {}: {e}", job.id)))?;
    Ok((String::from_utf8_lossy(&data).into_owned(), from > 0))
}

/// The names of the viewer's live sessions (the freeze form's choices).
pub async fn session_names(state: &AppState, viewer: &Viewer) -> Result<Vec<String>, PageError> {
    Ok(crate::app::sessions::list(state, &viewer.caller, false)
        .await?
        .into_iter()
        .filter(|s| s.state.is_live() || s.state == SessionState::Held)
        .map(|s| s.name.to_string())
        .collect())
}

/// The institutes and the filtered audit log (admins only; checked by the caller).
pub async fn admin_tables(
    state: &AppState,
    caller: &CurrentUser,
    user: Option<Dn>,
    since: Option<chrono::DateTime<chrono::Utc>>,
) -> Result<(Vec<Institute>, Vec<AuditRecord>), PageError> {
    let institutes = crate::app::institutes::list(state, caller).await?;
    let audit = crate::app::gateway::audit(state, user, since, AUDIT_SHOWN).await?;
    Ok((institutes, audit))
}
