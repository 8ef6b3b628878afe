//! The scheduler's input and output: a snapshot of the site ([`SiteState`]: nodes, their GPU
//! slots and what is queued) and the [`Action`]s a plan asks the session manager to carry out.
//!
//! These are plain data. The session manager builds a `SiteState` from its store at every
//! scheduling tick and applies the returned actions (PENDING → STARTING).

use chrono::{DateTime, Utc};
use ongrid_core::{
    ComputeCapability, GpuMode, GpuRequest, GpuUuid, MemorySize, NodeName, SessionId,
};
use serde::{Deserialize, Serialize};

/// Everything a plan looks at.
///
/// Node names, GPU UUIDs and session ids are unique within one `SiteState` (they are keys in the
/// manager's store). The order of `nodes`, of each node's `gpus` and of `pending` does not matter:
/// the plan is the same for any order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SiteState {
    pub nodes: Vec<NodeState>,
    pub pending: Vec<PendingSession>,
}

/// One registered GPU node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeState {
    pub name: NodeName,
    /// Whether the node's agent synced recently. An offline node gets nothing.
    pub online: bool,
    pub gpus: Vec<GpuSlot>,
}

/// One GPU of a node, with the admin's mode for it and how many sessions hold it now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSlot {
    pub uuid: GpuUuid,
    pub capability: ComputeCapability,
    pub memory: MemorySize,
    pub mode: GpuMode,
    /// An unhealthy GPU (for example one that fell off the bus) gets nothing.
    pub healthy: bool,
    /// sessions placed on it now
    pub used: u32,
}

impl GpuSlot {
    /// How many more sessions the GPU can take: `capacity - used`, and 0 when an admin shrank
    /// the capacity below what is in use.
    pub fn free_places(&self) -> u32 {
        self.mode.capacity().saturating_sub(self.used)
    }
}

/// A session waiting for GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingSession {
    pub id: SessionId,
    pub request: GpuRequest,
    /// When it entered the queue; earlier is served first.
    pub queued_at: DateTime<Utc>,
    /// e.g. the node it ran on before a hold; preferred when it fits
    pub preferred_node: Option<NodeName>,
    /// The only node it may go to (a released session goes back to its stopped container);
    /// it waits while that node has no room. Wins over `preferred_node`.
    #[serde(default)]
    pub pinned_node: Option<NodeName>,
    /// The GPUs a pinned session's stopped container was made with. When all of them are free
    /// and fit, the session gets exactly these back, so its container restarts as it is
    /// instead of being recreated for other GPUs.
    #[serde(default)]
    pub previous_gpus: Vec<GpuUuid>,
}

/// What the session manager should do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// Start `session` on `node` with these GPUs: distinct GPUs of that node, as many as the
    /// session asked for, in the order of the scheduler's preference (least capable first).
    Place {
        session: SessionId,
        node: NodeName,
        gpus: Vec<GpuUuid>,
    },
}

#[cfg(test)]
mod tests {
    use crate::testing::gpu;

    #[test]
    fn free_places_never_go_below_zero() {
        let mut shared = gpu(1, "8.0", "40G", "shared:4");
        assert_eq!(shared.free_places(), 4);
        shared.used = 3;
        assert_eq!(shared.free_places(), 1);
        // An admin shrank the GPU from shared:4 to shared:2 while 3 sessions hold it.
        shared.mode = "shared:2".parse().unwrap();
        assert_eq!(shared.free_places(), 0);
        let mut whole = gpu(2, "8.0", "40G", "exclusive");
        assert_eq!(whole.free_places(), 1);
        whole.used = 1;
        assert_eq!(whole.free_places(), 0);
    }
}
