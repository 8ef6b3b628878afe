//! An admin's operations on nodes and GPUs: drains, for `PUT`/`DELETE /v1/nodes/{name}/drain` and
//! `/v1/gpus/{uuid}/drain` and the dashboard's drain buttons (a drained node or GPU takes
//! nothing new, what runs there goes on; back in service, the queue may fit there again); a
//! stopped node forgotten ([`remove`]); a GPU's mode ([`set_gpu_mode`]: whole, shared:N, or a
//! MIG layout its agent makes). And what every user sees of them: [`list`], [`show`] (which can
//! wait for a drained node to empty) and [`gpu`], others' sessions counted but not named.

use std::time::Duration;

use ongrid_core::api::{GpuView, NodeView};
use ongrid_core::gpu::Drain;
use ongrid_core::{GpuMode, GpuUuid, NodeName};

use super::caller::CurrentUser;
use super::{ApiError, AppState, Effect, Via};
use crate::domain::nodes;
use crate::site::SiteSnapshot;
use crate::store::{GpuRecord, NodeRecord, NodeRemoval};

/// The longest [`show`] waits for a node to empty in one request.
pub const MAX_NODE_WAIT: Duration = Duration::from_secs(60);

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
            // Gone from people's lists; no agent runs there: its long-poll, if one is still
            // open, is told (it answers that the node is not registered).
            state.committed(&[
                Effect::Scheduling,
                Effect::People,
                Effect::Node(node.clone()),
            ]);
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
            .flat_map(|node| node.gpus.iter())
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

/// Every registered node as `caller` sees it.
pub async fn list(state: &AppState, caller: &CurrentUser) -> Result<Vec<NodeView>, ApiError> {
    let site = state.site().await?;
    Ok(site
        .nodes
        .iter()
        .map(|node| node_view(&site, caller, node))
        .collect())
}

/// The node `node` names as `caller` sees it. With `wait_empty`, once nothing holds its GPUs any
/// more (no running session, no job holding GPUs; what `devctl admin node drain --wait` waits
/// for), or as it is when that time (at most [`MAX_NODE_WAIT`]) passes.
pub async fn show(
    state: &AppState,
    caller: &CurrentUser,
    node: &str,
    wait_empty: Option<Duration>,
) -> Result<NodeView, NodeError> {
    let node = NodeName::parse(node).map_err(|e| ApiError::bad_request(e.to_string()))?;
    // Subscribed before the first read, so no change between the read and the wait is missed.
    let mut changes = state.changes.subscribe_node(&node);
    let view = find_node(state, caller, &node).await?;
    let Some(wait) = wait_empty else {
        return Ok(view);
    };
    let deadline = tokio::time::Instant::now() + wait.min(MAX_NODE_WAIT);
    let empty = |view: &NodeView| view.sessions == 0 && view.jobs == 0;
    changes
        .follow(deadline, view, empty, || async {
            find_node(state, caller, &node).await.map(Some)
        })
        .await
}

/// The node `node` as `caller` sees it now.
pub async fn find_node(
    state: &AppState,
    caller: &CurrentUser,
    node: &NodeName,
) -> Result<NodeView, NodeError> {
    let site = state.site().await?;
    site.nodes
        .iter()
        .find(|record| record.name == *node)
        .map(|record| node_view(&site, caller, record))
        .ok_or_else(|| NodeError::NoSuchNode(node.clone()))
}

/// The GPU `uuid` as `caller` sees it now.
pub async fn gpu(
    state: &AppState,
    caller: &CurrentUser,
    uuid: &GpuUuid,
) -> Result<GpuView, NodeError> {
    let site = state.site().await?;
    site.nodes
        .iter()
        .find_map(|node| {
            let gpu = node.gpus.iter().find(|g| g.info.uuid == *uuid)?;
            Some(gpu_view(&site, caller, node, gpu))
        })
        .ok_or_else(|| NodeError::NoSuchGpu(uuid.clone()))
}

fn node_view(site: &SiteSnapshot, caller: &CurrentUser, node: &NodeRecord) -> NodeView {
    let on_node = |n: &Option<NodeName>| n.as_ref() == Some(&node.name);
    NodeView {
        name: node.name.clone(),
        online: site.is_online(node),
        last_seen: node.last_seen,
        gpu_backend: node.gpu_backend.clone(),
        gpus: node
            .gpus
            .iter()
            .map(|gpu| gpu_view(site, caller, node, gpu))
            .collect(),
        agent_version: node.agent_version.clone(),
        drain: node.drain.clone(),
        sessions: count(site.holding.iter().filter(|s| on_node(&s.node))),
        jobs: count(
            site.jobs
                .iter()
                .filter(|j| j.state().holds_gpus() && on_node(&j.node)),
        ),
    }
}

fn count<T>(items: impl Iterator<Item = T>) -> u32 {
    u32::try_from(items.count()).unwrap_or(u32::MAX)
}

/// A GPU as `caller` may see it: sessions of others are counted but not named (admins see all).
fn gpu_view(
    site: &SiteSnapshot,
    caller: &CurrentUser,
    node: &NodeRecord,
    gpu: &GpuRecord,
) -> GpuView {
    let mut view = GpuView {
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
        drain: gpu.drain.clone(),
        mig_sessions: Default::default(),
    };
    if let Some(layout) = gpu.mode.mig_layout() {
        // A GPU in MIG mode: its places are its devices.
        let slots: Vec<_> = site
            .reported_mig_slots()
            .into_iter()
            .filter(|slot| slot.parent == gpu.info.uuid)
            .collect();
        let held = slots.iter().filter(|slot| slot.used).count();
        view.used = u32::try_from(held).unwrap_or(u32::MAX);
        let out_of_service = !gpu.info.health.is_healthy()
            || !site.is_online(node)
            || gpu.drain.is_some()
            || node.drain.is_some()
            || !layout.is_made_by(&gpu.info.mig_devices);
        view.free = if out_of_service {
            0
        } else {
            u32::try_from(slots.len() - held).unwrap_or(u32::MAX)
        };
        for session in site
            .holding_sessions()
            .filter(|s| caller.admin || s.owner == caller.user.dn)
        {
            for id in &session.gpus {
                if let ongrid_core::GpuId::Mig(mig) = id {
                    if slots.iter().any(|slot| &slot.uuid == mig) {
                        view.mig_sessions.insert(mig.clone(), session.name.clone());
                        if !view.sessions.contains(&session.name) {
                            view.sessions.push(session.name.clone());
                        }
                    }
                }
            }
        }
    }
    view
}
