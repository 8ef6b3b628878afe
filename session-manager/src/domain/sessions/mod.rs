//! The rules that move a session between states. Each takes what is known (the session, a
//! report, its lifecycle facts, the time) and returns a decision, a [`Change`] or a
//! [`crate::domain::Refusal`]; none does I/O.
//!
//! - [`requests`]: what people ask: hold, release, keep alive, remove.
//! - [`queue`]: what the scheduling loop does with a placement or a node that went offline.
//! - [`reports`]: what an agent's report of a container means for its session.
//! - [`desired`]: what a node's agent is told to run, stop or remove.
//! - [`connections`]: how the gateway's connection events move WAITING, CONNECTED and IDLE.
//! - [`facts`]: what a change of state and an agent's activity sample do to the lifecycle
//!   facts the hold policy reads.
//! - [`holds`]: the hold policy (no-connection, idle, max-duration), deadlines and the
//!   "why is it still alive?" view.
//!
//! [`Change`] is the one shape of a decision; the store's `Store::transition` stores it
//! through the session's [`ongrid_core::Lifecycle`], which refuses a change the state machine
//! does not allow.

pub mod connections;
pub mod desired;
pub mod facts;
pub mod holds;
pub mod queue;
pub mod reports;
pub mod requests;

use chrono::{DateTime, Utc};
use ongrid_core::holds::HoldReason;
use ongrid_core::{
    Dn, GpuId, GpuRequest, NodeName, SessionId, SessionName, SessionState, UserName,
};

/// A session as stored, with its owner's login and UID (for containers and views).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionRecord {
    pub id: SessionId,
    pub name: SessionName,
    pub owner: Dn,
    pub user_name: UserName,
    pub uid: u32,
    pub state: SessionState,
    /// Reason of the last transition.
    pub reason: String,
    pub request: GpuRequest,
    pub image: String,
    /// Where it is placed; kept after it ends, to show where it ran.
    pub node: Option<NodeName>,
    pub gpus: Vec<GpuId>,
    pub created_at: DateTime<Utc>,
    /// When it (last) joined the queue; the queue is ordered by `(queued_at, id)`.
    pub queued_at: DateTime<Utc>,
    pub preferred_node: Option<NodeName>,
}

/// How a transition changes the session's placement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// Node and GPUs stay as they are.
    Keep,
    /// Placed on `node`, given `gpus`.
    Place { node: NodeName, gpus: Vec<GpuId> },
    /// Back in the queue: no node, no GPUs.
    Clear,
}

/// One change of a session's state: what a rule decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub to: SessionState,
    pub at: DateTime<Utc>,
    /// Why, in words for people; for a hold, its details (see [`Change::sentence`]).
    pub reason: String,
    /// Why a hold, when `to` is HELD by a rule that says why: stored in a column of its own.
    pub hold: Option<HoldReason>,
    pub placement: Placement,
}

impl Change {
    /// A change that leaves the placement as it is.
    pub fn keep_placement(to: SessionState, at: DateTime<Utc>, reason: impl Into<String>) -> Self {
        Self {
            to,
            at,
            reason: reason.into(),
            hold: None,
            placement: Placement::Keep,
        }
    }

    /// A hold for `reason`, with its `details`: HELD, the placement kept (the container stays
    /// on its node).
    pub fn hold(reason: HoldReason, at: DateTime<Utc>, details: impl Into<String>) -> Self {
        Self {
            hold: Some(reason),
            ..Self::keep_placement(SessionState::Held, at, details)
        }
    }

    /// The reason as people read it: for a hold `<hold reason>: <details>`, else `reason`.
    pub fn sentence(&self) -> String {
        rendered_reason(&self.reason, self.hold)
    }
}

/// The reason of a transition as people read it, from what is stored: the words, and the typed
/// reason of a hold, rendered in front of them.
pub fn rendered_reason(reason: &str, hold: Option<HoldReason>) -> String {
    match hold {
        Some(hold) => hold.sentence(reason),
        None => reason.to_owned(),
    }
}

#[cfg(test)]
pub(crate) mod fixtures {
    //! Sessions for the rules' unit tests.

    use chrono::Utc;
    use ongrid_core::{Dn, GpuRequest, NodeName, SessionId, SessionName, SessionState, UserName};

    use super::SessionRecord;

    /// Alice's session `name` in `state`, on node1 when it holds GPUs.
    pub fn session(name: &str, state: SessionState) -> SessionRecord {
        SessionRecord {
            id: SessionId::new_random(),
            name: SessionName::parse(name).unwrap(),
            owner: Dn::parse("/CN=Alice").unwrap(),
            user_name: UserName::parse("alice").unwrap(),
            uid: 20_000,
            state,
            reason: "because".to_owned(),
            request: GpuRequest::default(),
            image: "ongrid/dev:latest".to_owned(),
            node: state
                .holds_gpus()
                .then(|| NodeName::parse("node1").unwrap()),
            gpus: Vec::new(),
            created_at: Utc::now(),
            queued_at: Utc::now(),
            preferred_node: None,
        }
    }
}
