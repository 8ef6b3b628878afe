//! Freezing one of the caller's sessions into an image, for `POST /v1/images` and the
//! dashboard's freeze form: the manager records the freeze (BUILDING) and the agent of the
//! session's node gets it as an order in its desired state ([`crate::domain::images`]).

use ongrid_core::image::{CreateImage, ImageReference, ImageState};
use ongrid_core::SessionName;

use super::caller::CurrentUser;
use super::Via;
use super::{ApiError, AppState};
use crate::domain::images::{freezing_node, ImageRecord};
use crate::domain::Refusal;
use crate::store::{NewImage, StoreError};

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
    Ok(image)
}
