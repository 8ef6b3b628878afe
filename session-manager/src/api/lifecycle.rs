//! Routes that change a session's lifecycle by hand: hold it (its owner, or an admin with a
//! reason), release a HELD one (back to the queue, pinned to the node where its container is),
//! and keep one alive for a while (`devctl session keep NAME --for 4h`, capped by `keep_max`).
//!
//! The automatic holds are in [`crate::lifecycle`]; [`view_of`] adds its deadlines and signals
//! to a session's view.

use std::time::Duration;

use axum::extract::State;
use axum::Json;
use ongrid_core::api::SessionView;
use ongrid_core::lifecycle::{HoldRequest, KeepRequest, LifecycleView, SessionDeadlines};
use ongrid_core::{HumanDuration, SessionState};

use super::users::{find_session, Lookup, OwnerQuery};
use super::{session_view, ApiError, ApiJson, ApiPath, ApiQuery, AppState};
use crate::auth::CurrentUser;
use crate::lifecycle::{deadlines, keep_until, utc, view};
use crate::store::{Change, FactsScope, Placement, SessionRecord, StoreError};

/// The longest reason an admin may give.
const MAX_REASON: usize = 500;

/// The lifecycle part of a session's view: for live and HELD sessions.
pub async fn view_of(
    state: &AppState,
    session: &SessionRecord,
) -> Result<Option<LifecycleView>, ApiError> {
    if !(session.state.is_live() || session.state == SessionState::Held) {
        return Ok(None);
    }
    let facts = state
        .store
        .lifecycle_facts(FactsScope::Session(session.id))
        .await?;
    Ok(facts
        .first()
        .map(|facts| view(facts, &state.config.lifecycle, state.clock.now())))
}

/// The full view of a session as it is now: queue position, history and lifecycle.
async fn full_view(state: &AppState, session: SessionRecord) -> Result<SessionView, ApiError> {
    let session = state.store.session(session.id).await?.unwrap_or(session);
    let position = state.queue_positions().await?.get(&session.id).copied();
    let transitions = state.store.transitions(session.id).await?;
    let lifecycle = view_of(state, &session).await?;
    let mut view = session_view(session, position, transitions);
    view.lifecycle = lifecycle;
    Ok(view)
}

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
    let reason = body
        .reason
        .map(|r| r.trim().to_owned())
        .filter(|r| !r.is_empty());
    let text = match (someone_elses, reason) {
        (false, None) => format!("owner: held by {by}"),
        (false, Some(_)) => {
            return Err(ApiError::bad_request(
                "a reason is for admins holding someone else's session: leave out --reason",
            ))
        }
        (true, None) => {
            return Err(ApiError::bad_request(format!(
                "say why you hold {}'s session, it is shown to them: --reason \"...\"",
                session.user_name
            )))
        }
        (true, Some(reason)) => {
            if reason.len() > MAX_REASON || reason.chars().any(char::is_control) {
                return Err(ApiError::bad_request(format!(
                    "the reason must be one line of at most {MAX_REASON} characters"
                )));
            }
            format!("admin: {reason} (held by {by})")
        }
    };
    match session.state {
        SessionState::Held => {
            return Err(ApiError::conflict(format!(
                "session {} is already HELD ({}): release it with `devctl session release {}`",
                session.name, session.reason, session.name
            )))
        }
        state if !state.is_live() => {
            return Err(ApiError::conflict(format!(
                "session {} is {state}: only a live session can be held",
                session.name
            )))
        }
        _ => {}
    }
    let change = Change {
        to: SessionState::Held,
        at: state.clock.now(),
        reason: text,
        placement: Placement::Keep,
    };
    let held = state
        .store
        .transition(session.id, change)
        .await
        .map_err(|e| changed_meanwhile(e, &name))?;
    tracing::info!(session_id = %held.id, session = %held.name, by = %by, reason = %held.reason, "Session held by hand.");
    state.wake.notify_one();
    Ok(Json(full_view(&state, held).await?))
}

pub async fn release(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
    ApiQuery(query): ApiQuery<OwnerQuery>,
) -> Result<Json<SessionView>, ApiError> {
    let session = find_session(&state, &caller, &name, query.owner, Lookup::NotEnded).await?;
    if session.state != SessionState::Held {
        return Err(ApiError::conflict(format!(
            "session {} is {}, not HELD: only a held session can be released",
            session.name, session.state
        )));
    }
    let now = state.clock.now();
    let facts = state
        .store
        .lifecycle_facts(FactsScope::Session(session.id))
        .await?;
    if let Some(end) = facts
        .first()
        .and_then(|f| f.max_end_at(&state.config.lifecycle))
        .filter(|&end| end <= now)
    {
        return Err(ApiError::conflict(format!(
            "session {} reached its maximum lifetime at {}, so it cannot run again: start a new \
             one with `devctl session new` (your home directory is kept)",
            session.name,
            utc(end)
        )));
    }
    let by = &caller.user.user_name;
    let reason = match &session.node {
        Some(node) => {
            format!("released by {by}; waits for a GPU on {node}, where its container is")
        }
        None => format!("released by {by}"),
    };
    let change = Change {
        to: SessionState::Pending,
        at: now,
        reason,
        placement: Placement::Keep,
    };
    let released = state
        .store
        .transition(session.id, change)
        .await
        .map_err(|e| changed_meanwhile(e, &name))?;
    tracing::info!(session_id = %released.id, session = %released.name, by = %by, node = ?released.node, "Session released.");
    // Schedule at once, so that the answer says whether its node had a GPU free.
    if let Err(error) = state.scheduler.tick(state.clock.now()).await {
        tracing::error!(%error, "Scheduling a released session failed; the loop retries.");
    }
    Ok(Json(full_view(&state, released).await?))
}

pub async fn keep(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
    ApiQuery(query): ApiQuery<OwnerQuery>,
    ApiJson(body): ApiJson<KeepRequest>,
) -> Result<Json<SessionView>, ApiError> {
    if body.duration_secs == 0 {
        return Err(ApiError::bad_request(
            "--for must be longer than 0 seconds, like --for 4h",
        ));
    }
    let session = find_session(&state, &caller, &name, query.owner, Lookup::NotEnded).await?;
    if !session.state.is_live() {
        let fix = if session.state == SessionState::Held {
            format!(
                ": release it first with `devctl session release {}`",
                session.name
            )
        } else {
            String::new()
        };
        return Err(ApiError::conflict(format!(
            "session {} is {}, so there is nothing to keep alive{fix}",
            session.name, session.state
        )));
    }
    let now = state.clock.now();
    let asked = Duration::from_secs(body.duration_secs);
    let until = keep_until(&state.config.lifecycle, asked, now);
    state.store.set_keep_until(session.id, until).await?;
    tracing::info!(session_id = %session.id, session = %session.name, by = %caller.user.user_name,
        asked = %HumanDuration(asked), until = %until, "Session kept alive.");
    Ok(Json(full_view(&state, session).await?))
}

/// Whether an agent's report of an exited container without a problem is the held container of
/// a released session that the agent has not started again yet (its report comes before it
/// converges): not a death to turn into FAILED.
pub async fn held_container_not_started_yet(
    state: &AppState,
    session: &SessionRecord,
    container: &ongrid_core::api::ObservedContainer,
) -> Result<bool, ApiError> {
    if session.state != SessionState::Starting
        || container.error.is_some()
        || !matches!(
            container.state,
            ongrid_core::api::ContainerState::Exited { .. }
        )
    {
        return Ok(false);
    }
    let facts = state
        .store
        .lifecycle_facts(FactsScope::Session(session.id))
        .await?;
    Ok(facts.first().is_some_and(|f| f.first_started_at.is_some()))
}

/// The session's deadlines now, for the gateway's banner and warnings.
pub async fn deadlines_of(
    state: &AppState,
    session: &SessionRecord,
) -> Result<Json<SessionDeadlines>, ApiError> {
    let facts = state
        .store
        .lifecycle_facts(FactsScope::Session(session.id))
        .await?;
    let facts = facts
        .first()
        .ok_or_else(|| ApiError::not_found(format!("no session with id {}", session.id)))?;
    Ok(Json(deadlines(
        facts,
        &state.config.lifecycle,
        state.clock.now(),
    )))
}
