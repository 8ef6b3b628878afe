//! What a node's agent is told: its GPU-holding sessions run; its HELD and FAILED sessions, and
//! released ones waiting PENDING for a GPU on it, are stopped, so their containers (and whatever
//! the user installed in them) stay until the owner removes the session; anything else (ENDED,
//! unknown) is absent, so the agent removes it.

use std::collections::HashSet;
use std::time::Duration;

use ongrid_core::api::{ContainerLimits, ContainerUser, DesiredSession, DesiredState, RunState};
use ongrid_core::image::FreezeOrder;
use ongrid_core::{NodeName, SessionId, SessionState};

use super::SessionRecord;

/// What the desired state of every node shares: the manager's config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeSettings {
    pub sync_interval: Duration,
    pub limits: ContainerLimits,
}

/// How a session's container should be, if it should exist at all.
pub fn run_state(session: &SessionRecord) -> Option<RunState> {
    if session.state.wants_container_running() {
        Some(RunState::Running)
    } else if matches!(session.state, SessionState::Held | SessionState::Failed)
        || (session.state == SessionState::Pending && session.node.is_some())
    {
        // A released session waiting for a GPU on its node keeps its container too.
        Some(RunState::Stopped)
    } else {
        None
    }
}

/// The desired state of `node`, from the sessions placed there, which of them are `resuming`
/// (STARTING again after a release: the agent starts their stopped container, even if it no
/// longer remembers stopping it) and the node's freeze orders.
pub fn desired_state(
    node: &NodeName,
    sessions: Vec<SessionRecord>,
    resuming: &HashSet<SessionId>,
    freezes: Vec<FreezeOrder>,
    settings: NodeSettings,
) -> DesiredState {
    let sessions = sessions
        .into_iter()
        .filter_map(|session| {
            let run = run_state(&session)?;
            Some(DesiredSession {
                session_id: session.id,
                name: session.name,
                owner: session.owner,
                user: ContainerUser {
                    name: session.user_name,
                    uid: session.uid,
                },
                image: session.image,
                gpus: session.gpus,
                run,
                limits: settings.limits,
                labels: Default::default(),
                resume: resuming.contains(&session.id),
            })
        })
        .collect();
    DesiredState {
        node: node.clone(),
        sync_interval_secs: settings.sync_interval.as_secs().max(1),
        sessions,
        freezes,
        removed_images: Vec::new(),
        jobs: Vec::new(),
        mig_layouts: Default::default(),
        mig_off: Default::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::session;
    use super::*;

    #[test]
    fn sessions_run_stop_or_go_by_state() {
        use SessionState::*;
        for state in SessionState::ALL {
            let expected = match state {
                Starting | Waiting | Connected | Idle => Some(RunState::Running),
                Held | Failed => Some(RunState::Stopped),
                Pending | Ended => None,
            };
            let mut s = session("train1", state);
            s.node = Some(NodeName::parse("node1").unwrap());
            if state == Pending {
                // Released, waiting for a GPU where its container is.
                assert_eq!(run_state(&s), Some(RunState::Stopped), "pinned {state}");
                s.node = None;
            }
            assert_eq!(run_state(&s), expected, "{state}");
        }
    }

    #[test]
    fn the_desired_state_lists_what_exists_and_marks_resumes() {
        let node = NodeName::parse("node1").unwrap();
        let resumed = session("back", SessionState::Starting);
        let fresh = session("new", SessionState::Starting);
        let ended = session("old", SessionState::Ended);
        let settings = NodeSettings {
            sync_interval: Duration::from_millis(200),
            limits: ContainerLimits {
                millicpus: 1000,
                memory: ongrid_core::MemorySize::from_mib(1024),
                pids: 100,
            },
        };
        let resuming = HashSet::from([resumed.id]);
        let desired = desired_state(
            &node,
            vec![resumed.clone(), fresh.clone(), ended],
            &resuming,
            Vec::new(),
            settings,
        );
        assert_eq!(desired.sync_interval_secs, 1, "at least a second");
        let listed: Vec<(SessionId, bool)> = desired
            .sessions
            .iter()
            .map(|s| (s.session_id, s.resume))
            .collect();
        assert_eq!(listed, [(resumed.id, true), (fresh.id, false)]);
        assert_eq!(desired.sessions[0].limits, settings.limits);
        assert_eq!(desired.sessions[0].user.uid, 20_000);
    }
}
