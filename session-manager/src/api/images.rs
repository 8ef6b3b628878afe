//! Routes for frozen images: `POST /v1/images` (freeze a session), `GET /v1/images`,
//! `GET /v1/images/{reference}` and `DELETE /v1/images/{reference}`, where `{reference}` is
//! `name:version` (the owner's current image of that tag) or `sha256:<hex>` (any of the owner's
//! images with that digest, also one whose tag `--force` moved on).
//! `GET /v1/images/{reference}?after=DONE/TOTAL` is the long-poll `devctl freeze` follows a
//! freeze with: answered as soon as the image's state or progress differs from what it has.
//!
//! The manager only records the freeze (BUILDING, [`crate::app::images`], shared with the
//! dashboard's freeze form); the agent of the session's node gets it as an
//! order in its desired state, does the work and reports progress, then READY or FAILED, in its
//! syncs (see [`super::agent`] and [`crate::domain::images`]). Like sessions, a user
//! sees and removes only their own images (others' answer the same 404 as missing ones);
//! admins see all (`?all=true`) and address anyone's with `?owner=DN`.
//!
//! `POST /v1/images/{reference}/share` and `/unshare`: the owner makes an image runnable by every
//! user, or private again ([`crate::domain::image_access::share`]). `GET /v1/images?shared=true`
//! lists every shared image; anyone may show one by `login/name:version` (the `/` sent as `%2F`)
//! or by digest. Unsharing stops new sessions and jobs; those already started or queued keep
//! the image they were given.
//!
//! Removing an image marks it DELETED; its SIF file is deleted from `image_store` when no other
//! image has the same digest (`crate::image_files`); its Docker image's name goes to every node's
//! `DesiredState.removed_images`, which the agents untag.

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use ongrid_core::image::{CreateImage, ImageProgress, ImageView};
use ongrid_core::Dn;
use serde::Deserialize;

use super::callers::CurrentUser;
use super::{poll_timeout, ApiError, ApiJson, ApiPath, ApiQuery, AppState};
use crate::app::images::{self as actions, FreezeError};
use crate::app::lookup::OwnerQuery;
use crate::app::views::image_view;
use crate::app::Via;

pub async fn create_image(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiJson(body): ApiJson<CreateImage>,
) -> Result<(StatusCode, Json<ImageView>), ApiError> {
    let image = actions::freeze(&state, &caller, body, Via::Api)
        .await
        .map_err(|error| match error {
            FreezeError::NoSession(name) => ApiError::not_found(format!(
                "you have no session named {name}: list yours with `devctl session ls`"
            )),
            FreezeError::Building(reference) => ApiError::conflict(format!(
                "image {reference} is being built: wait for it (`devctl image show {reference}`) \
                 or remove it with `devctl image rm {reference}`"
            )),
            FreezeError::TagTaken { reference, state } => ApiError::conflict(format!(
                "you already have image {reference} ({state}): pick another version, or add \
                 --force to move the tag (the old image stays reachable by its digest)"
            )),
            FreezeError::Running { session, reference } => ApiError::conflict(format!(
                "session {session} is being frozen to {reference} already: wait for it \
                 (`devctl image show {reference}`)"
            )),
            FreezeError::Api(error) => error,
        })?;
    Ok((StatusCode::CREATED, Json(image_view(image))))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    #[serde(default)]
    all: bool,
    /// Every user's shared images.
    #[serde(default)]
    shared: bool,
}

pub async fn list_images(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiQuery(query): ApiQuery<ListQuery>,
) -> Result<Json<Vec<ImageView>>, ApiError> {
    let which = if query.shared {
        actions::Listed::Shared
    } else if query.all {
        actions::Listed::Everyones
    } else {
        actions::Listed::Own
    };
    let images = actions::list(&state, &caller, which).await?;
    Ok(Json(images.into_iter().map(image_view).collect()))
}

/// `GET /v1/images/{reference}[?owner=DN][&after=DONE/TOTAL[&timeout=SECONDS]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShowQuery {
    owner: Option<Dn>,
    /// The progress the caller has shown of a BUILDING image, `bytes_done/bytes_total` (`0/0`
    /// before any): answer once the image is no longer BUILDING or its progress differs, or
    /// when `timeout` passes, whichever comes first.
    after: Option<String>,
    /// How long `after` waits, in seconds (default and maximum: [`MAX_IMAGE_WAIT`]).
    timeout: Option<u64>,
}

/// The longest an image long-poll waits.
pub const MAX_IMAGE_WAIT: Duration = Duration::from_secs(60);

/// Shows the image; with `after`, a long-poll on its freeze: the agents' syncs store the
/// progress they report and then notify ([`crate::notify::Changes`]), so the answer follows
/// each report at once. An unchanged image is answered as it is when the timeout passes.
pub async fn show_image(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(reference): ApiPath<String>,
    ApiQuery(query): ApiQuery<ShowQuery>,
) -> Result<Json<ImageView>, ApiError> {
    let seen = query.after.as_deref().map(parse_progress).transpose()?;
    let wait = poll_timeout(query.timeout, MAX_IMAGE_WAIT);
    let image = actions::show(&state, &caller, &reference, query.owner, seen, wait).await?;
    Ok(Json(image_view(image)))
}

/// `1048576/4194304` → the progress a caller has seen.
fn parse_progress(text: &str) -> Result<ImageProgress, ApiError> {
    let parsed = text.split_once('/').and_then(|(done, total)| {
        Some(ImageProgress {
            bytes_done: done.trim().parse().ok()?,
            bytes_total: total.trim().parse().ok()?,
        })
    });
    parsed.ok_or_else(|| {
        ApiError::bad_request(format!(
            "after={text:?}: give the progress you have as BYTES_DONE/BYTES_TOTAL, like \
             1048576/4194304 (0/0 before any)"
        ))
    })
}

/// Marks the image DELETED (by digest: every one of the owner's images with that content) and
/// deletes the SIF file when nothing references its digest any more ([`actions::delete`]).
pub async fn delete_image(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(reference): ApiPath<String>,
    ApiQuery(query): ApiQuery<OwnerQuery>,
) -> Result<Json<ImageView>, ApiError> {
    let image = actions::delete(&state, &caller, &reference, query.owner).await?;
    Ok(Json(image_view(image)))
}

pub async fn share_image(
    state: State<AppState>,
    caller: CurrentUser,
    reference: ApiPath<String>,
    query: ApiQuery<OwnerQuery>,
) -> Result<Json<ImageView>, ApiError> {
    set_shared(state, caller, reference, query, true).await
}

pub async fn unshare_image(
    state: State<AppState>,
    caller: CurrentUser,
    reference: ApiPath<String>,
    query: ApiQuery<OwnerQuery>,
) -> Result<Json<ImageView>, ApiError> {
    set_shared(state, caller, reference, query, false).await
}

async fn set_shared(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(reference): ApiPath<String>,
    ApiQuery(query): ApiQuery<OwnerQuery>,
    share: bool,
) -> Result<Json<ImageView>, ApiError> {
    let image = actions::set_shared(&state, &caller, &reference, query.owner, share).await?;
    Ok(Json(image_view(image)))
}
