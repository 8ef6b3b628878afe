//! Builders for the unit tests: short ways to write sites, GPUs and sessions.

use chrono::{DateTime, TimeZone, Utc};
use ongrid_core::{GpuRequest, GpuUuid, NodeName, SessionId, Sharing};

use crate::site::{Action, GpuSlot, NodeState, PendingSession};

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
    }
}

pub fn place(session: u32, node: &str, gpus: &[u32]) -> Action {
    Action::Place {
        session: session_id(session),
        node: node_name(node),
        gpus: gpus.iter().map(|&n| uuid(n)).collect(),
    }
}
