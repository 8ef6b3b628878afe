//! What the dashboard's forms do, through the same domain rules and store calls as the API's
//! routes (`crate::api::sessions`, `images`, `jobs`, `admin`, `nodes`), which it never calls:
//! the caller is the same [`CurrentUser`], looked up with the same [`find_session`] (a user
//! reaches only their own sessions, an admin anyone's with `owner`), refused with the same
//! [`Refusal`]s. Each returns the sentence the next page shows.

use std::collections::BTreeSet;

use ongrid_core::api::CreateSession;
use ongrid_core::image::{Compression, ImageReference, ImageState};
use ongrid_core::job::JobId;
use ongrid_core::network::Cidr;
use ongrid_core::{
    Dn, GpuRequest, GpuUuid, HumanDuration, Institute, InstituteName, NodeName, SessionId,
    SessionName, SessionState,
};

use crate::api::callers::CurrentUser;
use crate::api::lookup::{find_session, frozen_image_candidates, Lookup};
use crate::api::{ApiError, AppState};
use crate::domain::image_access::{self, ImageChoice};
use crate::domain::images::freezing_node;
use crate::domain::sessions::requests;
use crate::domain::{jobs, nodes};
use crate::store::{FactsScope, NewImage, NewSession, StoreError};

/// A change the session's state no longer allows: it changed between the look and the write.
fn changed_meanwhile(error: StoreError, name: &SessionName) -> ApiError {
    match error {
        StoreError::InvalidTransition(e) => ApiError::conflict(format!(
            "session {name} changed meanwhile ({e}): look at it again"
        )),
        other => other.into(),
    }
}

/// A new session, as `POST /v1/sessions` makes it: the GPU count checked, the image the caller
/// may run, the lifecycle limits, the site's `[limits]`, whether the site can ever satisfy it; then one
/// scheduling round so the page shows whether a GPU was free.
pub async fn create_session(
    state: &AppState,
    caller: &CurrentUser,
    body: CreateSession,
) -> Result<String, ApiError> {
    body.gpus
        .validate()
        .map_err(|e| ApiError::bad_request(format!("GPUs: {e}")))?;
    let site_images = state.config.site_images();
    let image = match image_access::choose_image(body.image.as_deref(), &site_images)? {
        ImageChoice::Site(image) => image,
        ImageChoice::Frozen(lookup) => {
            let candidates = frozen_image_candidates(state, &caller.user.dn, &lookup).await?;
            image_access::resolve_frozen(&lookup, &candidates, &caller.user.dn, &site_images)?
        }
    };
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
        .map_err(|no| ApiError::unsatisfiable(no.to_string()))?;
    } else {
        ongrid_scheduler::check_satisfiable(&site.satisfiability_state(), &body.gpus)
            .map_err(|no| ApiError::unsatisfiable(no.to_string()))?;
    }
    let new = NewSession {
        id: SessionId::new_random(),
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
                "you already have a session named {name} ({state}): pick another name or \
                 remove it"
            )))
        }
        Err(other) => return Err(other.into()),
    };
    tracing::info!(session_id = %session.id, session = %session.name, user = %session.user_name, "Session requested (dashboard).");
    state
        .store
        .set_lifecycle_limits(session.id, Some(idle_timeout_secs), Some(max_duration_secs))
        .await?;
    state.schedule_now(session.id).await;
    let session = state.store.session(session.id).await?.unwrap_or(session);
    Ok(format!(
        "Session {} requested: {} ({}).",
        session.name, session.state, session.reason
    ))
}

/// Which session a form names: the caller's own, or (admins) `owner`'s.
pub struct Target {
    pub name: String,
    pub owner: Option<Dn>,
}

pub async fn hold(
    state: &AppState,
    caller: &CurrentUser,
    target: Target,
    reason: Option<&str>,
) -> Result<String, ApiError> {
    let session = find_session(state, caller, &target.name, target.owner, Lookup::NotEnded).await?;
    let by = &caller.user.user_name;
    let someone_elses = session.owner != caller.user.dn;
    let reason = reason.filter(|r| someone_elses && !r.trim().is_empty());
    let change = requests::hold(&session, by, someone_elses, reason, state.clock.now())?;
    let hold = change.hold;
    let held = state
        .store
        .transition(session.id, change)
        .await
        .map_err(|e| changed_meanwhile(e, &session.name))?;
    if let Some(reason) = hold {
        crate::metrics::events().held(reason);
    }
    tracing::info!(session_id = %held.id, session = %held.name, by = %by, reason = %held.reason, "Session held by hand (dashboard).");
    state.wake.notify_one();
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
    let released = state
        .store
        .transition(session.id, change)
        .await
        .map_err(|e| changed_meanwhile(e, &session.name))?;
    tracing::info!(session_id = %released.id, session = %released.name, by = %by, "Session released (dashboard).");
    state.schedule_now(released.id).await;
    let now = state.store.session(released.id).await?.unwrap_or(released);
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
    let asked = requests::keep_duration(asked.as_secs())?;
    let session = find_session(state, caller, &target.name, target.owner, Lookup::NotEnded).await?;
    let until = requests::keep(&session, asked, &state.config.lifecycle, state.clock.now())?;
    state.store.set_keep_until(session.id, until).await?;
    tracing::info!(session_id = %session.id, session = %session.name, by = %caller.user.user_name,
        asked = %HumanDuration(asked), %until, "Session kept alive (dashboard).");
    Ok(format!(
        "Session {} is kept alive until {}.",
        session.name,
        crate::domain::utc(until)
    ))
}

pub async fn remove(
    state: &AppState,
    caller: &CurrentUser,
    target: Target,
) -> Result<String, ApiError> {
    let session = find_session(state, caller, &target.name, target.owner, Lookup::NotEnded).await?;
    let change = requests::remove(&caller.user.user_name, state.clock.now());
    let ended = state.store.transition(session.id, change).await?;
    tracing::info!(session_id = %ended.id, session = %ended.name, by = %caller.user.user_name, "Session removed (dashboard).");
    state.wake.notify_one();
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
    let session = state
        .store
        .session_by_name(&caller.user.dn, &name)
        .await?
        .filter(|s| s.state != SessionState::Ended)
        .ok_or_else(|| ApiError::not_found(format!("you have no session named {name}")))?;
    let node = freezing_node(&session)?;
    let new = NewImage {
        id: uuid::Uuid::new_v4(),
        owner: caller.user.dn.clone(),
        reference: reference.clone(),
        session_id: session.id,
        session_name: session.name.clone(),
        node: node.clone(),
        base_image: session.image.clone(),
        compression: Compression::default(),
        force,
        at: state.clock.now(),
        reason: format!("freezing session {} on {node}", session.name),
    };
    let image = match state.store.create_image(new).await {
        Ok(image) => image,
        Err(StoreError::ImageTagTaken {
            reference,
            state: ImageState::Building,
        }) => {
            return Err(ApiError::conflict(format!(
                "image {reference} is being built: wait for it, or pick another tag"
            )))
        }
        Err(StoreError::ImageTagTaken { reference, state }) => {
            return Err(ApiError::conflict(format!(
                "you already have image {reference} ({state}): pick another version, or tick \
                 \"move the tag\" (the old image stays reachable by its digest)"
            )))
        }
        Err(StoreError::FreezeRunning { session, reference }) => {
            return Err(ApiError::conflict(format!(
                "session {session} is being frozen to {reference} already: wait for it"
            )))
        }
        Err(other) => return Err(other.into()),
    };
    tracing::info!(image_id = %image.id, reference = %image.reference, session = %image.session_name, %node, user = %image.user_name, "Freeze requested (dashboard).");
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
    caller.require_admin("manage institutes")?;
    let name =
        InstituteName::parse(name.trim()).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let mut seen = BTreeSet::new();
    let mut cidrs = Vec::new();
    for text in networks
        .split([',', ' ', '\n'])
        .map(str::trim)
        .filter(|t| !t.is_empty())
    {
        let cidr: Cidr = text
            .parse()
            .map_err(|e| ApiError::bad_request(format!("network {text:?}: {e}")))?;
        cidr.check_matchable()
            .map_err(|e| ApiError::bad_request(format!("network {text}: {e}")))?;
        if seen.insert(cidr) {
            cidrs.push(cidr);
        }
    }
    if cidrs.is_empty() {
        return Err(ApiError::bad_request(format!(
            "institute {name} needs at least one network, like 192.0.2.0/24 or 2001:db8::/32"
        )));
    }
    let institute = Institute { name, cidrs };
    match state
        .store
        .add_institute(&institute, state.clock.now())
        .await
    {
        Ok(()) => {}
        Err(StoreError::InstituteExists(name)) => {
            return Err(ApiError::conflict(format!(
                "institute {name} already exists: to change its networks, remove it and add it \
                 again"
            )))
        }
        Err(other) => return Err(other.into()),
    }
    let networks: Vec<String> = institute.cidrs.iter().map(ToString::to_string).collect();
    tracing::info!(institute = %institute.name, networks = %networks.join(" "), by = %caller.user.user_name, "Institute added (dashboard).");
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
    caller.require_admin("manage institutes")?;
    let name = InstituteName::parse(name).map_err(|e| ApiError::bad_request(e.to_string()))?;
    state
        .store
        .remove_institute(&name)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no institute named {name}")))?;
    tracing::info!(institute = %name, by = %caller.user.user_name, "Institute removed (dashboard).");
    Ok(format!("Institute {name} removed."))
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
