//! An admin's operations on nodes and GPUs: drains, for `PUT`/`DELETE /v1/nodes/{name}/drain` and
//! `/v1/gpus/{uuid}/drain` and the dashboard's drain buttons (a drained node or GPU takes
//! nothing new, what runs there goes on; back in service, the queue may fit there again); a
//! stopped node forgotten ([`remove`]); a GPU's mode ([`set_gpu_mode`]: whole, shared:N, or a
//! MIG layout its agent makes).

use ongrid_core::gpu::Drain;
use ongrid_core::{GpuMode, GpuUuid, NodeName};

use super::caller::CurrentUser;
use super::{ApiError, AppState, Effect, Via};
use crate::domain::nodes;
use crate::store::{GpuRecord, NodeRemoval};

/// Why a node or GPU was not changed, where the API and the dashboard give different advice.
#[derive(Debug)]
pub enum NodeError {
    NoSuchNode(NodeName),
    NoSuchGpu(GpuUuid),
    /// Refused or failed alike for every caller: not an admin, the domain's refusal, the store.
    Api(ApiError),
}

impl<E: Into<ApiError>> From<E> for NodeError {
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
) -> Result<NodeName, NodeError> {
    caller.require_admin(match change {
        DrainChange::Drain { .. } => "can drain a node",
        DrainChange::Undrain => "can undrain a node",
    })?;
    let node = NodeName::parse(node).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let drain = new_drain(state, caller, change)?;
    if !state.store.set_node_drain(&node, drain.clone()).await? {
        return Err(NodeError::NoSuchNode(node));
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
) -> Result<GpuRecord, NodeError> {
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
        .ok_or_else(|| NodeError::NoSuchGpu(uuid.clone()))?;
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

/// Forgets the node `node`, whose agent has stopped (offline for `node_timeout`); refused while
/// it is online or anything is placed on it.
pub async fn remove(
    state: &AppState,
    caller: &CurrentUser,
    node: &NodeName,
) -> Result<(), NodeError> {
    caller.require_admin("can remove a node")?;
    match state
        .store
        .remove_node(node, state.clock.now(), state.config.node_timeout)
        .await?
    {
        NodeRemoval::Removed => {
            tracing::info!(%node, by = %caller.user.user_name, "Node removed.");
            // Gone from people's lists; no agent runs there.
            state.committed(&[Effect::Scheduling, Effect::People]);
            Ok(())
        }
        NodeRemoval::NoSuchNode => Err(NodeError::NoSuchNode(node.clone())),
        NodeRemoval::Refused(refusal) => Err(refusal.into()),
    }
}

/// Sets the GPU's mode; a MIG layout is checked against the GPU's model before it is stored,
/// so the agent never gets a layout its GPU cannot have. The scheduler's next round makes the
/// layout part of its node's desired state.
pub async fn set_gpu_mode(
    state: &AppState,
    caller: &CurrentUser,
    uuid: &GpuUuid,
    mode: GpuMode,
) -> Result<(), NodeError> {
    caller.require_admin("can change a GPU's mode")?;
    if let Some(layout) = mode.mig_layout() {
        let site = state.site().await?;
        let gpu = site
            .nodes
            .iter()
            .flat_map(|node| &node.gpus)
            .find(|g| g.info.uuid == *uuid)
            .ok_or_else(|| NodeError::NoSuchGpu(uuid.clone()))?;
        layout
            .validate_for(&gpu.info.model)
            .map_err(|e| ApiError::bad_request(format!("mig:{layout} on {uuid}: {e}")))?;
    }
    let gpu = state
        .store
        .set_gpu_mode(uuid, mode)
        .await?
        .ok_or_else(|| NodeError::NoSuchGpu(uuid.clone()))?;
    tracing::info!(gpu = %uuid, %mode, by = %caller.user.user_name, "GPU mode changed.");
    state.committed(&[Effect::Scheduling, Effect::Node(gpu.node)]);
    Ok(())
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
