//! Frozen images: freezing one of the caller's sessions, for `POST /v1/images` and the
//! dashboard's freeze form (the manager records the freeze, BUILDING, and the agent of the
//! session's node gets it as an order in its desired state, [`crate::domain::images`]);
//! removing an image and sharing it ([`crate::domain::image_access`]).
//!
//! A freeze and a removal wake every node (the freeze is its session's node's order, and either
//! changes which image names go to each node's `removed_images`) and people; sharing only
//! people's views.

use std::time::Duration;

use ongrid_core::image::{CreateImage, ImageProgress, ImageReference, ImageState};
use ongrid_core::SessionName;

use ongrid_core::Dn;

use super::caller::CurrentUser;
use super::lookup::{find_images, Purpose};
use super::{ApiError, AppState, Effect, Via};
use crate::domain::image_access;
use crate::domain::images::{freezing_node, ImageRecord};
use crate::domain::Refusal;
use crate::image_files::remove_sif;
use crate::store::{ImageFilter, NewImage, StoreError};

/// Why a freeze was not recorded, where the API and the dashboard give different advice.
#[derive(Debug)]
pub enum FreezeError {
    /// The caller has no session of that name that has not ended.
    NoSession(SessionName),
    /// The caller's image of that tag is being built.
    Building(ImageReference),
    /// The caller has an image of that tag already, and did not ask to move the tag.
    TagTaken {
        reference: ImageReference,
        state: ImageState,
    },
    /// The session is being frozen already.
    Running {
        session: SessionName,
        reference: ImageReference,
    },
    /// Refused or failed alike for every caller: a domain rule, the store.
    Api(ApiError),
}

impl From<Refusal> for FreezeError {
    fn from(refusal: Refusal) -> Self {
        Self::Api(refusal.into())
    }
}

impl From<StoreError> for FreezeError {
    fn from(error: StoreError) -> Self {
        Self::Api(error.into())
    }
}

/// Records a freeze of the caller's session `order.session` to `order.reference` (BUILDING).
pub async fn freeze(
    state: &AppState,
    caller: &CurrentUser,
    order: CreateImage,
    via: Via,
) -> Result<ImageRecord, FreezeError> {
    let session = state
        .store
        .session_by_name(&caller.user.dn, &order.session)
        .await?
        .filter(|s| s.state != ongrid_core::SessionState::Ended)
        .ok_or(FreezeError::NoSession(order.session))?;
    let node = freezing_node(&session)?;
    let new = NewImage {
        id: uuid::Uuid::new_v4(),
        owner: caller.user.dn.clone(),
        reference: order.reference,
        session_id: session.id,
        session_name: session.name.clone(),
        node: node.clone(),
        base_image: session.image.clone(),
        compression: order.compression,
        force: order.force,
        at: state.clock.now(),
        reason: format!("freezing session {} on {node}", session.name),
    };
    let image = match state.store.create_image(new).await {
        Ok(image) => image,
        Err(StoreError::ImageTagTaken {
            reference,
            state: ImageState::Building,
        }) => return Err(FreezeError::Building(reference)),
        Err(StoreError::ImageTagTaken { reference, state }) => {
            return Err(FreezeError::TagTaken { reference, state })
        }
        Err(StoreError::FreezeRunning { session, reference }) => {
            return Err(FreezeError::Running { session, reference })
        }
        Err(other) => return Err(other.into()),
    };
    tracing::info!(image_id = %image.id, reference = %image.reference, session = %image.session_name, %node, user = %image.user_name, via = via.as_str(), "Freeze requested.");
    // Its node gets the order; and a tag taken again is no longer one every node untags
    // (`removed_images`), so every node's desired state may change.
    state.committed(&[Effect::Nodes]);
    Ok(image)
}

/// Whose images a list shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listed {
    /// The caller's own.
    Own,
    /// Every user's shared images.
    Shared,
    /// Everyone's (admins only).
    Everyones,
}

/// The images of `which` the caller may list.
pub async fn list(
    state: &AppState,
    caller: &CurrentUser,
    which: Listed,
) -> Result<Vec<ImageRecord>, ApiError> {
    let filter =
        match which {
            Listed::Shared => ImageFilter::Shared,
            Listed::Everyones if !caller.admin => return Err(ApiError::forbidden(
                "only admins can list everyone's images (?all=true); leave it out to list yours",
            )),
            Listed::Everyones => ImageFilter::All,
            Listed::Own => ImageFilter::Owner(caller.user.dn.clone()),
        };
    Ok(state.store.images(filter).await?)
}

/// The image `reference` names (by digest, several may share the content: the newest); with
/// `seen`, once it is no longer BUILDING with that progress, or `wait` has passed: a long-poll
/// on its freeze. The agents' syncs store the progress they report and then notify
/// ([`crate::notify::Changes`]), so the answer follows each report at once.
pub async fn show(
    state: &AppState,
    caller: &CurrentUser,
    reference: &str,
    owner: Option<Dn>,
    seen: Option<ImageProgress>,
    wait: Duration,
) -> Result<ImageRecord, ApiError> {
    // Subscribed before the first read, so no report between the read and the wait is missed.
    let mut changes = state.changes.subscribe();
    let images = find_images(state, caller, reference, owner, Purpose::Read).await?;
    let image = images
        .into_iter()
        .last()
        .ok_or_else(|| ApiError::internal("find_images returned nothing"))?;
    let Some(seen) = seen else {
        return Ok(image);
    };
    let deadline = tokio::time::Instant::now() + wait;
    let id = image.id;
    // Any change may be this image's (the node's sync, a removal, the freeze watch): look
    // again each time, and answer only on a difference.
    changes
        .follow(
            deadline,
            image,
            |image| !unchanged(image, seen),
            || async { Ok::<_, ApiError>(state.store.image(id).await?) },
        )
        .await
}

/// Whether `image` is still BUILDING with the progress the caller has.
fn unchanged(image: &ImageRecord, seen: ImageProgress) -> bool {
    image.state == ImageState::Building
        && image.bytes_done == seen.bytes_done
        && image.bytes_total == seen.bytes_total
}

/// Marks the image `reference` names DELETED (by digest: every one of the owner's images with
/// that content) and deletes the SIF file when nothing references its digest any more; returns
/// the last one removed.
pub async fn delete(
    state: &AppState,
    caller: &CurrentUser,
    reference: &str,
    owner: Option<Dn>,
) -> Result<ImageRecord, ApiError> {
    let images = find_images(state, caller, reference, owner, Purpose::Change).await?;
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
    state.committed(&[Effect::Nodes]);
    Ok(image)
}

/// Shares or unshares the image `reference` names (by digest: each of the owner's images with
/// that content that the rule lets change); refused as a whole when none may. Returns the last
/// one changed.
pub async fn set_shared(
    state: &AppState,
    caller: &CurrentUser,
    reference: &str,
    owner: Option<Dn>,
    share: bool,
) -> Result<ImageRecord, ApiError> {
    let images = find_images(state, caller, reference, owner, Purpose::Change).await?;
    let now = state.clock.now();
    let mut changed = None;
    let mut refusal = None;
    for image in images {
        match image_access::share(&image, &caller.user.dn, share, now) {
            Ok(shared_at) => {
                if let Some(image) = state.store.set_image_shared(image.id, shared_at).await? {
                    tracing::info!(image_id = %image.id, reference = %image.reference, shared = share, by = %caller.user.user_name, "Image sharing changed.");
                    changed = Some(image);
                }
            }
            Err(refused) => refusal = Some(refused),
        }
    }
    match (changed, refusal) {
        (Some(image), _) => {
            state.committed(&[Effect::People]);
            Ok(image)
        }
        (None, Some(refused)) => Err(refused.into()),
        (None, None) => Err(ApiError::not_found(format!(
            "image {reference} was removed meanwhile"
        ))),
    }
}
