//! What the scheduling loop stores: a placement the pure `ongrid_scheduler::plan` chose, and
//! a STARTING session sent back to the queue because its node stopped responding (sessions
//! already running there are left alone: the agent's containers keep running without the
//! manager).

use chrono::{DateTime, Utc};
use ongrid_core::{GpuId, GpuUuid, NodeName, SessionState};

use super::{Change, Placement};

/// A STARTING session on `node`, which went offline: back to the queue, keeping its place.
pub fn requeue_stranded(node: &NodeName, now: DateTime<Utc>) -> Change {
    Change {
        to: SessionState::Pending,
        at: now,
        reason: format!("node {node} stopped responding"),
        hold: None,
        placement: Placement::Clear,
    }
}

/// A PENDING session placed on `gpus` of `node`. `unpinned_from`: the node where its held
/// container is, offline, so that it starts anywhere in a new container.
pub fn place(
    node: &NodeName,
    gpus: Vec<GpuUuid>,
    unpinned_from: Option<&NodeName>,
    now: DateTime<Utc>,
) -> Change {
    let names: Vec<&str> = gpus.iter().map(|g| g.as_str()).collect();
    let mut reason = format!("placed on {node} ({})", names.join(", "));
    if let Some(old) = unpinned_from {
        reason.push_str(&format!(
            "; {old}, where its held container is, is offline, so it starts in a new container: \
             the old one is removed when {old} is back (the home volume there is kept)"
        ));
    }
    Change {
        to: SessionState::Starting,
        at: now,
        reason,
        hold: None,
        placement: Placement::Place {
            node: node.clone(),
            gpus: gpus.into_iter().map(GpuId::Gpu).collect(),
        },
    }
}

/// `node`'s MIG device `device` (of GPU `parent`) for a session that asked for a MIG device.
pub fn place_mig(
    node: &NodeName,
    device: ongrid_core::MigUuid,
    parent: &GpuUuid,
    now: DateTime<Utc>,
) -> Change {
    Change {
        to: SessionState::Starting,
        at: now,
        reason: format!("placed on {node} (MIG device {device} of {parent})"),
        hold: None,
        placement: Placement::Place {
            node: node.clone(),
            gpus: vec![GpuId::Mig(device)],
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placements_and_requeues_say_where_and_why() {
        let now = Utc::now();
        let node1 = NodeName::parse("node1").unwrap();
        let node2 = NodeName::parse("node2").unwrap();
        let gpu = GpuUuid::parse("GPU-11111111-2222-3333-4444-555555555501").unwrap();
        let change = place(&node1, vec![gpu.clone()], None, now);
        assert_eq!(change.to, SessionState::Starting);
        assert_eq!(
            change.reason,
            "placed on node1 (GPU-11111111-2222-3333-4444-555555555501)"
        );
        assert_eq!(
            change.placement,
            Placement::Place {
                node: node1.clone(),
                gpus: vec![GpuId::Gpu(gpu.clone())]
            }
        );
        let moved = place(&node1, vec![gpu], Some(&node2), now);
        assert!(
            moved
                .reason
                .contains("; node2, where its held container is, is offline"),
            "{}",
            moved.reason
        );
        let back = requeue_stranded(&node2, now);
        assert_eq!(back.to, SessionState::Pending);
        assert_eq!(back.placement, Placement::Clear);
        assert_eq!(back.reason, "node node2 stopped responding");
    }
}
