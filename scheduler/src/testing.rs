//! Builders for the unit tests: short ways to write sites, GPUs and sessions.

use chrono::{DateTime, TimeZone, Utc};
use ongrid_core::job::{Bucket, JobReason};
use ongrid_core::{
    GpuRequest, GpuUuid, HumanDuration, JobId, NodeName, SessionId, Sharing, UserName,
};

use crate::site::{Action, GpuSlot, NodeState, PendingSession, QueuedJob, RunningJob};

/// `GPU-0000000n-0000-0000-0000-000000000000`.
pub fn uuid(n: u32) -> GpuUuid {
    GpuUuid::parse(&format!("GPU-{n:08x}-0000-0000-0000-000000000000")).unwrap()
}

pub fn session_id(n: u32) -> SessionId {
    format!("{n:032x}").parse().unwrap()
}

pub fn node_name(name: &str) -> NodeName {
    NodeName::parse(name).unwrap()
}

/// A healthy, unused GPU: `gpu(1, "8.0", "40G", "exclusive")`.
pub fn gpu(n: u32, capability: &str, memory: &str, mode: &str) -> GpuSlot {
    GpuSlot {
        uuid: uuid(n),
        capability: capability.parse().unwrap(),
        memory: memory.parse().unwrap(),
        mode: mode.parse().unwrap(),
        healthy: true,
        drained: false,
        used: 0,
    }
}

pub fn t4(n: u32) -> GpuSlot {
    gpu(n, "7.5", "16G", "exclusive")
}

pub fn a100(n: u32) -> GpuSlot {
    gpu(n, "8.0", "40G", "exclusive")
}

pub fn a100_80(n: u32) -> GpuSlot {
    gpu(n, "8.0", "80G", "exclusive")
}

pub fn h100(n: u32) -> GpuSlot {
    gpu(n, "9.0", "80G", "exclusive")
}

pub fn node(name: &str, gpus: Vec<GpuSlot>) -> NodeState {
    NodeState {
        name: node_name(name),
        online: true,
        drained: false,
        gpus,
    }
}

/// `request(2, Some("8.0"), Some("40G"), Sharing::Exclusive)`.
pub fn request(
    count: u32,
    min_capability: Option<&str>,
    min_memory: Option<&str>,
    sharing: Sharing,
) -> GpuRequest {
    GpuRequest {
        count,
        min_capability: min_capability.map(|c| c.parse().unwrap()),
        min_memory: min_memory.map(|m| m.parse().unwrap()),
        sharing,
    }
}

pub fn at(second: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_750_000_000 + second, 0).unwrap()
}

/// Session `n`, queued at second `n`.
pub fn session(n: u32, request: GpuRequest) -> PendingSession {
    PendingSession {
        id: session_id(n),
        request,
        queued_at: at(i64::from(n)),
        preferred_node: None,
        pinned_node: None,
        previous_gpus: Vec::new(),
        awaiting_halt: None,
        priority: Default::default(),
    }
}

pub fn place(session: u32, node: &str, gpus: &[u32]) -> Action {
    Action::Place {
        session: session_id(session),
        node: node_name(node),
        gpus: gpus.iter().map(|&n| uuid(n)).collect(),
    }
}

pub fn job_id(n: u32) -> JobId {
    format!("{:032x}", 0xb000_0000_u64 + u64::from(n))
        .parse()
        .unwrap()
}

pub fn user(name: &str) -> UserName {
    UserName::parse(name).unwrap()
}

/// Job `n` of alice, queued at second `n`, no options.
pub fn queued_job(n: u32, request: GpuRequest) -> QueuedJob {
    QueuedJob {
        id: job_id(n),
        owner: user("alice"),
        request,
        queued_at: at(i64::from(n)),
        not_before: None,
        not_after: None,
        bucket: None,
        pinned_node: None,
        priority: Default::default(),
    }
}

pub fn bucket(text: &str) -> Option<Bucket> {
    Some(Bucket::parse(text).unwrap())
}

/// Job `n` of alice on `node` holding `gpus` since second `started`, with a min duration of
/// `min` seconds and no max duration. The GPUs' `used` must count it (see [`hold`]).
pub fn running_job(n: u32, node: &str, gpus: &[u32], started: i64, min: u64) -> RunningJob {
    RunningJob {
        id: job_id(n),
        owner: user("alice"),
        node: node_name(node),
        gpus: gpus.iter().map(|&g| uuid(g)).collect(),
        started_at: at(started),
        max_duration: None,
        min_duration: Some(HumanDuration::from_secs(min)),
        bucket: None,
        halting: false,
    }
}

/// The GPU with one place in use.
pub fn hold(mut slot: GpuSlot) -> GpuSlot {
    slot.used += 1;
    slot
}

pub fn start(job: u32, node: &str, gpus: &[u32]) -> Action {
    Action::StartJob {
        job: job_id(job),
        node: node_name(node),
        gpus: gpus.iter().map(|&n| uuid(n)).collect(),
    }
}

pub fn halt_for(job: u32, need: GpuRequest) -> Action {
    Action::HaltJob {
        job: job_id(job),
        reason: JobReason::ForInteractiveSession { need },
    }
}

pub fn place_after(session: u32, node: &str, gpus: &[u32], jobs: &[u32]) -> Action {
    Action::PlaceAfterHalt {
        session: session_id(session),
        node: node_name(node),
        gpus: gpus.iter().map(|&n| uuid(n)).collect(),
        jobs: jobs.iter().map(|&n| job_id(n)).collect(),
    }
}
