//! Routes for people's sessions: create, list, show and remove them; hold, release and keep
//! one alive (`devctl session new | ls | show | rm | hold | release | keep`).
//!
//! A user sees and changes only their own sessions; an admin may address anyone's with
//! `?owner=DN` and list everyone's with `?all=true`. A non-admin asking for someone else's
//! session gets the same 404 as for a session that does not exist, so names do not leak.
//! Session listings leave out ENDED sessions and carry no transitions; `GET
//! /v1/sessions/{name}` shows the history. Creating, holding, releasing, keeping and removing
//! are [`crate::app::sessions`], shared with the dashboard's forms (what each request may
//! change is decided by [`crate::domain::sessions::requests`]); here they are worded for
//! `devctl` and answered as JSON. The automatic holds are the hold timer's.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use ongrid_core::api::{CreateSession, SessionView};
use ongrid_core::holds::{HoldRequest, KeepRequest};
use ongrid_core::{Dn, SessionState};
use serde::Deserialize;
use std::time::Duration;

use super::callers::CurrentUser;
use super::{poll_timeout, ApiError, ApiJson, ApiPath, ApiQuery, AppState, RequestKey};
use crate::app::lookup::{ListQuery, OwnerQuery, ReservationQuery};
use crate::app::sessions::{self as actions, Created, SessionActionError, SessionTarget};
use crate::app::views::{
    changed_session_view, full_session_view, full_view_as_read, session_view, Reads,
};
use crate::app::Via;

pub async fn create_session(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiQuery(query): ApiQuery<ReservationQuery>,
    RequestKey(key): RequestKey,
    ApiJson(body): ApiJson<CreateSession>,
) -> Result<(StatusCode, Json<SessionView>), ApiError> {
    let Created { session, site } =
        actions::create(&state, &caller, body, query, key.as_ref(), Via::Api)
            .await
            .map_err(refused)?;
    let mut view = changed_session_view(&state, session).await?;
    if view.state == SessionState::Pending {
        if let Some(why) = crate::app::views::out_of_service(&site, &view.request) {
            view.reason = format!("{}; {why}", view.reason);
        }
    }
    Ok((StatusCode::CREATED, Json(view)))
}

/// A session action's refusal as the API words it, with the `devctl` command that helps.
fn refused(error: SessionActionError) -> ApiError {
    match error {
        SessionActionError::InvalidGpus(e) => ApiError::bad_request(format!("gpus.count: {e}")),
        SessionActionError::Unsatisfiable(why) => {
            ApiError::unsatisfiable(format!("{why}; see `devctl gpus`"))
        }
        SessionActionError::NameTaken { name, state } => ApiError::conflict(format!(
            "you already have a session named {name} ({state}): pick another --name or \
             `devctl session rm {name}`"
        )),
        SessionActionError::ChangedMeanwhile { session, cause } => ApiError::conflict(format!(
            "session {session} changed meanwhile ({cause}): look at it with \
             `devctl session show {session}`"
        )),
        SessionActionError::Api(error) => error,
    }
}

pub async fn list_sessions(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiQuery(query): ApiQuery<ListQuery>,
) -> Result<Json<Vec<SessionView>>, ApiError> {
    let sessions = actions::list(&state, &caller, query.all).await?;
    let positions = state.queue_positions().await?;
    Ok(Json(
        sessions
            .into_iter()
            .map(|s| {
                let position = positions.get(&s.id).copied();
                session_view(s, position, Vec::new())
            })
            .collect(),
    ))
}

/// `GET /v1/sessions/{name}[?owner=DN][&wait_for=STATE,...[&timeout=SECONDS]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShowQuery {
    owner: Option<Dn>,
    /// Answer once the session is in one of these states (comma-separated, like
    /// `waiting,connected,idle,failed`), or when `timeout` passes, whichever comes first.
    wait_for: Option<String>,
    /// How long `wait_for` waits, in seconds (default and maximum: [`MAX_SESSION_WAIT`]).
    timeout: Option<u64>,
}

/// The longest a session long-poll waits.
pub const MAX_SESSION_WAIT: Duration = Duration::from_secs(60);

pub async fn show_session(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
    ApiQuery(query): ApiQuery<ShowQuery>,
) -> Result<Json<SessionView>, ApiError> {
    let wait_for = query.wait_for.as_deref().map(parse_states).transpose()?;
    let wait = poll_timeout(query.timeout, MAX_SESSION_WAIT);
    let target = SessionTarget {
        name,
        owner: query.owner,
    };
    let session = actions::show(&state, &caller, target, wait_for.as_deref(), wait).await?;
    let reads = Reads::new(&state);
    // A wait that ended at its deadline answers with the session as last notified: read again
    // for a change whose notice was still on its way. Without a wait it was just read.
    let view = match wait_for {
        Some(_) => full_session_view(&reads, session).await?,
        None => full_view_as_read(&reads, session).await?,
    };
    Ok(Json(view))
}

/// `waiting,connected,idle` → the states.
fn parse_states(list: &str) -> Result<Vec<SessionState>, ApiError> {
    list.split(',')
        .map(|name| {
            name.trim().parse::<SessionState>().map_err(|e| {
                ApiError::bad_request(format!(
                    "wait_for: {e}; give session states separated by commas, like \
                     waiting,connected,idle,failed"
                ))
            })
        })
        .collect()
}

/// The session `{name}[?owner=DN]` names.
fn target(name: String, query: OwnerQuery) -> SessionTarget {
    SessionTarget {
        name,
        owner: query.owner,
    }
}

/// Ends the session (state ENDED, GPUs free); its agent removes the container on its next sync.
pub async fn delete_session(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
    ApiQuery(query): ApiQuery<OwnerQuery>,
) -> Result<Json<SessionView>, ApiError> {
    let ended = actions::remove(&state, &caller, target(name, query), Via::Api)
        .await
        .map_err(refused)?;
    Ok(Json(changed_session_view(&state, ended).await?))
}

pub async fn hold(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
    ApiQuery(query): ApiQuery<OwnerQuery>,
    ApiJson(body): ApiJson<HoldRequest>,
) -> Result<Json<SessionView>, ApiError> {
    let held = actions::hold(
        &state,
        &caller,
        target(name, query),
        body.reason.as_deref(),
        Via::Api,
    )
    .await
    .map_err(refused)?;
    Ok(Json(full_session_view(&Reads::new(&state), held).await?))
}

pub async fn release(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
    ApiQuery(query): ApiQuery<OwnerQuery>,
) -> Result<Json<SessionView>, ApiError> {
    let released = actions::release(&state, &caller, target(name, query), Via::Api)
        .await
        .map_err(refused)?;
    Ok(Json(
        full_session_view(&Reads::new(&state), released).await?,
    ))
}

pub async fn keep(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
    ApiQuery(query): ApiQuery<OwnerQuery>,
    ApiJson(body): ApiJson<KeepRequest>,
) -> Result<Json<SessionView>, ApiError> {
    let kept = actions::keep(
        &state,
        &caller,
        target(name, query),
        body.duration_secs,
        Via::Api,
    )
    .await
    .map_err(refused)?;
    Ok(Json(
        full_session_view(&Reads::new(&state), kept.session).await?,
    ))
}
