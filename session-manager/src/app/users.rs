//! The users admins manage (`devctl admin user ls | rm | restore`): listing them with what
//! admins did to them, removing one, and re-admitting one.
//!
//! Removing keeps the history ([`crate::domain::users`] decides, and says why): the user's row
//! stays, marked removed, so the audit log and their ENDED sessions still name them; their keys
//! are deleted at once (the gateway's key check closes their open SSH connections); their
//! sessions are ENDED (agents remove the containers), queued jobs cancelled, and images removed
//! as `devctl image rm` does (agents untag the Docker images). While a session has not ended or a
//! job runs the removal is refused unless `force`. The user is marked removed first and what
//! they have is listed after that, so nothing they start meanwhile is left behind (the store
//! refuses new keys, sessions and images of a removed user). A removed user is refused with 403
//! until restored.

use std::collections::BTreeMap;

use ongrid_core::api::{UserEvent, UserRemoved, UserView};
use ongrid_core::Dn;

use super::caller::{Admin, CurrentUser};
use super::{ApiError, AppState, Effect};
use crate::domain::users;
use crate::image_files::remove_sif;
use crate::store::{ImageFilter, JobFilter, SessionFilter, StoreError, UserRecord};

/// Every user the manager knows, with what admins did to each.
pub async fn list(state: &AppState, _admin: Admin) -> Result<Vec<UserView>, ApiError> {
    let mut events: BTreeMap<Dn, Vec<UserEvent>> = BTreeMap::new();
    for (dn, event) in state.store.user_events(None).await? {
        events.entry(dn).or_default().push(event);
    }
    let users = state.store.users().await?;
    Ok(users
        .into_iter()
        .map(|user| {
            let events = events.remove(&user.dn).unwrap_or_default();
            user_view(user, events)
        })
        .collect())
}

/// Removes the user of `dn` (the path's text): their keys at once, their sessions, queued jobs
/// and images; refused while they have live work unless `force`.
pub async fn remove(
    state: &AppState,
    caller: &CurrentUser,
    _admin: Admin,
    dn: &str,
    force: bool,
) -> Result<UserRemoved, ApiError> {
    let target = find_user(state, dn).await?;
    let dn = target.dn.clone();
    let sessions = state
        .store
        .sessions(SessionFilter::Owner(dn.clone()))
        .await?;
    let jobs = state.store.jobs(JobFilter::Owner(dn.clone())).await?;
    users::check_removal(
        &dn,
        target.removed.as_ref(),
        &caller.user.dn,
        &sessions,
        &jobs,
        force,
    )?;
    let now = state.clock.now();
    let by = &caller.user.user_name;
    let images = state.store.images(ImageFilter::Owner(dn.clone())).await?;
    let planned = users::removal(by, &sessions, &jobs, &images, now);
    let keys = state
        .store
        .remove_user(&dn, &caller.user.dn, now, &planned)
        .await?
        .ok_or_else(|| {
            ApiError::conflict(format!(
                "{dn} was removed meanwhile: see `devctl admin user ls`"
            ))
        })?;
    // Listed again now that nothing new can be stored for them.
    let sessions = state
        .store
        .sessions(SessionFilter::Owner(dn.clone()))
        .await?;
    let jobs = state.store.jobs(JobFilter::Owner(dn.clone())).await?;
    let images = state.store.images(ImageFilter::Owner(dn.clone())).await?;
    let removal = users::removal(by, &sessions, &jobs, &images, now);
    let mut answer = UserRemoved {
        user: UserView {
            dn: dn.clone(),
            user_name: target.user_name.clone(),
            uid: target.uid,
            removed_at: None,
            removed_by: None,
            events: Vec::new(),
        },
        keys: keys.into_iter().map(|k| k.fingerprint).collect(),
        sessions: Vec::new(),
        jobs: Vec::new(),
        images: Vec::new(),
    };
    // Jobs first, so that no GPU a session frees meanwhile goes to one of their jobs.
    for (id, change) in removal.jobs {
        match state.store.job_transition(id, change, None).await {
            Ok(job) => answer.jobs.push(job.id),
            // Ended meanwhile.
            Err(StoreError::InvalidJobTransition(_)) => {}
            Err(other) => return Err(other.into()),
        }
    }
    for (id, change) in removal.sessions {
        match state.store.transition(id, change).await {
            Ok(ended) => answer.sessions.push(ended.name),
            // Ended by someone else meanwhile.
            Err(StoreError::InvalidTransition(_)) => {}
            Err(other) => return Err(other.into()),
        }
    }
    for id in removal.images {
        let Some(deleted) = state.store.delete_image(id, now).await? else {
            continue;
        };
        if deleted.digest_unreferenced {
            if let (Some(store), Some(digest)) = (&state.config.image_store, &deleted.image.digest)
            {
                remove_sif(store, digest);
            }
        }
        answer.images.push(deleted.image.reference.to_string());
    }
    // Their sessions' and jobs' nodes stop the containers; their images' names go to every
    // node's `removed_images`.
    state.committed(&[Effect::Scheduling, Effect::Nodes]);
    tracing::info!(dn = %dn, user = %target.user_name, by = %caller.user.user_name,
        keys = answer.keys.len(), sessions = answer.sessions.len(), jobs = answer.jobs.len(),
        images = answer.images.len(), force, "User removed.");
    answer.user = current_view(state, &dn).await?;
    Ok(answer)
}

/// Re-admits the removed user of `dn` (the path's text).
pub async fn restore(
    state: &AppState,
    caller: &CurrentUser,
    _admin: Admin,
    dn: &str,
) -> Result<UserView, ApiError> {
    let target = find_user(state, dn).await?;
    let dn = target.dn;
    users::check_restore(&dn, target.removed.as_ref())?;
    state
        .store
        .restore_user(&dn, &caller.user.dn, state.clock.now())
        .await?
        .ok_or_else(|| {
            ApiError::conflict(format!(
                "{dn} was restored meanwhile: see `devctl admin user ls`"
            ))
        })?;
    tracing::info!(dn = %dn, user = %target.user_name, by = %caller.user.user_name, "User restored.");
    state.committed(&[Effect::People]);
    current_view(state, &dn).await
}

/// The user of the path's DN, or 400 (not a DN) or 404 (never seen).
async fn find_user(state: &AppState, dn: &str) -> Result<UserRecord, ApiError> {
    let dn = Dn::parse(dn).map_err(|e| {
        ApiError::bad_request(format!(
            "{e}: give the user's certificate subject DN, like '/DC=org/DC=example/CN=Alice', \
             as `devctl admin user ls` shows it"
        ))
    })?;
    state.store.existing_user(&dn).await?.ok_or_else(|| {
        ApiError::not_found(format!(
            "no user {dn}: the manager knows only users who connected once; see `devctl admin \
             user ls`"
        ))
    })
}

/// The user as stored now, with their events.
async fn current_view(state: &AppState, dn: &Dn) -> Result<UserView, ApiError> {
    let user = state
        .store
        .existing_user(dn)
        .await?
        .ok_or_else(|| ApiError::internal(format!("user {dn} vanished")))?;
    let events = state
        .store
        .user_events(Some(dn))
        .await?
        .into_iter()
        .map(|(_, event)| event)
        .collect();
    Ok(user_view(user, events))
}

fn user_view(user: UserRecord, events: Vec<UserEvent>) -> UserView {
    let (removed_at, removed_by) = match user.removed {
        Some(removed) => (Some(removed.at), Some(removed.by)),
        None => (None, None),
    };
    UserView {
        dn: user.dn,
        user_name: user.user_name,
        uid: user.uid,
        removed_at,
        removed_by,
        events,
    }
}
