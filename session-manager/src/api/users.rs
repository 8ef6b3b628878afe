//! Routes for people: who am I, sessions, nodes and GPUs.
//!
//! A user sees and changes only their own sessions; an admin may address anyone's with
//! `?owner=DN` and list everyone's with `?all=true`. A non-admin asking for someone else's
//! session gets the same 404 as for a session that does not exist, so names do not leak.
//! Session listings leave out ENDED sessions and carry no transitions; `GET
//! /v1/sessions/{name}` shows the history.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use ongrid_core::api::{CreateSession, GpuView, NodeView, SessionView, SetGpuMode, WhoAmI};
use ongrid_core::{Dn, GpuMode, GpuUuid, SessionId, SessionName, SessionState};
use serde::Deserialize;

use super::{session_view, ApiError, ApiJson, ApiPath, ApiQuery, AppState};
use crate::auth::CurrentUser;
use crate::config::check_image;
use crate::site::SiteSnapshot;
use crate::store::{
    Change, GpuRecord, NewSession, NodeRecord, Placement, SessionFilter, SessionRecord, StoreError,
};

pub async fn whoami(caller: CurrentUser) -> Json<WhoAmI> {
    Json(WhoAmI {
        dn: caller.user.dn,
        user_name: caller.user.user_name,
        uid: caller.user.uid,
        admin: caller.admin,
        credential: Some(caller.identity.kind),
        vos: caller.identity.vos,
        fqans: caller
            .identity
            .fqans
            .iter()
            .map(ToString::to_string)
            .collect(),
        not_after: Some(caller.not_after),
    })
}

pub async fn create_session(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiJson(body): ApiJson<CreateSession>,
) -> Result<(StatusCode, Json<SessionView>), ApiError> {
    body.gpus
        .validate()
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let image = match body.image {
        Some(image) => {
            let image = image.trim().to_owned();
            check_image(&image).map_err(ApiError::bad_request)?;
            image
        }
        None => state.config.default_image.clone(),
    };
    let (idle_timeout_secs, max_duration_secs) = state
        .config
        .lifecycle
        .limits_for(body.idle_timeout_secs, body.max_duration_secs)
        .map_err(ApiError::bad_request)?;
    let site = state.site().await?;
    ongrid_scheduler::check_satisfiable(&site.satisfiability_state(), &body.gpus).map_err(
        |unsatisfiable| ApiError::unsatisfiable(format!("{unsatisfiable}; see `devctl gpus`")),
    )?;
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
    // waits in the queue (PENDING with its position). A failed round is retried by the loop.
    if let Err(error) = state.scheduler.tick(state.clock.now()).await {
        tracing::error!(%error, "Scheduling a new session failed; the loop retries.");
    }
    let session = state.store.session(session.id).await?.unwrap_or(session);
    let positions = state.queue_positions().await?;
    let transitions = state.store.transitions(session.id).await?;
    let position = positions.get(&session.id).copied();
    Ok((
        StatusCode::CREATED,
        Json(session_view(session, position, transitions)),
    ))
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OwnerQuery {
    pub(super) owner: Option<Dn>,
}

pub async fn show_session(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
    ApiQuery(query): ApiQuery<OwnerQuery>,
) -> Result<Json<SessionView>, ApiError> {
    let session = find_session(&state, &caller, &name, query.owner, Lookup::Any).await?;
    let positions = state.queue_positions().await?;
    let transitions = state.store.transitions(session.id).await?;
    let position = positions.get(&session.id).copied();
    let lifecycle = super::lifecycle::view_of(&state, &session).await?;
    let mut view = session_view(session, position, transitions);
    view.lifecycle = lifecycle;
    Ok(Json(view))
}

/// Ends the session (state ENDED, GPUs free); its agent removes the container on its next sync.
pub async fn delete_session(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
    ApiQuery(query): ApiQuery<OwnerQuery>,
) -> Result<Json<SessionView>, ApiError> {
    let session = find_session(&state, &caller, &name, query.owner, Lookup::NotEnded).await?;
    let change = Change {
        to: SessionState::Ended,
        at: state.clock.now(),
        reason: format!("removed by {}", caller.user.user_name),
        placement: Placement::Keep,
    };
    let ended = state.store.transition(session.id, change).await?;
    tracing::info!(session_id = %ended.id, session = %ended.name, by = %caller.user.user_name, "Session removed.");
    state.wake.notify_one();
    let transitions = state.store.transitions(ended.id).await?;
    Ok(Json(session_view(ended, None, transitions)))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lookup {
    /// The live one, else the last ended one (to show what happened).
    Any,
    /// Only one that has not ended (to remove it).
    NotEnded,
}

/// Resolves `{name}[?owner=DN]` for the caller, with the same 404 whether the session does not
/// exist or belongs to someone the caller may not see.
pub(super) async fn find_session(
    state: &AppState,
    caller: &CurrentUser,
    name: &str,
    owner: Option<Dn>,
    lookup: Lookup,
) -> Result<SessionRecord, ApiError> {
    let name = SessionName::parse(name).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let owner = owner.unwrap_or_else(|| caller.user.dn.clone());
    let not_found = || {
        if owner == caller.user.dn {
            ApiError::not_found(format!(
                "you have no session named {name}: list yours with `devctl session ls`"
            ))
        } else {
            ApiError::not_found(format!("{owner} has no session named {name}"))
        }
    };
    if owner != caller.user.dn && !caller.admin {
        return Err(not_found());
    }
    let session = state
        .store
        .session_by_name(&owner, &name)
        .await?
        .ok_or_else(not_found)?;
    if lookup == Lookup::NotEnded && session.state == SessionState::Ended {
        return Err(not_found());
    }
    Ok(session)
}

pub async fn list_nodes(
    State(state): State<AppState>,
    caller: CurrentUser,
) -> Result<Json<Vec<NodeView>>, ApiError> {
    let site = state.site().await?;
    let views = site
        .nodes
        .iter()
        .map(|node| NodeView {
            name: node.name.clone(),
            online: site.is_online(node),
            last_seen: node.last_seen,
            gpu_backend: node.gpu_backend.clone(),
            gpus: node
                .gpus
                .iter()
                .map(|gpu| gpu_view(&site, &caller, node, gpu))
                .collect(),
        })
        .collect();
    Ok(Json(views))
}

/// A GPU as `caller` may see it: sessions of others are counted but not named (admins see all).
fn gpu_view(
    site: &SiteSnapshot,
    caller: &CurrentUser,
    node: &NodeRecord,
    gpu: &GpuRecord,
) -> GpuView {
    GpuView {
        info: gpu.info.clone(),
        node: node.name.clone(),
        mode: gpu.mode,
        used: site.used(&gpu.info.uuid),
        free: site.free(node, gpu),
        sessions: site
            .sessions_on(&gpu.info.uuid)
            .filter(|s| caller.admin || s.owner == caller.user.dn)
            .map(|s| s.name.clone())
            .collect(),
    }
}

pub async fn set_gpu_mode(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(uuid): ApiPath<String>,
    ApiJson(body): ApiJson<SetGpuMode>,
) -> Result<Json<GpuView>, ApiError> {
    if !caller.admin {
        return Err(ApiError::forbidden(
            "only admins can change a GPU's mode; admins are listed in the manager's config",
        ));
    }
    let uuid = GpuUuid::parse(&uuid).map_err(|e| ApiError::bad_request(e.to_string()))?;
    // The core's parser holds the rules (shared:N with N from 2 to 64).
    let mode: GpuMode = body
        .mode
        .to_string()
        .parse()
        .map_err(|e: ongrid_core::gpu::GpuModeError| ApiError::bad_request(e.to_string()))?;
    state
        .store
        .set_gpu_mode(&uuid, mode)
        .await?
        .ok_or_else(|| {
            ApiError::not_found(format!("no GPU {uuid} is registered: see `devctl gpus`"))
        })?;
    tracing::info!(gpu = %uuid, %mode, by = %caller.user.user_name, "GPU mode changed.");
    state.wake.notify_one();
    let site = state.site().await?;
    site.nodes
        .iter()
        .find_map(|node| {
            let gpu = node.gpus.iter().find(|g| g.info.uuid == uuid)?;
            Some(Json(gpu_view(&site, &caller, node, gpu)))
        })
        .ok_or_else(|| ApiError::internal(format!("GPU {uuid} vanished after its mode was set")))
}
