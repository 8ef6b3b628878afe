//! Where transitions are decided: every rule that moves a session, an image or a batch job from
//! one state to another, as functions of what is known (records, reports, facts) and `now` that return a
//! decision. No I/O, no clock, no store: the API handlers, the loops (`scheduler`,
//! `hold_timer`, `freeze_watch`) and the store (inside a transaction, where a decision must see
//! what it is written over) call these and store what they return.
//!
//! - [`sessions`]: requests, placements, agent reports, the desired state of nodes, connection
//!   events, the hold policy.
//! - [`images`]: freezes, freeze orders, agents' progress, giving up.
//! - [`image_access`]: which Docker image a session may run (the site's, or the caller's own
//!   frozen images by tag or digest) and which removed frozen images must leave the nodes.
//! - [`jobs`]: batch jobs: submit, the scheduler's actions, agents' reports, the owner's cancel
//!   and halt, a lost node, restart chains, a node's desired jobs.
//! - [`grid_jobs`]: jobs handed to grid targets (Slurm, HTCondor): the target and local account
//!   of a submission, what to tell the engine, what the engine's state means for the job.
//! - [`engine_job`]: what is stored of a job on a grid target ([`engine_job::GridJob`]) and
//!   its engine job id and local account.
//! - [`users`]: removing a user (what goes, what refuses it) and re-admitting them.
//! - [`nodes`]: drains of nodes and GPUs, sessions lost with their node, removing a node.
//! - [`policy`]: site policy: who may use the site, under which accounting group.
//! - [`idempotency`]: creates sent again with the same `Idempotency-Key` find the first one's
//!   record (its id derived from the caller and the key).

pub mod engine_job;
pub mod grid_jobs;
pub mod idempotency;
pub mod image_access;
pub mod images;
pub mod jobs;
pub mod nodes;
pub mod policy;
pub mod sessions;
pub mod users;

use chrono::{DateTime, Utc};

/// Why a rule refuses what someone asked, in words that say what to do instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The request itself is wrong, whatever the state (HTTP 400).
    #[error("{0}")]
    Invalid(String),
    /// The request does not fit the current state (HTTP 409).
    #[error("{0}")]
    Conflict(String),
    /// The caller may not use what they named, whatever the state (HTTP 403).
    #[error("{0}")]
    Forbidden(String),
}

/// A time for people: `2026-11-21 10:00:00 UTC`.
pub fn utc(at: DateTime<Utc>) -> String {
    at.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

#[cfg(test)]
pub(crate) mod fixtures {
    //! What the rules' unit tests share.

    use chrono::{DateTime, Utc};
    use ongrid_core::{Dn, NodeName};

    /// `seconds` after a fixed instant (2027-01-15 08:00:00 UTC).
    pub fn t(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + seconds, 0).unwrap()
    }

    pub fn alice() -> Dn {
        Dn::parse("/CN=Alice").unwrap()
    }

    pub fn node() -> NodeName {
        NodeName::parse("node1").unwrap()
    }
}
