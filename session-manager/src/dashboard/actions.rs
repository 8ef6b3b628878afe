//! What the dashboard's forms do. The actions the API offers too are written once in
//! [`crate::api::actions`] (create, hold, release, keep and remove a session, freeze one, add and
//! remove an institute), so the caller is the same [`CurrentUser`], the session is found the
//! same way (a user reaches only their own sessions, an admin anyone's with `owner`) and refused
//! with the same rules; here the forms' text is parsed and the refusals are worded for the page.
//! The others go through the same domain rules and store calls as the API's routes (`jobs`,
//! `nodes`), which it never calls. Each returns the sentence the next page shows.

use ongrid_core::api::CreateSession;
use ongrid_core::image::{Compression, CreateImage, ImageReference};
use ongrid_core::job::JobId;
use ongrid_core::network::Cidr;
use ongrid_core::{GpuRequest, GpuUuid, HumanDuration, InstituteName, NodeName, SessionName};

use crate::api::actions::images::{self as image_actions, FreezeError};
use crate::api::actions::institutes::{self, InstituteError};
use crate::api::actions::sessions::{self as session_actions, Created, SessionActionError};
use crate::api::actions::Via;
use crate::api::callers::CurrentUser;
use crate::api::lookup::ReservationQuery;
use crate::api::{ApiError, AppState};
use crate::domain::{jobs, nodes};
use crate::store::StoreError;

/// Which session a form names: the caller's own, or (admins) `owner`'s.
pub use crate::api::actions::sessions::SessionTarget as Target;

/// A session action's refusal as the dashboard words it, pointing at the page.
fn refused(error: SessionActionError) -> ApiError {
    match error {
        SessionActionError::InvalidGpus(e) => ApiError::bad_request(format!("GPUs: {e}")),
        SessionActionError::Unsatisfiable(why) => ApiError::unsatisfiable(why),
        SessionActionError::NameTaken { name, state } => ApiError::conflict(format!(
            "you already have a session named {name} ({state}): pick another name or remove it"
        )),
        SessionActionError::ChangedMeanwhile { session, cause } => ApiError::conflict(format!(
            "session {session} changed meanwhile ({cause}): look at it again"
        )),
        SessionActionError::Api(error) => error,
    }
}

/// A new session, as `POST /v1/sessions` makes it (without a reservation); the page shows
/// whether a GPU was free.
pub async fn create_session(
    state: &AppState,
    caller: &CurrentUser,
    body: CreateSession,
) -> Result<String, ApiError> {
    let reservation = ReservationQuery::default();
    let Created { session, .. } =
        session_actions::create(state, caller, body, reservation, Via::Dashboard)
            .await
            .map_err(refused)?;
    Ok(format!(
        "Session {} requested: {} ({}).",
        session.name, session.state, session.reason
    ))
}

pub async fn hold(
    state: &AppState,
    caller: &CurrentUser,
    target: Target,
    reason: Option<&str>,
) -> Result<String, ApiError> {
    // The form shows admins a reason on every row: it counts for someone else's session only.
    let someone_elses = target.someone_elses(caller);
    let reason = reason.filter(|r| someone_elses && !r.trim().is_empty());
    let held = session_actions::hold(state, caller, target, reason, Via::Dashboard)
        .await
        .map_err(refused)?;
    Ok(format!(
        "Session {} is {}: {}.",
        held.name, held.state, held.reason
    ))
}

pub async fn release(
    state: &AppState,
    caller: &CurrentUser,
    target: Target,
) -> Result<String, ApiError> {
    let now = session_actions::release(state, caller, target, Via::Dashboard)
        .await
        .map_err(refused)?;
    Ok(format!(
        "Session {} released: {} ({}).",
        now.name, now.state, now.reason
    ))
}

pub async fn keep(
    state: &AppState,
    caller: &CurrentUser,
    target: Target,
    duration: &str,
) -> Result<String, ApiError> {
    let asked = HumanDuration::parse(duration.trim())
        .map_err(|e| {
            ApiError::bad_request(format!(
                "keep for {duration:?}: {e}; write it like 4h or 2 days"
            ))
        })?
        .as_duration();
    let kept = session_actions::keep(state, caller, target, asked.as_secs(), Via::Dashboard)
        .await
        .map_err(refused)?;
    Ok(format!(
        "Session {} is kept alive until {}.",
        kept.session.name,
        crate::domain::utc(kept.until)
    ))
}

pub async fn remove(
    state: &AppState,
    caller: &CurrentUser,
    target: Target,
) -> Result<String, ApiError> {
    let ended = session_actions::remove(state, caller, target, Via::Dashboard)
        .await
        .map_err(refused)?;
    Ok(format!("Session {} removed.", ended.name))
}

/// A freeze of one of the caller's sessions, as `POST /v1/images` records it (BUILDING).
pub async fn freeze(
    state: &AppState,
    caller: &CurrentUser,
    session: &str,
    tag: &str,
    force: bool,
) -> Result<String, ApiError> {
    let name =
        SessionName::parse(session.trim()).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let reference = ImageReference::parse_new(tag.trim()).map_err(|e| {
        ApiError::bad_request(format!("tag {tag:?}: {e}; write it like mymodel:v1"))
    })?;
    let order = CreateImage {
        session: name,
        reference,
        force,
        compression: Compression::default(),
    };
    let image = image_actions::freeze(state, caller, order, Via::Dashboard)
        .await
        .map_err(|error| match error {
            FreezeError::NoSession(name) => {
                ApiError::not_found(format!("you have no session named {name}"))
            }
            FreezeError::Building(reference) => ApiError::conflict(format!(
                "image {reference} is being built: wait for it, or pick another tag"
            )),
            FreezeError::TagTaken { reference, state } => ApiError::conflict(format!(
                "you already have image {reference} ({state}): pick another version, or tick \
                 \"move the tag\" (the old image stays reachable by its digest)"
            )),
            FreezeError::Running { session, reference } => ApiError::conflict(format!(
                "session {session} is being frozen to {reference} already: wait for it"
            )),
            FreezeError::Api(error) => error,
        })?;
    Ok(format!(
        "Freezing session {} to {}: progress shows below.",
        image.session_name, image.reference
    ))
}

/// Cancels one of the caller's jobs (admins: anyone's).
pub async fn cancel_job(
    state: &AppState,
    caller: &CurrentUser,
    id: &str,
) -> Result<String, ApiError> {
    let not_found = || ApiError::not_found(format!("you have no job {id}"));
    let id: JobId = id.parse().map_err(|_| not_found())?;
    let job = state.store.job(id).await?.ok_or_else(not_found)?;
    if job.owner != caller.user.dn && !caller.admin {
        return Err(not_found());
    }
    let change = jobs::cancel_by_owner(&job, state.clock.now())?;
    let job = state
        .store
        .job_transition(job.id, change, None)
        .await
        .map_err(|e| match e {
            StoreError::InvalidJobTransition(e) => {
                ApiError::conflict(format!("{e}: it changed meanwhile"))
            }
            other => other.into(),
        })?;
    tracing::info!(job_id = %job.id, by = %caller.user.user_name, "Job cancelled (dashboard).");
    state.wake.notify_one();
    Ok(format!("Job {} cancelled.", job.id))
}

/// Adds an institute: a name and networks separated by spaces or commas (admins only).
pub async fn add_institute(
    state: &AppState,
    caller: &CurrentUser,
    name: &str,
    networks: &str,
) -> Result<String, ApiError> {
    // Before the form is read, so a non-admin learns nothing from it.
    caller.require_admin(crate::api::actions::institutes::MANAGE)?;
    let name =
        InstituteName::parse(name.trim()).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let cidrs = networks
        .split([',', ' ', '\n'])
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|text| {
            text.parse::<Cidr>()
                .map_err(|e| ApiError::bad_request(format!("network {text:?}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let institute = institutes::add(state, caller, name, &cidrs, Via::Dashboard)
        .await
        .map_err(institute_refused)?;
    let networks: Vec<String> = institute.cidrs.iter().map(ToString::to_string).collect();
    Ok(format!(
        "Institute {} added: {}.",
        institute.name,
        networks.join(", ")
    ))
}

pub async fn remove_institute(
    state: &AppState,
    caller: &CurrentUser,
    name: &str,
) -> Result<String, ApiError> {
    let removed = institutes::remove(state, caller, name, Via::Dashboard)
        .await
        .map_err(institute_refused)?;
    Ok(format!("Institute {} removed.", removed.name))
}

/// An institute action's refusal as the dashboard words it.
fn institute_refused(error: InstituteError) -> ApiError {
    match error {
        InstituteError::NeverMatches { cidr, error } => {
            ApiError::bad_request(format!("network {cidr}: {error}"))
        }
        InstituteError::Exists(name) => ApiError::conflict(format!(
            "institute {name} already exists: to change its networks, remove it and add it again"
        )),
        InstituteError::NotFound(name) => ApiError::not_found(format!("no institute named {name}")),
        InstituteError::Api(error) => error,
    }
}

/// Drains a node (`reason` set) or puts it back in service (`None`); admins only.
pub async fn drain_node(
    state: &AppState,
    caller: &CurrentUser,
    name: &str,
    reason: Option<&str>,
) -> Result<String, ApiError> {
    caller.require_admin("drain nodes")?;
    let name = NodeName::parse(name).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let drain = reason
        .map(|reason| nodes::drain(Some(reason), &caller.user.user_name, state.clock.now()))
        .transpose()?;
    let drained = drain.is_some();
    if !state.store.set_node_drain(&name, drain).await? {
        return Err(ApiError::not_found(format!("no node {name} is registered")));
    }
    tracing::info!(node = %name, drained, by = %caller.user.user_name, "Node drain changed (dashboard).");
    state.wake.notify_one();
    Ok(if drained {
        format!("Node {name} drained: nothing new is placed there.")
    } else {
        format!("Node {name} is back in service.")
    })
}

/// Drains a GPU (`reason` set) or puts it back in service (`None`); admins only.
pub async fn drain_gpu(
    state: &AppState,
    caller: &CurrentUser,
    uuid: &str,
    reason: Option<&str>,
) -> Result<String, ApiError> {
    caller.require_admin("drain GPUs")?;
    let uuid = GpuUuid::parse(uuid).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let drain = reason
        .map(|reason| nodes::drain(Some(reason), &caller.user.user_name, state.clock.now()))
        .transpose()?;
    let drained = drain.is_some();
    state
        .store
        .set_gpu_drain(&uuid, drain)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no GPU {uuid} is registered")))?;
    tracing::info!(gpu = %uuid, drained, by = %caller.user.user_name, "GPU drain changed (dashboard).");
    state.wake.notify_one();
    Ok(if drained {
        format!("GPU {uuid} drained.")
    } else {
        format!("GPU {uuid} is back in service.")
    })
}

/// The GPU request of the new-session form: a count, optionally a minimum memory.
pub fn gpu_request(count: u32, min_memory: &str) -> Result<GpuRequest, ApiError> {
    let mut request = GpuRequest {
        count,
        ..GpuRequest::default()
    };
    let min_memory = min_memory.trim();
    if !min_memory.is_empty() {
        request.min_memory = Some(min_memory.parse().map_err(|e| {
            ApiError::bad_request(format!(
                "minimum GPU memory {min_memory:?}: {e}; like 40GiB"
            ))
        })?);
    }
    Ok(request)
}
