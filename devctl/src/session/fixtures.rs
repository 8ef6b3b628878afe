//! Test fixtures shared by the session modules' tests.

use chrono::{DateTime, Utc};
use ongrid_core::api::SessionView;
use ongrid_core::{
    ComputeCapability, Dn, GpuId, GpuRequest, MemorySize, NodeName, SessionId, SessionName,
    SessionState, Sharing, Transition, UserName,
};

pub const UUID_A: &str = "GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f";

/// 2026-11-21 10:00:00Z plus `secs`.
pub fn at(secs: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_795_255_200 + secs, 0).unwrap()
}

pub fn session(name: &str, state: SessionState) -> SessionView {
    SessionView {
        id: SessionId("6f1c2d3e-4a5b-4c6d-8e9f-0a1b2c3d4e5f".parse().unwrap()),
        name: SessionName::parse(name).unwrap(),
        owner: Dn::parse("/DC=org/DC=example/CN=Alice Smith").unwrap(),
        user_name: UserName::parse("alice-smith").unwrap(),
        state,
        reason: "placed on node1".into(),
        request: GpuRequest {
            count: 1,
            min_capability: Some(ComputeCapability::new(8, 0)),
            min_memory: Some(MemorySize::parse("40GiB").unwrap()),
            sharing: Sharing::Exclusive,
        },
        image: "ongrid/dev:latest".into(),
        node: Some(NodeName::parse("node1").unwrap()),
        gpus: vec![GpuId::parse(UUID_A).unwrap()],
        container: "ongrid-6f1c2d3e4a5b4c6d8e9f0a1b2c3d4e5f".into(),
        created_at: at(3),
        queue_position: None,
        lifecycle: None,
        transitions: vec![
            Transition {
                from: None,
                to: SessionState::Pending,
                at: at(3),
                reason: "created".into(),
            },
            Transition {
                from: Some(SessionState::Pending),
                to: SessionState::Starting,
                at: at(4),
                reason: "placed on node1".into(),
            },
        ],
    }
}
