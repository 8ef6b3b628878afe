//! What a person does to a session, for `api/sessions.rs` and the dashboard's forms: create one,
//! hold, release, keep alive or remove one of theirs (an admin: anyone's, with `owner`). Each
//! looks the session up with [`find_session`] (a user reaches only their own sessions),
//! asks [`requests`] what the request may change, writes the change and ticks or wakes the
//! scheduler. What each caller words its own way is a [`SessionActionError`] variant.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ongrid_core::api::CreateSession;
use ongrid_core::gpu::GpuRequestError;
use ongrid_core::{Dn, HumanDuration, InvalidTransition, SessionId, SessionName, SessionState};

use super::caller::CurrentUser;
use super::{ApiError, AppState};
use super::{Effect, Via};
use crate::app::lookup::{
    find_session, frozen_image_candidates, reservation_to_use, Lookup, ReservationQuery,
};
use crate::domain::idempotency::{self, IdempotencyKey};
use crate::domain::image_access::{self, ImageChoice};
use crate::domain::sessions::{requests, Change, SessionRecord};
use crate::domain::Refusal;
use crate::site::SiteSnapshot;
use crate::store::{FactsScope, NewSession, SessionFilter, StoreError};

/// Which session an action names: the caller's own, or (admins) `owner`'s.
#[derive(Debug, Clone)]
pub struct SessionTarget {
    pub name: String,
    pub owner: Option<Dn>,
}

impl SessionTarget {
    /// Whether the target is someone else's session than the caller's.
    pub fn someone_elses(&self, caller: &CurrentUser) -> bool {
        self.owner
            .as_ref()
            .is_some_and(|owner| *owner != caller.user.dn)
    }
}

/// Why a session action did not happen, where the API and the dashboard give different advice.
#[derive(Debug)]
pub enum SessionActionError {
    /// The GPU request is malformed.
    InvalidGpus(GpuRequestError),
    /// No GPU of the site could ever satisfy the request (the scheduler's words).
    Unsatisfiable(String),
    /// The caller has a session of that name that has not ended.
    NameTaken {
        name: SessionName,
        state: SessionState,
    },
    /// The session's state changed between the look and the write, so the change no longer
    /// applies.
    ChangedMeanwhile {
        session: SessionName,
        cause: InvalidTransition,
    },
    /// Refused or failed alike for every caller: a lookup, a domain rule, the store.
    Api(ApiError),
}

impl From<ApiError> for SessionActionError {
    fn from(error: ApiError) -> Self {
        Self::Api(error)
    }
}

impl From<Refusal> for SessionActionError {
    fn from(refusal: Refusal) -> Self {
        Self::Api(refusal.into())
    }
}

impl From<StoreError> for SessionActionError {
    fn from(error: StoreError) -> Self {
        Self::Api(error.into())
    }
}

/// A session just requested, and the site it was checked against.
pub struct Created {
    /// As it is once scheduled: STARTING when a GPU was free, else PENDING (also when the round
    /// outlasted `placement_wait`).
    pub session: SessionRecord,
    pub site: Arc<SiteSnapshot>,
}

/// A new session: the GPU request checked, the image the caller may run, the lifecycle limits,
/// the site's `[limits]`, whether the site can ever satisfy it, the reservation it names; then
/// it is scheduled at once ([`AppState::schedule_now`]), so the answer says whether it got a GPU
/// (STARTING), unless the round outlasts `placement_wait`.
pub async fn create(
    state: &AppState,
    caller: &CurrentUser,
    body: CreateSession,
    reservation: ReservationQuery,
    key: Option<&IdempotencyKey>,
    via: Via,
) -> Result<Created, SessionActionError> {
    let started = std::time::Instant::now();
    // The same request again (its answer was lost): the session the first one made, before
    // any check that the first one's session would now change.
    let id = match key {
        Some(key) => SessionId(idempotency::derived_id("session", &caller.user.dn, key)),
        None => SessionId::new_random(),
    };
    if key.is_some() {
        if let Some(created) = created_before(state, id).await? {
            return Ok(created);
        }
    }
    body.gpus
        .validate()
        .map_err(SessionActionError::InvalidGpus)?;
    let image = session_image(state, caller, body.image.as_deref()).await?;
    let (idle_timeout_secs, max_duration_secs) = state
        .config
        .lifecycle
        .limits_for(body.idle_timeout_secs, body.max_duration_secs)
        .map_err(ApiError::bad_request)?;
    let site = state.inventory().await?;
    let limited = crate::domain::policy::limits::Request {
        id: (),
        owner: caller.user.dn.clone(),
        group: caller.admitted.group.clone(),
        kind: crate::domain::policy::limits::Kind::Session,
        gpus: body.gpus.count,
        length: Some(Duration::from_secs(max_duration_secs)),
    };
    if let Some(refusal) =
        crate::scheduling::limits::refusal(state.config.limits.as_ref(), &limited, &site)
    {
        return Err(ApiError::forbidden(refusal).into());
    }
    if let Some(why) = site.never_meets(&body.gpus) {
        return Err(SessionActionError::Unsatisfiable(why));
    }
    let reservation =
        reservation_to_use(state, caller, body.reservation.clone(), reservation).await?;
    if let Some(reservation) = &reservation {
        // Before the session exists, so no scheduling round sees it without its reservation.
        state
            .store
            .gpu_policy()
            .set_session_reservation(id, reservation)
            .await?;
    }
    let new = NewSession {
        id,
        name: body.name,
        owner: caller.user.dn.clone(),
        request: body.gpus,
        image,
        at: state.clock.now(),
        reason: format!("requested by {}", caller.user.user_name),
        idle_timeout_secs: Some(idle_timeout_secs),
        max_duration_secs: Some(max_duration_secs),
    };
    let checked = started.elapsed();
    let session = match state.store.create_session(new).await {
        Ok(session) => session,
        Err(error) => {
            // Its twin with the same key, sent at the same time, made it.
            if key.is_some() {
                if let Some(created) = created_before(state, id).await? {
                    return Ok(created);
                }
            }
            return Err(match error {
                StoreError::NameTaken { name, state } => {
                    SessionActionError::NameTaken { name, state }
                }
                other => other.into(),
            });
        }
    };
    tracing::info!(session_id = %session.id, session = %session.name, user = %session.user_name, via = via.as_str(), "Session requested.");
    // On no node yet: only people's lists show it until the round places it.
    state.committed(&[Effect::People]);
    let written = started.elapsed();
    // Schedule at once, so the answer says whether a GPU was free (STARTING) or the session
    // waits in the queue (PENDING with its position).
    state.schedule_now(session.id).await;
    let scheduled = started.elapsed();
    let session = state.store.session(session.id).await?.unwrap_or(session);
    tracing::debug!(
        checks_ms = checked.as_secs_f64() * 1e3,
        write_ms = (written - checked).as_secs_f64() * 1e3,
        wait_ms = (scheduled - written).as_secs_f64() * 1e3,
        read_ms = (started.elapsed() - scheduled).as_secs_f64() * 1e3,
        "Create's phases timed."
    );
    Ok(Created { session, site })
}

/// The session `id` if a request with the same idempotency key made it already.
async fn created_before(state: &AppState, id: SessionId) -> Result<Option<Created>, ApiError> {
    let Some(session) = state.store.session(id).await? else {
        return Ok(None);
    };
    tracing::info!(session_id = %session.id, session = %session.name, "Session requested again with the same idempotency key; answered with the one made.");
    Ok(Some(Created {
        session,
        site: state.inventory().await?,
    }))
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

/// The caller's sessions, or everyone's (admins only).
pub async fn list(
    state: &AppState,
    caller: &CurrentUser,
    everyones: bool,
) -> Result<Vec<SessionRecord>, ApiError> {
    let filter = match caller.listing_owner(everyones, "sessions")? {
        None => SessionFilter::All,
        Some(dn) => SessionFilter::Owner(dn.clone()),
    };
    Ok(state.store.sessions(filter).await?)
}

/// The session `target` names (the live one, else the last ended one); with `wait_for`, once
/// it is in one of those states or `wait` has passed: a long-poll. Every change is notified
/// ([`crate::notify::Changes`]), so the answer follows the change at once.
pub async fn show(
    state: &AppState,
    caller: &CurrentUser,
    target: SessionTarget,
    wait_for: Option<&[SessionState]>,
    wait: Duration,
) -> Result<SessionRecord, ApiError> {
    // Subscribed before the first read, so no change between the read and the wait is missed.
    let mut changes = state.changes.subscribe();
    let session = find_session(state, caller, &target.name, target.owner, Lookup::Any).await?;
    let Some(states) = wait_for else {
        return Ok(session);
    };
    let deadline = tokio::time::Instant::now() + wait;
    let id = session.id;
    // Any change may be this session's (it may move to another node): look again each time.
    changes
        .follow(
            deadline,
            session,
            |session| states.contains(&session.state),
            || async { Ok::<_, ApiError>(state.store.session(id).await?) },
        )
        .await
}

/// Holds the session by hand (HELD, its container stopped); `reason` is an admin's for holding
/// someone else's session, refused for one's own.
pub async fn hold(
    state: &AppState,
    caller: &CurrentUser,
    target: SessionTarget,
    reason: Option<&str>,
    via: Via,
) -> Result<SessionRecord, SessionActionError> {
    let session = find_session(state, caller, &target.name, target.owner, Lookup::NotEnded).await?;
    let by = &caller.user.user_name;
    let someone_elses = session.owner != caller.user.dn;
    let change = requests::hold(&session, by, someone_elses, reason, state.clock.now())?;
    let hold = change.hold;
    let held = transition(state, &session, change).await?;
    if let Some(reason) = hold {
        crate::metrics::events().held(reason);
    }
    tracing::info!(session_id = %held.id, session = %held.name, by = %by, reason = ?held.reason, via = via.as_str(), "Session held by hand.");
    state.committed(&with_its_node(Effect::Scheduling, &session));
    Ok(held)
}

/// Releases a HELD session back to the queue, then schedules it at once
/// ([`AppState::schedule_now`]) so the answer says whether its node had a GPU free (unless the
/// round outlasts `placement_wait`); returns the session as it is then.
pub async fn release(
    state: &AppState,
    caller: &CurrentUser,
    target: SessionTarget,
    via: Via,
) -> Result<SessionRecord, SessionActionError> {
    let session = find_session(state, caller, &target.name, target.owner, Lookup::NotEnded).await?;
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
    let released = transition(state, &session, change).await?;
    tracing::info!(session_id = %released.id, session = %released.name, by = %by, node = ?released.node, via = via.as_str(), "Session released.");
    state.committed(&[its_node(&session)]);
    state.schedule_now(released.id).await;
    Ok(state.store.session(released.id).await?.unwrap_or(released))
}

/// A session kept alive, and until when.
pub struct Kept {
    pub session: SessionRecord,
    pub until: DateTime<Utc>,
}

/// Keeps the session alive for `duration_secs` from now (no idle hold before then).
pub async fn keep(
    state: &AppState,
    caller: &CurrentUser,
    target: SessionTarget,
    duration_secs: u64,
    via: Via,
) -> Result<Kept, SessionActionError> {
    let asked: Duration = requests::keep_duration(duration_secs)?;
    let session = find_session(state, caller, &target.name, target.owner, Lookup::NotEnded).await?;
    let until = requests::keep(&session, asked, &state.config.lifecycle, state.clock.now())?;
    state.store.set_keep_until(session.id, until).await?;
    tracing::info!(session_id = %session.id, session = %session.name, by = %caller.user.user_name,
        asked = %HumanDuration(asked), until = %until, via = via.as_str(), "Session kept alive.");
    state.committed(&[Effect::People]);
    Ok(Kept { session, until })
}

/// Ends the session (state ENDED, GPUs free); its agent removes the container on its next sync.
pub async fn remove(
    state: &AppState,
    caller: &CurrentUser,
    target: SessionTarget,
    via: Via,
) -> Result<SessionRecord, SessionActionError> {
    let session = find_session(state, caller, &target.name, target.owner, Lookup::NotEnded).await?;
    let change = requests::remove(&caller.user.user_name, state.clock.now());
    let ended = state.store.transition(session.id, change).await?;
    tracing::info!(session_id = %ended.id, session = %ended.name, by = %caller.user.user_name, via = via.as_str(), "Session removed.");
    state.committed(&with_its_node(Effect::Scheduling, &session));
    Ok(ended)
}

/// `effect` and [`its_node`].
fn with_its_node(effect: Effect, session: &SessionRecord) -> Vec<Effect> {
    vec![effect, its_node(session)]
}

/// The session's node, whose desired state a change of the session changes (and whose change
/// wakes people too); a session on no node is in no node's desired state: only people are told.
fn its_node(session: &SessionRecord) -> Effect {
    session.node.clone().map_or(Effect::People, Effect::Node)
}

/// Writes a change decided on `session` as it was looked at; one its state no longer allows
/// means it changed between the look and the write.
async fn transition(
    state: &AppState,
    session: &SessionRecord,
    change: Change,
) -> Result<SessionRecord, SessionActionError> {
    state
        .store
        .transition(session.id, change)
        .await
        .map_err(|error| match error {
            StoreError::InvalidTransition(cause) => SessionActionError::ChangedMeanwhile {
                session: session.name.clone(),
                cause,
            },
            other => other.into(),
        })
}
