//! The scheduler's input and output: a snapshot of the site ([`SiteState`]: nodes, their GPU
//! slots, the queued sessions and jobs, the running jobs) and the [`Action`]s a plan asks the
//! session manager to carry out.
//!
//! These are plain data. The session manager builds a `SiteState` from its store at every
//! scheduling tick and applies the returned actions (sessions PENDING → STARTING, jobs
//! QUEUED → RUNNING or CANCELLED, RUNNING → MUSTHALT).

use chrono::{DateTime, Utc};
use ongrid_core::job::{Bucket, BucketName, JobId, JobReason};
use ongrid_core::{
    ComputeCapability, GpuMode, GpuRequest, GpuUuid, HumanDuration, MemorySize, NodeName,
    SessionId, UserName,
};
use serde::{Deserialize, Serialize};

/// Everything a plan looks at.
///
/// Node names, GPU UUIDs, session ids and job ids are unique within one `SiteState` (they are
/// keys in the manager's store). The order of the vectors does not matter: the plan is the same
/// for any order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SiteState {
    pub nodes: Vec<NodeState>,
    /// Sessions waiting for GPUs (PENDING).
    pub pending: Vec<PendingSession>,
    /// Local-target jobs waiting for GPUs (QUEUED).
    #[serde(default)]
    pub queued_jobs: Vec<QueuedJob>,
    /// Local-target jobs holding GPUs (RUNNING, MUSTHALT, HALTING). Their places are counted
    /// in their GPUs' [`GpuSlot::used`] too.
    #[serde(default)]
    pub running_jobs: Vec<RunningJob>,
    /// Owned GPUs, reservations, and each request's group and reservation.
    #[serde(default)]
    pub policy: crate::policy::Policy,
}

/// One registered GPU node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeState {
    pub name: NodeName,
    /// Whether the node's agent synced recently. An offline node gets nothing.
    pub online: bool,
    /// Drained by an admin: nothing new is placed on it; what runs there keeps running (and
    /// is still halted at its max duration).
    #[serde(default)]
    pub drained: bool,
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
    /// Drained by an admin: gets nothing new, like an unhealthy GPU.
    #[serde(default)]
    pub drained: bool,
    /// Places in use now: sessions placed on it and jobs holding it (RUNNING, MUSTHALT,
    /// HALTING), one each. A GPU being halted stays used until its job is HALTED.
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
    /// Set when an earlier plan halted batch jobs for this session ([`Action::PlaceAfterHalt`]):
    /// while any of those jobs still runs, the session waits and the free GPUs of that
    /// placement are kept for it; once all are gone, it takes that placement's GPUs when they
    /// are all free.
    #[serde(default)]
    pub awaiting_halt: Option<HaltWait>,
    /// Its owner's fair-share standing: lower is served first.
    #[serde(default)]
    pub priority: Priority,
}

/// A request's place among those of its class (sessions, or jobs) by its owner's fair share:
/// lower goes first, then earlier `queued_at`. The session manager computes it from decayed,
/// cost-weighted GPU usage (`group`: the owner's accounting group's usage against its share;
/// `user`: the owner's own usage within the group); all zero when the site has no fair share.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Priority {
    pub group: u64,
    pub user: u64,
}

/// A placement waiting for batch jobs to halt, as [`Action::PlaceAfterHalt`] gave it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HaltWait {
    pub node: NodeName,
    pub gpus: Vec<GpuUuid>,
    /// The jobs whose GPUs the session waits for.
    pub jobs: Vec<JobId>,
}

/// A job waiting for GPUs (QUEUED, local target).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueuedJob {
    pub id: JobId,
    /// Whose job it is: buckets count per owner.
    pub owner: UserName,
    pub request: GpuRequest,
    /// When it entered the queue; earlier is served first (after every session).
    pub queued_at: DateTime<Utc>,
    /// Never started before this.
    pub not_before: Option<DateTime<Utc>>,
    /// Cancelled when not started by this.
    pub not_after: Option<DateTime<Utc>>,
    /// Started only while fewer than `max` of the owner's jobs of this bucket hold GPUs.
    pub bucket: Option<Bucket>,
    /// The only node it may go to (for example where its checkpoint directory is).
    #[serde(default)]
    pub pinned_node: Option<NodeName>,
    /// Its owner's fair-share standing: lower is served first among queued jobs.
    #[serde(default)]
    pub priority: Priority,
}

/// A job holding GPUs (RUNNING, MUSTHALT or HALTING, local target).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunningJob {
    pub id: JobId,
    pub owner: UserName,
    pub node: NodeName,
    pub gpus: Vec<GpuUuid>,
    pub started_at: DateTime<Utc>,
    /// Halted when still running this long after `started_at` (for a re-queued job, what its
    /// chain has left). `None`: no limit.
    pub max_duration: Option<HumanDuration>,
    /// Never halted for a session within this long after `started_at`. `None`: at once.
    pub min_duration: Option<HumanDuration>,
    /// Its bucket's name; it counts against the bucket's limit while it holds GPUs.
    pub bucket: Option<BucketName>,
    /// MUSTHALT or HALTING: asked to halt already. Its GPUs stay used until it is HALTED.
    pub halting: bool,
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
    /// `session` preempted batch work: it starts on `node` with `gpus` once `jobs` are HALTED
    /// (the [`Action::HaltJob`]s just before this action, and jobs already halting that it now
    /// waits for). Until then it stays PENDING with this as its [`HaltWait`]; the free ones of
    /// `gpus` are kept for it. No session or job gets a GPU that is being halted.
    PlaceAfterHalt {
        session: SessionId,
        node: NodeName,
        gpus: Vec<GpuUuid>,
        jobs: Vec<JobId>,
    },
    /// Halt a running job (RUNNING → MUSTHALT): it reached its max duration, or an interactive
    /// session needs its GPUs.
    HaltJob { job: JobId, reason: JobReason },
    /// Start a queued job on `node` with these GPUs (QUEUED → RUNNING).
    StartJob {
        job: JobId,
        node: NodeName,
        gpus: Vec<GpuUuid>,
    },
    /// Cancel a queued job (QUEUED → CANCELLED), e.g. not started by its notAfter.
    CancelJob { job: JobId, reason: JobReason },
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
