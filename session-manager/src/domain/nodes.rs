//! Node and GPU operations: what an admin's drain records, when a node may be forgotten, and
//! what becomes of the sessions on a node whose agent stopped syncing.
//!
//! A GPU its node reports unhealthy (failed, or unknown because nvidia-smi hangs) is drained at
//! once by the health check ([`health_drain`], `by` = [`HEALTH_CHECK`]); the sessions and jobs
//! on it fail with a reason saying so ([`session_on_bad_gpu`], [`job_on_bad_gpu`]; restartable
//! jobs are re-queued). It stays drained when it comes back until an admin undrains it, unless
//! the manager's `auto_undrain` says otherwise ([`lift_health_drain`]).
//!
//! A drain takes a node or a GPU out of service for new work only: the scheduler places nothing
//! new there (`ongrid_scheduler` leaves drained nodes and GPUs out of its index), while what runs
//! there keeps running. A node that has not synced for `node_timeout` is *lost*: its running
//! sessions become FAILED with [`lost_with_node`]'s reason (their GPUs are no longer counted as
//! used), its jobs go through [`super::jobs::node_lost`]. When the agent comes back it converges
//! to the stored state: a FAILED session's container is stopped, never started a second time.

use std::time::Duration;

use chrono::{DateTime, Utc};
use ongrid_core::gpu::Drain;
use ongrid_core::job::{JobId, JobReason, JobState};
use ongrid_core::{
    GpuHealth, GpuUuid, HumanDuration, NodeName, SessionName, SessionState, UserName,
};

use super::jobs::{JobChange, JobRecord};
use super::sessions::{Change, SessionRecord};
use super::{utc, Refusal};

/// The reason a drain gets when the admin gives none.
pub const DEFAULT_DRAIN_REASON: &str = "maintenance";

/// The longest drain reason kept, in characters.
pub const MAX_DRAIN_REASON: usize = 300;

/// The drain an admin asks for: the reason trimmed, [`DEFAULT_DRAIN_REASON`] when empty.
pub fn drain(reason: Option<&str>, by: &UserName, now: DateTime<Utc>) -> Result<Drain, Refusal> {
    let reason = reason.map(str::trim).unwrap_or_default();
    if reason.chars().count() > MAX_DRAIN_REASON {
        return Err(Refusal::Invalid(format!(
            "the drain reason is {} characters long; give at most {MAX_DRAIN_REASON}",
            reason.chars().count()
        )));
    }
    if reason.chars().any(char::is_control) {
        return Err(Refusal::Invalid(
            "the drain reason must be one line of text without control characters".to_owned(),
        ));
    }
    Ok(Drain {
        reason: if reason.is_empty() {
            DEFAULT_DRAIN_REASON.to_owned()
        } else {
            reason.to_owned()
        },
        since: now,
        by: by.to_string(),
    })
}

/// Who drains a GPU its node reports unhealthy.
pub const HEALTH_CHECK: &str = "health check";

/// The drain of a GPU reported unhealthy, unless it is drained already; `None` for a healthy one.
pub fn health_drain(
    health: &GpuHealth,
    drained: Option<&Drain>,
    now: DateTime<Utc>,
) -> Option<Drain> {
    let problem = health.problem()?;
    drained.is_none().then(|| Drain {
        reason: problem,
        since: now,
        by: HEALTH_CHECK.to_owned(),
    })
}

/// Whether the health check's drain of a GPU that is healthy again is lifted: only with the
/// manager's `auto_undrain`, and never an admin's drain.
pub fn lift_health_drain(health: &GpuHealth, drained: Option<&Drain>, auto_undrain: bool) -> bool {
    auto_undrain && health.is_healthy() && drained.is_some_and(|d| d.by == HEALTH_CHECK)
}

/// A session holding `gpu`, which its node reports unhealthy (`problem`, as
/// [`GpuHealth::problem`] says it): FAILED, keeping its placement, so the agent stops its
/// container. `None` when it holds no GPU.
pub fn session_on_bad_gpu(
    session: &SessionRecord,
    gpu: &GpuUuid,
    problem: &str,
    now: DateTime<Utc>,
) -> Option<Change> {
    if !session.state.holds_gpus() {
        return None;
    }
    Some(Change::keep_placement(
        SessionState::Failed,
        now,
        format!(
            "GPU {gpu} is out of service ({problem}): your files in the home volume are kept; \
             `devctl session rm {name}` and start a new session, which gets another GPU",
            name = session.name,
        ),
    ))
}

/// A job holding `gpu`, which its node reports unhealthy: a restartable job is HALTED (its
/// chain goes on, on another GPU), any other FAILED. `None` when it holds no GPU.
pub fn job_on_bad_gpu(
    job: &JobRecord,
    gpu: &GpuUuid,
    problem: &str,
    now: DateTime<Utc>,
) -> Option<JobChange> {
    if !job.state().holds_gpus() {
        return None;
    }
    let requeued = job.spec.restartable;
    let to = if requeued {
        JobState::Halted
    } else {
        JobState::Failed
    };
    Some(JobChange {
        to,
        at: now,
        reason: JobReason::GpuFailed {
            gpu: gpu.clone(),
            problem: problem.to_owned(),
            requeued,
        },
        place: None,
        exit_code: None,
    })
}

/// Whether a node has been silent for longer than `node_timeout` at `now`.
pub fn is_lost(last_seen: DateTime<Utc>, node_timeout: Duration, now: DateTime<Utc>) -> bool {
    now.signed_duration_since(last_seen)
        .to_std()
        .is_ok_and(|silent| silent > node_timeout)
}

/// Whether the work on a node that stopped syncing is given up at `now`: it has been silent
/// for longer than `node_timeout`, counted from the manager's start at the earliest. While the
/// manager was down no agent could sync, so a manager back after longer than `node_timeout`
/// first gives every node `node_timeout` to report again (nothing new is placed on a node
/// meanwhile: placement asks [`is_lost`] of its last sync alone).
pub fn work_given_up(
    last_seen: DateTime<Utc>,
    manager_started: DateTime<Utc>,
    node_timeout: Duration,
    now: DateTime<Utc>,
) -> bool {
    is_lost(last_seen.max(manager_started), node_timeout, now)
}

/// A running session (WAITING, CONNECTED or IDLE) on `node`, lost with it: FAILED, keeping
/// where it was so that the container there is stopped (never started again) when the node
/// comes back. `None` for sessions in other states (STARTING ones go back to the queue).
pub fn lost_with_node(
    session: &SessionRecord,
    node: &NodeName,
    last_seen: DateTime<Utc>,
    node_timeout: Duration,
    now: DateTime<Utc>,
) -> Option<Change> {
    if !matches!(
        session.state,
        SessionState::Waiting | SessionState::Connected | SessionState::Idle
    ) {
        return None;
    }
    Some(Change::keep_placement(
        SessionState::Failed,
        now,
        format!(
            "node lost: the agent of {node} has not synced since {} (node_timeout {}); its \
             container is stopped if {node} comes back, and your home volume is kept: \
             `devctl session rm {name}` and start a new session",
            utc(last_seen),
            HumanDuration(node_timeout),
            name = session.name,
        ),
    ))
}

/// What is left of a node's work: its sessions that have not ended and its jobs holding GPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeContents {
    /// Names and states of the sessions placed there, ENDED ones left out.
    pub sessions: Vec<(SessionName, SessionState)>,
    /// Jobs holding GPUs there.
    pub jobs: Vec<JobId>,
    /// When its agent last synced.
    pub last_seen: DateTime<Utc>,
}

/// Whether an admin may forget a node: offline for longer than `node_timeout` and nothing of
/// it left (no session but ENDED ones, no job holding GPUs). The error says what to do first.
pub fn removal(
    node: &NodeName,
    contents: &NodeContents,
    node_timeout: Duration,
    now: DateTime<Utc>,
) -> Result<(), Refusal> {
    if !is_lost(contents.last_seen, node_timeout, now) {
        return Err(Refusal::Conflict(format!(
            "node {node} is online (last sync {}): stop its agent first; \
             `devctl admin node drain {node} --wait` empties it",
            utc(contents.last_seen)
        )));
    }
    if !contents.sessions.is_empty() || !contents.jobs.is_empty() {
        let sessions: Vec<String> = contents
            .sessions
            .iter()
            .map(|(name, state)| format!("{name} ({state})"))
            .collect();
        let mut left = Vec::new();
        if !sessions.is_empty() {
            left.push(format!("sessions {}", sessions.join(", ")));
        }
        if !contents.jobs.is_empty() {
            let jobs: Vec<String> = contents.jobs.iter().map(ToString::to_string).collect();
            left.push(format!("jobs {}", jobs.join(", ")));
        }
        return Err(Refusal::Conflict(format!(
            "node {node} still has {}: they must end first (`devctl session rm NAME --owner DN`, \
             `devctl job cancel ID`)",
            left.join(" and ")
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;
    use ongrid_core::{Dn, SessionName};

    use super::*;
    use crate::domain::fixtures::node;

    fn t(seconds: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_700_000_000 + seconds, 0).unwrap()
    }

    fn session(state: SessionState) -> SessionRecord {
        SessionRecord {
            owner: Dn::parse("/DC=org/CN=Alice").unwrap(),
            reason: String::new(),
            image: "ongrid/dev".to_owned(),
            node: Some(node()),
            created_at: t(0),
            queued_at: t(0),
            ..crate::domain::sessions::fixtures::session("train1", state)
        }
    }

    #[test]
    fn a_drain_has_a_reason_a_time_and_an_admin() {
        let alice = UserName::parse("alice").unwrap();
        let drain = drain(Some("  new PSU  "), &alice, t(5)).unwrap();
        assert_eq!(drain.reason, "new PSU");
        assert_eq!(drain.since, t(5));
        assert_eq!(drain.by, "alice");
        assert_eq!(
            super::drain(None, &alice, t(5)).unwrap().reason,
            DEFAULT_DRAIN_REASON
        );
        assert_eq!(
            super::drain(Some(" "), &alice, t(5)).unwrap().reason,
            DEFAULT_DRAIN_REASON
        );
        assert!(matches!(
            super::drain(Some("a\nb"), &alice, t(5)),
            Err(Refusal::Invalid(_))
        ));
        let long = "x".repeat(MAX_DRAIN_REASON + 1);
        assert!(matches!(
            super::drain(Some(&long), &alice, t(5)),
            Err(Refusal::Invalid(_))
        ));
    }

    #[test]
    fn running_sessions_fail_with_their_node_and_say_what_to_do() {
        let timeout = Duration::from_secs(30);
        for state in [
            SessionState::Waiting,
            SessionState::Connected,
            SessionState::Idle,
        ] {
            let change = lost_with_node(&session(state), &node(), t(0), timeout, t(31)).unwrap();
            assert_eq!(change.to, SessionState::Failed);
            assert_eq!(change.at, t(31));
            assert!(
                change.reason.starts_with(
                    "node lost: the agent of node1 has not synced since 2023-11-14 22:13:20 UTC"
                ),
                "{}",
                change.reason
            );
            assert!(change.reason.contains("devctl session rm train1"));
            assert_eq!(change.placement, crate::domain::sessions::Placement::Keep);
        }
        for state in [
            SessionState::Pending,
            SessionState::Starting,
            SessionState::Held,
            SessionState::Failed,
            SessionState::Ended,
        ] {
            assert_eq!(
                lost_with_node(&session(state), &node(), t(0), timeout, t(31)),
                None
            );
        }
    }

    #[test]
    fn an_unhealthy_gpu_is_drained_once_and_its_sessions_fail() {
        let failed = GpuHealth::Failed("Xid 79: GPU has fallen off the bus".to_owned());
        let drain = health_drain(&failed, None, t(7)).unwrap();
        assert_eq!(drain.reason, "failed: Xid 79: GPU has fallen off the bus");
        assert_eq!((drain.since, drain.by.as_str()), (t(7), HEALTH_CHECK));
        // Drained already (by an admin or an earlier check): kept as it is.
        assert_eq!(health_drain(&failed, Some(&drain), t(9)), None);
        assert_eq!(health_drain(&GpuHealth::Healthy, None, t(9)), None);
        let unknown = GpuHealth::Unknown("nvidia-smi hangs".to_owned());
        assert_eq!(
            health_drain(&unknown, None, t(9)).unwrap().reason,
            "unknown: nvidia-smi hangs"
        );

        let gpu = GpuUuid::parse("GPU-11111111-2222-3333-4444-555555555501").unwrap();
        let change =
            session_on_bad_gpu(&session(SessionState::Connected), &gpu, &drain.reason, t(8))
                .unwrap();
        assert_eq!(change.to, SessionState::Failed);
        assert_eq!(
            change.reason,
            "GPU GPU-11111111-2222-3333-4444-555555555501 is out of service (failed: Xid 79: GPU \
             has fallen off the bus): your files in the home volume are kept; `devctl session rm \
             train1` and start a new session, which gets another GPU"
        );
        assert_eq!(
            session_on_bad_gpu(&session(SessionState::Held), &gpu, "x", t(8)),
            None
        );
    }

    #[test]
    fn only_the_health_checks_drain_is_lifted_and_only_when_asked() {
        let alice = UserName::parse("alice").unwrap();
        let admin = drain(None, &alice, t(0)).unwrap();
        let check = health_drain(&GpuHealth::Failed("gone".into()), None, t(0)).unwrap();
        let healthy = GpuHealth::Healthy;
        assert!(lift_health_drain(&healthy, Some(&check), true));
        assert!(!lift_health_drain(&healthy, Some(&check), false));
        assert!(!lift_health_drain(&healthy, Some(&admin), true));
        assert!(!lift_health_drain(
            &GpuHealth::Unknown("hang".into()),
            Some(&check),
            true
        ));
    }

    #[test]
    fn only_an_empty_offline_node_is_removed() {
        let timeout = Duration::from_secs(30);
        let empty = NodeContents {
            last_seen: t(0),
            ..NodeContents::default()
        };
        assert!(matches!(
            removal(&node(), &empty, timeout, t(30)),
            Err(Refusal::Conflict(m)) if m.starts_with("node node1 is online")
        ));
        assert_eq!(removal(&node(), &empty, timeout, t(31)), Ok(()));
        let busy = NodeContents {
            sessions: vec![(SessionName::parse("train1").unwrap(), SessionState::Held)],
            ..empty
        };
        assert!(matches!(
            removal(&node(), &busy, timeout, t(31)),
            Err(Refusal::Conflict(m)) if m.contains("sessions train1 (HELD)")
        ));
    }

    #[test]
    fn work_is_given_up_only_after_node_timeout_of_the_managers_own_time() {
        let timeout = Duration::from_secs(30);
        let (start, seen) = (t(0), t(-600));
        // The manager was down for ten minutes: nothing is lost at its start...
        assert!(!work_given_up(seen, start, timeout, start));
        assert!(!work_given_up(seen, start, timeout, t(30)));
        // ...only once the node stays silent for node_timeout after it.
        assert!(work_given_up(seen, start, timeout, t(31)));
        // A node that synced after the start counts from its last sync.
        assert!(!work_given_up(t(100), start, timeout, t(130)));
        assert!(work_given_up(t(100), start, timeout, t(131)));
    }
}
