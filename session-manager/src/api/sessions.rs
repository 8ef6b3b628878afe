//! Routes for people's sessions: create, list, show and remove them; hold, release and keep
//! one alive (`devctl session new | ls | show | rm | hold | release | keep`).
//!
//! A user sees and changes only their own sessions; an admin may address anyone's with
//! `?owner=DN` and list everyone's with `?all=true`. A non-admin asking for someone else's
//! session gets the same 404 as for a session that does not exist, so names do not leak.
//! Session listings leave out ENDED sessions and carry no transitions; `GET
//! /v1/sessions/{name}` shows the history. What each request may change is decided by
//! [`crate::domain::sessions::requests`]; the automatic holds are the hold timer's.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use ongrid_core::api::{CreateSession, SessionView};
use ongrid_core::holds::{HoldRequest, KeepRequest};
use ongrid_core::{Dn, HumanDuration, SessionId, SessionState};
use serde::Deserialize;
use std::time::Duration;

use super::callers::CurrentUser;
use super::lookup::{find_session, frozen_image_candidates, Lookup, OwnerQuery};
use super::views::{full_session_view, session_view};
use super::{ApiError, ApiJson, ApiPath, ApiQuery, AppState};
use crate::domain::image_access::{self, ImageChoice};
use crate::domain::sessions::requests;
use crate::store::{FactsScope, NewSession, SessionFilter, StoreError};

pub async fn create_session(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiQuery(query): ApiQuery<super::lookup::ReservationQuery>,
    ApiJson(body): ApiJson<CreateSession>,
) -> Result<(StatusCode, Json<SessionView>), ApiError> {
    body.gpus
        .validate()
        .map_err(|e| ApiError::bad_request(format!("gpus.count: {e}")))?;
    let image = session_image(&state, &caller, body.image.as_deref()).await?;
    let (idle_timeout_secs, max_duration_secs) = state
        .config
        .lifecycle
        .limits_for(body.idle_timeout_secs, body.max_duration_secs)
        .map_err(ApiError::bad_request)?;
    let site = state.site().await?;
    let limited = crate::domain::policy::limits::Request {
        id: (),
        owner: caller.user.dn.clone(),
        group: caller.admitted.group.clone(),
        kind: crate::domain::policy::limits::Kind::Session,
        gpus: body.gpus.count,
        length: Some(std::time::Duration::from_secs(max_duration_secs)),
    };
    if let Some(refusal) =
        crate::limit_check::refusal(state.config.limits.as_ref(), &limited, &site)
    {
        return Err(ApiError::forbidden(refusal));
    }
    if body.gpus.sharing.mig().is_some() {
        ongrid_scheduler::check_mig_satisfiable(
            &site.satisfiability_state(),
            &site.mig_slots(),
            &body.gpus,
        )
        .map_err(|no| ApiError::unsatisfiable(format!("{no}; see `devctl gpus`")))?;
    } else {
        ongrid_scheduler::check_satisfiable(&site.satisfiability_state(), &body.gpus).map_err(
            |unsatisfiable| ApiError::unsatisfiable(format!("{unsatisfiable}; see `devctl gpus`")),
        )?;
    }
    let reservation = super::lookup::reservation_to_use(&state, &caller, query).await?;
    let id = SessionId::new_random();
    if let (Some(reservation), Some(store)) = (&reservation, state.store.gpu_policy()) {
        // Before the session exists, so no scheduling round sees it without its reservation.
        store.set_session_reservation(id, reservation).await?;
    }
    let new = NewSession {
        id,
        name: body.name,
        owner: caller.user.dn.clone(),
        request: body.gpus,
        image,
        at: state.clock.now(),
        reason: format!("requested by {}", caller.user.user_name),
    };
    let session = match state.store.create_session(new).await {
        Ok(session) => session,
        Err(StoreError::NameTaken { name, state }) => {
            return Err(ApiError::conflict(format!(
                "you already have a session named {name} ({state}): pick another --name or \
                 `devctl session rm {name}`"
            )))
        }
        Err(other) => return Err(other.into()),
    };
    tracing::info!(session_id = %session.id, session = %session.name, user = %session.user_name, "Session requested.");
    state
        .store
        .set_lifecycle_limits(session.id, Some(idle_timeout_secs), Some(max_duration_secs))
        .await?;
    // Schedule at once, so the answer says whether a GPU was free (STARTING) or the session
    // waits in the queue (PENDING with its position).
    state.schedule_now(session.id).await;
    let session = state.store.session(session.id).await?.unwrap_or(session);
    let positions = state.queue_positions().await?;
    let transitions = state.store.transitions(session.id).await?;
    let position = positions.get(&session.id).copied();
    let mut view = session_view(session, position, transitions);
    if view.state == SessionState::Pending {
        if let Some(why) = super::views::out_of_service(&site, &view.request) {
            view.reason = format!("{}; {why}", view.reason);
        }
    }
    Ok((StatusCode::CREATED, Json(view)))
}

/// The Docker image the new session runs: a site image, or a frozen image the caller may run
/// (their own, or a shared one), looked up by its tag or digest ([`image_access`] decides).
async fn session_image(
    state: &AppState,
    caller: &CurrentUser,
    requested: Option<&str>,
) -> Result<String, ApiError> {
    let site = state.config.site_images();
    let dn = &caller.user.dn;
    let resolved = match image_access::choose_image(requested, &site) {
        Ok(ImageChoice::Site(image)) => Ok(image),
        Ok(ImageChoice::Frozen(lookup)) => {
            let candidates = frozen_image_candidates(state, dn, &lookup).await?;
            image_access::resolve_frozen(&lookup, &candidates, dn, &site)
        }
        Err(refusal) => Err(refusal),
    };
    // Logged, with the caller, as every 403 is (`error::log_refusals`).
    resolved.map_err(ApiError::from)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    #[serde(default)]
    all: bool,
}

pub async fn list_sessions(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiQuery(query): ApiQuery<ListQuery>,
) -> Result<Json<Vec<SessionView>>, ApiError> {
    let filter = if query.all {
        if !caller.admin {
            return Err(ApiError::forbidden(
                "only admins can list everyone's sessions (?all=true); leave it out to list yours",
            ));
        }
        SessionFilter::All
    } else {
        SessionFilter::Owner(caller.user.dn.clone())
    };
    let sessions = state.store.sessions(filter).await?;
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
    let wait_for = match &query.wait_for {
        Some(list) => Some(parse_states(list)?),
        None => None,
    };
    // Subscribed before the first read, so no change between the read and the wait is missed.
    let mut changes = state.changes.subscribe();
    let mut session = find_session(&state, &caller, &name, query.owner, Lookup::Any).await?;
    if let Some(states) = wait_for {
        let wait = query
            .timeout
            .map_or(MAX_SESSION_WAIT, Duration::from_secs)
            .min(MAX_SESSION_WAIT);
        let deadline = tokio::time::Instant::now() + wait;
        // Any change may be this session's (it may move to another node): look again each time.
        while !states.contains(&session.state)
            && matches!(
                tokio::time::timeout_at(deadline, changes.changed(None)).await,
                Ok(true)
            )
        {
            match state.store.session(session.id).await? {
                Some(now) => session = now,
                None => break,
            }
        }
    }
    Ok(Json(full_session_view(&state, session).await?))
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

/// Ends the session (state ENDED, GPUs free); its agent removes the container on its next sync.
pub async fn delete_session(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
    ApiQuery(query): ApiQuery<OwnerQuery>,
) -> Result<Json<SessionView>, ApiError> {
    let session = find_session(&state, &caller, &name, query.owner, Lookup::NotEnded).await?;
    let change = requests::remove(&caller.user.user_name, state.clock.now());
    let ended = state.store.transition(session.id, change).await?;
    tracing::info!(session_id = %ended.id, session = %ended.name, by = %caller.user.user_name, "Session removed.");
    state.wake.notify_one();
    let transitions = state.store.transitions(ended.id).await?;
    Ok(Json(session_view(ended, None, transitions)))
}

/// A change the session's state no longer allows: it changed between the look and the write.
fn changed_meanwhile(error: StoreError, name: &str) -> ApiError {
    match error {
        StoreError::InvalidTransition(e) => ApiError::conflict(format!(
            "session {name} changed meanwhile ({e}): look at it with `devctl session show {name}`"
        )),
        other => other.into(),
    }
}

pub async fn hold(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
    ApiQuery(query): ApiQuery<OwnerQuery>,
    ApiJson(body): ApiJson<HoldRequest>,
) -> Result<Json<SessionView>, ApiError> {
    let session = find_session(&state, &caller, &name, query.owner, Lookup::NotEnded).await?;
    let by = &caller.user.user_name;
    let someone_elses = session.owner != caller.user.dn;
    let change = requests::hold(
        &session,
        by,
        someone_elses,
        body.reason.as_deref(),
        state.clock.now(),
    )?;
    let reason = change.hold;
    let held = state
        .store
        .transition(session.id, change)
        .await
        .map_err(|e| changed_meanwhile(e, &name))?;
    if let Some(reason) = reason {
        crate::metrics::events().held(reason);
    }
    tracing::info!(session_id = %held.id, session = %held.name, by = %by, reason = %held.reason, "Session held by hand.");
    state.wake.notify_one();
    Ok(Json(full_session_view(&state, held).await?))
}

pub async fn release(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
    ApiQuery(query): ApiQuery<OwnerQuery>,
) -> Result<Json<SessionView>, ApiError> {
    let session = find_session(&state, &caller, &name, query.owner, Lookup::NotEnded).await?;
    let facts = state
        .store
        .lifecycle_facts(FactsScope::Session(session.id))
        .await?;
    let by = &caller.user.user_name;
    let change = requests::release(
        &session,
        facts.first(),
        &state.config.lifecycle,
        by,
        state.clock.now(),
    )?;
    let released = state
        .store
        .transition(session.id, change)
        .await
        .map_err(|e| changed_meanwhile(e, &name))?;
    tracing::info!(session_id = %released.id, session = %released.name, by = %by, node = ?released.node, "Session released.");
    // Schedule at once, so that the answer says whether its node had a GPU free.
    state.schedule_now(released.id).await;
    Ok(Json(full_session_view(&state, released).await?))
}

pub async fn keep(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
    ApiQuery(query): ApiQuery<OwnerQuery>,
    ApiJson(body): ApiJson<KeepRequest>,
) -> Result<Json<SessionView>, ApiError> {
    let asked = requests::keep_duration(body.duration_secs)?;
    let session = find_session(&state, &caller, &name, query.owner, Lookup::NotEnded).await?;
    let until = requests::keep(&session, asked, &state.config.lifecycle, state.clock.now())?;
    state.store.set_keep_until(session.id, until).await?;
    tracing::info!(session_id = %session.id, session = %session.name, by = %caller.user.user_name,
        asked = %HumanDuration(asked), until = %until, "Session kept alive.");
    Ok(Json(full_session_view(&state, session).await?))
}
