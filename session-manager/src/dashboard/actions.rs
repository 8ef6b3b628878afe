//! What the dashboard's forms do. The actions the API offers too are written once in
//! [`crate::app`] (create, hold, release, keep and remove a session, freeze one, add and
//! remove an institute), so the caller is the same [`CurrentUser`], the session is found the
//! same way (a user reaches only their own sessions, an admin anyone's with `owner`) and refused
//! with the same rules; here the forms' text is parsed and the refusals are worded for the page.
//! Each returns the sentence the next page shows.

use ongrid_core::api::CreateSession;
use ongrid_core::image::{Compression, CreateImage, ImageReference};
use ongrid_core::network::Cidr;
use ongrid_core::{GpuRequest, HumanDuration, InstituteName, SessionName};

use crate::app::caller::CurrentUser;
use crate::app::images::{self as image_actions, FreezeError};
use crate::app::institutes::{self, InstituteError};
use crate::app::jobs::{self as job_actions, JobActionError};
use crate::app::lookup::ReservationQuery;
use crate::app::nodes::{self as node_actions, DrainChange, NodeError};
use crate::app::sessions::{self as session_actions, Created, SessionActionError};
use crate::app::Via;
use crate::app::{ApiError, AppState};

/// Which session a form names: the caller's own, or (admins) `owner`'s.
pub use crate::app::sessions::SessionTarget as Target;

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
        session_actions::create(state, caller, body, reservation, None, Via::Dashboard)
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
    let job = job_actions::cancel(state, caller, id, Via::Dashboard)
        .await
        .map_err(job_refused)?;
    Ok(format!("Job {} cancelled.", job.id))
}

/// A job action's refusal, as the page says it.
fn job_refused(error: JobActionError) -> ApiError {
    match error {
        JobActionError::NotFound(id) => ApiError::not_found(format!("you have no job {id}")),
        JobActionError::ChangedMeanwhile { cause, .. } => {
            ApiError::conflict(format!("{cause}: it changed meanwhile"))
        }
        JobActionError::Api(error) => error,
    }
}

/// Removes one of the caller's ended jobs (admins: anyone's), with its output.
pub async fn remove_job(
    state: &AppState,
    caller: &CurrentUser,
    id: &str,
) -> Result<String, ApiError> {
    let job = job_actions::remove(state, caller, id, Via::Dashboard)
        .await
        .map_err(job_refused)?;
    Ok(format!("Job {} removed, with its output.", job.id))
}

/// Adds an institute: a name and networks separated by spaces or commas (admins only).
pub async fn add_institute(
    state: &AppState,
    caller: &CurrentUser,
    name: &str,
    networks: &str,
) -> Result<String, ApiError> {
    // Before the form is read, so a non-admin learns nothing from it.
    caller.require_admin(crate::app::institutes::MANAGE)?;
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
    let name = node_actions::drain_node(state, caller, name, drain_change(reason), Via::Dashboard)
        .await
        .map_err(node_refused)?;
    Ok(if reason.is_some() {
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
    let gpu = node_actions::drain_gpu(state, caller, uuid, drain_change(reason), Via::Dashboard)
        .await
        .map_err(node_refused)?;
    let uuid = &gpu.info.uuid;
    Ok(if reason.is_some() {
        format!("GPU {uuid} drained.")
    } else {
        format!("GPU {uuid} is back in service.")
    })
}

fn drain_change(reason: Option<&str>) -> DrainChange<'_> {
    reason.map_or(DrainChange::Undrain, |reason| DrainChange::Drain {
        reason: Some(reason),
    })
}

/// A drain's refusal as the dashboard words it.
fn node_refused(error: NodeError) -> ApiError {
    match error {
        NodeError::NoSuchNode(name) => ApiError::not_found(format!("no node {name} is registered")),
        NodeError::NoSuchGpu(uuid) => ApiError::not_found(format!("no GPU {uuid} is registered")),
        NodeError::Api(error) => error,
    }
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
