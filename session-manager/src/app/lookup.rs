//! Finding the session a user route names: `{name}[?owner=DN]`, with the same 404 whether the
//! session does not exist or belongs to someone the caller may not see, so names do not leak;
//! and the frozen images a session's or job's image name may mean ([`frozen_image_candidates`]);
//! the images an image route names ([`find_images`]); and the reservation a new session or job
//! names ([`reservation_to_use`]).

use ongrid_core::{Dn, NodeName, SessionName, SessionState};
use serde::Deserialize;

use ongrid_core::image::ImageLookup;

use super::caller::CurrentUser;
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

/// `?all=true`: an admin listing everyone's sessions, jobs or keys.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    #[serde(default)]
    pub all: bool,
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

/// The stream endpoint of `node`'s agent (where SSH channels and web apps reach its
/// containers); `None` when the node is unknown or its agent has none.
pub async fn stream_url(state: &AppState, node: &NodeName) -> Result<Option<String>, ApiError> {
    Ok(state.store.node(node).await?.and_then(|n| n.stream_url))
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

/// `?reservation=NAME` on `POST /v1/sessions` and `POST /v1/jobs`, as older clients send it;
/// newer ones put `reservation` in the body.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReservationQuery {
    pub reservation: Option<String>,
}

/// The reservation a new session or job names, in its body or (older clients) in the query,
/// once the caller may use it now ([`crate::domain::policy::reservations::may_use`]: their
/// group's, in its window).
pub async fn reservation_to_use(
    state: &AppState,
    caller: &CurrentUser,
    body: Option<String>,
    query: ReservationQuery,
) -> Result<Option<crate::domain::policy::reservations::ReservationName>, ApiError> {
    use crate::domain::policy::reservations::{may_use, ReservationName};
    let name = match (body, query.reservation) {
        (Some(body), Some(query)) if body.trim() != query.trim() => {
            return Err(ApiError::bad_request(format!(
                "the body names reservation {body:?} and the query {query:?}: name one, in the \
                 body's reservation field"
            )))
        }
        (body, query) => body.or(query),
    };
    let Some(name) = name else {
        return Ok(None);
    };
    let name = ReservationName::parse(name.trim()).map_err(ApiError::bad_request)?;
    let policy =
        crate::scheduling::gpu_policy::GpuPolicy::load(state.store.as_ref(), state.clock.now())
            .await?;
    let found = policy.reservations.iter().find(|r| r.name == name);
    let reservation = may_use(
        found,
        name.as_str(),
        &caller.admitted.group,
        state.clock.now(),
    )?;
    Ok(Some(reservation.name.clone()))
}

/// What the caller wants with the images [`find_images`] finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// Show: another user's shared image may be seen too.
    Read,
    /// Remove, share or unshare: only one's own (an admin: anyone's).
    Change,
}

/// Resolves `{reference}[?owner=DN]` for the caller: one image by tag (`name:version` of the
/// owner, or `login/name:version`), or all the owner's (an admin without `owner`: everyone's)
/// by digest; to read, also other users' shared images. The same 404 whether nothing matches
/// or the images belong to someone the caller may not see.
pub async fn find_images(
    state: &AppState,
    caller: &CurrentUser,
    reference: &str,
    owner: Option<Dn>,
    purpose: Purpose,
) -> Result<Vec<ImageRecord>, ApiError> {
    let lookup = ImageLookup::parse(reference).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let explicit_owner = owner.is_some();
    let owner = owner.unwrap_or_else(|| caller.user.dn.clone());
    let not_found = || {
        if owner == caller.user.dn {
            let yours = match &lookup {
                ImageLookup::Owned { owner, .. } if *owner != caller.user.user_name => {
                    "there is no image"
                }
                _ => "you have no image",
            };
            ApiError::not_found(format!(
                "{yours} {lookup} you may see: list yours with `devctl image ls` and the shared \
                 ones with `devctl image ls --shared`"
            ))
        } else {
            ApiError::not_found(format!("{owner} has no image {lookup}"))
        }
    };
    if owner != caller.user.dn && !caller.admin {
        return Err(not_found());
    }
    let filter = match &lookup {
        ImageLookup::Reference(reference) => ImageFilter::Tag {
            owner: owner.clone(),
            reference: reference.clone(),
        },
        ImageLookup::Owned {
            owner: user_name,
            reference,
        } => ImageFilter::LoginTag {
            user_name: user_name.clone(),
            reference: reference.clone(),
        },
        ImageLookup::Digest(digest) => ImageFilter::Digest {
            // An admin looks a digest up site-wide unless an owner is named; anyone reading
            // looks among everyone's (and sees only the shared ones of others).
            owner: (!(caller.admin || purpose == Purpose::Read) || explicit_owner)
                .then(|| owner.clone()),
            digest: digest.clone(),
        },
    };
    let visible = |image: &ImageRecord| {
        image.owner == owner
            || (caller.admin && !explicit_owner)
            || (purpose == Purpose::Read && image.shared_at.is_some())
    };
    let images: Vec<ImageRecord> = state
        .store
        .images(filter)
        .await?
        .into_iter()
        .filter(visible)
        .collect();
    if images.is_empty() {
        return Err(not_found());
    }
    Ok(images)
}
