//! An admin's drains of nodes and GPUs, for `PUT`/`DELETE /v1/nodes/{name}/drain` and
//! `/v1/gpus/{uuid}/drain` and the dashboard's drain buttons: a drained node or GPU takes
//! nothing new (what runs there goes on); back in service, the queue may fit there again.

use ongrid_core::gpu::Drain;
use ongrid_core::{GpuUuid, NodeName};

use super::caller::CurrentUser;
use super::{ApiError, AppState, Effect, Via};
use crate::domain::nodes;
use crate::store::GpuRecord;

/// Why a drain was not changed, where the API and the dashboard give different advice.
#[derive(Debug)]
pub enum DrainError {
    NoSuchNode(NodeName),
    NoSuchGpu(GpuUuid),
    /// Refused or failed alike for every caller: not an admin, the domain's refusal, the store.
    Api(ApiError),
}

impl<E: Into<ApiError>> From<E> for DrainError {
    fn from(error: E) -> Self {
        Self::Api(error.into())
    }
}

/// What an admin asks of a node's or a GPU's drain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainChange<'a> {
    /// Take nothing new, for this reason (if any).
    Drain { reason: Option<&'a str> },
    /// Back in service.
    Undrain,
}

/// Drains the node `node` names or puts it back in service; the node's name. A drain already in
/// place is kept as it is.
pub async fn drain_node(
    state: &AppState,
    caller: &CurrentUser,
    node: &str,
    change: DrainChange<'_>,
    via: Via,
) -> Result<NodeName, DrainError> {
    caller.require_admin(match change {
        DrainChange::Drain { .. } => "can drain a node",
        DrainChange::Undrain => "can undrain a node",
    })?;
    let node = NodeName::parse(node).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let drain = new_drain(state, caller, change)?;
    if !state.store.set_node_drain(&node, drain.clone()).await? {
        return Err(DrainError::NoSuchNode(node));
    }
    match &drain {
        Some(drain) => {
            tracing::info!(%node, reason = ?drain.reason, by = %caller.user.user_name, via = via.as_str(), "Node drained.");
        }
        None => {
            tracing::info!(%node, by = %caller.user.user_name, via = via.as_str(), "Node back in service.");
        }
    }
    state.committed(&[Effect::Scheduling, Effect::Nodes]);
    Ok(node)
}

/// Drains the GPU `uuid` names or puts it back in service, like [`drain_node`]; the GPU as
/// stored.
pub async fn drain_gpu(
    state: &AppState,
    caller: &CurrentUser,
    uuid: &str,
    change: DrainChange<'_>,
    via: Via,
) -> Result<GpuRecord, DrainError> {
    caller.require_admin(match change {
        DrainChange::Drain { .. } => "can drain a GPU",
        DrainChange::Undrain => "can undrain a GPU",
    })?;
    let uuid = GpuUuid::parse(uuid).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let drain = new_drain(state, caller, change)?;
    let gpu = state
        .store
        .set_gpu_drain(&uuid, drain.clone())
        .await?
        .ok_or_else(|| DrainError::NoSuchGpu(uuid.clone()))?;
    match &drain {
        Some(drain) => {
            tracing::info!(gpu = %uuid, reason = ?drain.reason, by = %caller.user.user_name, via = via.as_str(), "GPU drained.");
        }
        None => {
            tracing::info!(gpu = %uuid, by = %caller.user.user_name, via = via.as_str(), "GPU back in service.");
        }
    }
    state.committed(&[Effect::Scheduling, Effect::Nodes]);
    Ok(gpu)
}

/// The drain to store (the domain checks the reason), or `None` to lift it.
fn new_drain(
    state: &AppState,
    caller: &CurrentUser,
    change: DrainChange<'_>,
) -> Result<Option<Drain>, ApiError> {
    match change {
        DrainChange::Drain { reason } => Ok(Some(nodes::drain(
            reason,
            &caller.user.user_name,
            state.clock.now(),
        )?)),
        DrainChange::Undrain => Ok(None),
    }
}
