//! Finding the session a user route names: `{name}[?owner=DN]`, with the same 404 whether the
//! session does not exist or belongs to someone the caller may not see, so names do not leak;
//! and the frozen images a session's or job's image name may mean ([`frozen_image_candidates`]).

use ongrid_core::{Dn, SessionName, SessionState};
use serde::Deserialize;

use ongrid_core::image::ImageLookup;

use super::callers::CurrentUser;
use super::{ApiError, AppState};
use crate::domain::images::ImageRecord;
use crate::domain::sessions::SessionRecord;
use crate::store::ImageFilter;

/// `?owner=DN`: an admin addressing someone else's session.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OwnerQuery {
    pub owner: Option<Dn>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// The live one, else the last ended one (to show what happened).
    Any,
    /// Only one that has not ended (to change it).
    NotEnded,
}

/// Resolves `{name}[?owner=DN]` for the caller.
pub async fn find_session(
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

/// The images `lookup` may mean for a session or job of `caller`: their own current image of a
/// `name:version`, the current image of a `login/name:version`, or everyone's images of a
/// digest. Which of them the caller may run is the domain's decision
/// ([`crate::domain::image_access`]).
pub async fn frozen_image_candidates(
    state: &AppState,
    caller: &Dn,
    lookup: &ImageLookup,
) -> Result<Vec<ImageRecord>, ApiError> {
    let filter = match lookup {
        ImageLookup::Reference(reference) => ImageFilter::Tag {
            owner: caller.clone(),
            reference: reference.clone(),
        },
        ImageLookup::Owned { owner, reference } => ImageFilter::LoginTag {
            user_name: owner.clone(),
            reference: reference.clone(),
        },
        ImageLookup::Digest(digest) => ImageFilter::Digest {
            owner: None,
            digest: digest.clone(),
        },
    };
    Ok(state.store.images(filter).await?)
}
