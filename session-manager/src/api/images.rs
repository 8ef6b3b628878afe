//! Routes for frozen images: `POST /v1/images` (freeze a session), `GET /v1/images`,
//! `GET /v1/images/{reference}` and `DELETE /v1/images/{reference}`, where `{reference}` is
//! `name:version` (the owner's current image of that tag) or `sha256:<hex>` (any of the owner's
//! images with that digest, also one whose tag `--force` moved on).
//!
//! The manager only records the freeze (BUILDING); the agent of the session's node gets it as an
//! order in its desired state, does the work and reports progress, then READY or FAILED, in its
//! syncs (see [`super::agent`] and [`crate::domain::images`]). Like sessions, a user
//! sees and removes only their own images (others' answer the same 404 as missing ones);
//! admins see all (`?all=true`) and address anyone's with `?owner=DN`.
//!
//! Removing an image marks it DELETED; its SIF file is deleted from `image_store` when no other
//! image has the same digest. The Docker image on the node is left alone (a node's Docker
//! images are the admin's to prune).

use std::path::Path;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use ongrid_core::image::{parse_digest, CreateImage, ImageLookup, ImageState, ImageView};
use ongrid_core::{Dn, SessionState};
use serde::Deserialize;

use super::callers::CurrentUser;
use super::views::image_view;
use super::{ApiError, ApiJson, ApiPath, ApiQuery, AppState};
use crate::domain::images::{freezing_node, ImageRecord};
use crate::store::{ImageFilter, NewImage, StoreError};

pub async fn create_image(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiJson(body): ApiJson<CreateImage>,
) -> Result<(StatusCode, Json<ImageView>), ApiError> {
    let session = state
        .store
        .session_by_name(&caller.user.dn, &body.session)
        .await?
        .filter(|s| s.state != SessionState::Ended)
        .ok_or_else(|| {
            ApiError::not_found(format!(
                "you have no session named {}: list yours with `devctl session ls`",
                body.session
            ))
        })?;
    let node = freezing_node(&session)?;
    let new = NewImage {
        id: uuid::Uuid::new_v4(),
        owner: caller.user.dn.clone(),
        reference: body.reference.clone(),
        session_id: session.id,
        session_name: session.name.clone(),
        node: node.clone(),
        base_image: session.image.clone(),
        compression: body.compression,
        force: body.force,
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
                "image {reference} is being built: wait for it (`devctl image show {reference}`) \
                 or remove it with `devctl image rm {reference}`"
            )))
        }
        Err(StoreError::ImageTagTaken { reference, state }) => {
            return Err(ApiError::conflict(format!(
                "you already have image {reference} ({state}): pick another version, or add \
                 --force to move the tag (the old image stays reachable by its digest)"
            )))
        }
        Err(StoreError::FreezeRunning { session, reference }) => {
            return Err(ApiError::conflict(format!(
                "session {session} is being frozen to {reference} already: wait for it \
                 (`devctl image show {reference}`)"
            )))
        }
        Err(other) => return Err(other.into()),
    };
    tracing::info!(image_id = %image.id, reference = %image.reference, session = %image.session_name, %node, user = %image.user_name, "Freeze requested.");
    Ok((StatusCode::CREATED, Json(image_view(image))))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    #[serde(default)]
    all: bool,
}

pub async fn list_images(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiQuery(query): ApiQuery<ListQuery>,
) -> Result<Json<Vec<ImageView>>, ApiError> {
    let filter = if query.all {
        if !caller.admin {
            return Err(ApiError::forbidden(
                "only admins can list everyone's images (?all=true); leave it out to list yours",
            ));
        }
        ImageFilter::All
    } else {
        ImageFilter::Owner(caller.user.dn.clone())
    };
    let images = state.store.images(filter).await?;
    Ok(Json(images.into_iter().map(image_view).collect()))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OwnerQuery {
    owner: Option<Dn>,
}

pub async fn show_image(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(reference): ApiPath<String>,
    ApiQuery(query): ApiQuery<OwnerQuery>,
) -> Result<Json<ImageView>, ApiError> {
    let images = find_images(&state, &caller, &reference, query.owner).await?;
    // By digest, several images may share the content: the newest is shown.
    let image = images
        .into_iter()
        .last()
        .ok_or_else(|| ApiError::internal("find_images returned nothing"))?;
    Ok(Json(image_view(image)))
}

/// Marks the image DELETED (by digest: every one of the owner's images with that content) and
/// deletes the SIF file when nothing references its digest any more.
pub async fn delete_image(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(reference): ApiPath<String>,
    ApiQuery(query): ApiQuery<OwnerQuery>,
) -> Result<Json<ImageView>, ApiError> {
    let images = find_images(&state, &caller, &reference, query.owner).await?;
    let now = state.clock.now();
    let mut last = None;
    for image in images {
        let Some(deleted) = state.store.delete_image(image.id, now).await? else {
            continue;
        };
        tracing::info!(image_id = %deleted.image.id, reference = %deleted.image.reference, by = %caller.user.user_name, "Image removed.");
        if deleted.digest_unreferenced {
            if let (Some(store), Some(digest)) = (&state.config.image_store, &deleted.image.digest)
            {
                remove_sif(store, digest);
            }
        }
        last = Some(deleted.image);
    }
    let image = last
        .ok_or_else(|| ApiError::not_found(format!("image {reference} was removed meanwhile")))?;
    Ok(Json(image_view(image)))
}

/// Deletes `<store>/sha256/<hex>.sif`; a file already gone is fine, any other failure is logged
/// for the admin (the image is DELETED either way).
fn remove_sif(store: &Path, digest: &str) {
    let Ok(hex) = parse_digest(digest) else {
        tracing::error!(%digest, "A stored image digest is malformed; its SIF file is left.");
        return;
    };
    let path = store.join("sha256").join(format!("{hex}.sif"));
    match std::fs::remove_file(&path) {
        Ok(()) => tracing::info!(path = %path.display(), "SIF file deleted."),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::error!(path = %path.display(), error = %e, "Cannot delete a SIF file of a removed image; delete it by hand.")
        }
    }
}

/// Resolves `{reference}[?owner=DN]` for the caller: one image by tag, or all the owner's (an
/// admin without `owner`: everyone's) by digest. The same 404 whether nothing matches or the
/// images belong to someone the caller may not see.
async fn find_images(
    state: &AppState,
    caller: &CurrentUser,
    reference: &str,
    owner: Option<Dn>,
) -> Result<Vec<ImageRecord>, ApiError> {
    let lookup = ImageLookup::parse(reference).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let explicit_owner = owner.is_some();
    let owner = owner.unwrap_or_else(|| caller.user.dn.clone());
    let not_found = || {
        if owner == caller.user.dn {
            ApiError::not_found(format!(
                "you have no image {lookup}: list yours with `devctl image ls`"
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
        ImageLookup::Digest(digest) => ImageFilter::Digest {
            // An admin looks a digest up site-wide unless an owner is named.
            owner: (!caller.admin || explicit_owner).then(|| owner.clone()),
            digest: digest.clone(),
        },
    };
    let images = state.store.images(filter).await?;
    if images.is_empty() {
        return Err(not_found());
    }
    Ok(images)
}
