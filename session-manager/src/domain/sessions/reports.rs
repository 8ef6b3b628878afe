//! What an agent's report of a container means for its session: a STARTING session whose
//! container runs becomes WAITING; a session that should run whose container exited, or could
//! not be created, becomes FAILED with a reason the user can act on.

use chrono::{DateTime, Utc};
use ongrid_core::api::{ContainerState, ObservedContainer};
use ongrid_core::{NodeName, SessionState};

use super::{Change, SessionRecord};

/// The change an observed container causes, if any. `resuming`: the session is STARTING again
/// after a release, so its container exists from before; an exited one without a problem is the
/// held container the agent has not started yet (its report comes before it converges), not a
/// death.
pub fn observe(
    session: &SessionRecord,
    container: &ObservedContainer,
    node: &NodeName,
    resuming: bool,
    now: DateTime<Utc>,
) -> Option<Change> {
    let agent_error = container.error.as_deref().filter(|e| !e.trim().is_empty());
    let (to, reason) = match &container.state {
        ContainerState::Running if session.state == SessionState::Starting => (
            SessionState::Waiting,
            format!("container running on {node}"),
        ),
        ContainerState::Exited { .. }
            if resuming && session.state == SessionState::Starting && container.error.is_none() =>
        {
            return None;
        }
        ContainerState::Exited {
            exit_code,
            oom_killed,
            error,
        } if session.state.wants_container_running() => {
            let docker_error = error.as_deref().filter(|e| !e.trim().is_empty());
            let reason = if *oom_killed {
                format!(
                    "container exited with code {exit_code} (out of memory: raise the memory \
                     limit or use less)"
                )
            } else if let Some(error) = agent_error.or(docker_error) {
                format!("container exited with code {exit_code}: {error}")
            } else {
                format!(
                    "container exited with code {exit_code}: remove it with `devctl session rm \
                     {}` and start a new one",
                    session.name
                )
            };
            (SessionState::Failed, reason)
        }
        ContainerState::Missing if session.state.wants_container_running() => {
            (SessionState::Failed, agent_error?.to_owned())
        }
        _ => return None,
    };
    Some(Change::keep_placement(to, now, reason))
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::session;
    use super::*;

    fn seen(
        session: &SessionRecord,
        state: ContainerState,
        error: Option<&str>,
    ) -> ObservedContainer {
        ObservedContainer {
            session_id: session.id,
            container_id: "abc".to_owned(),
            state,
            error: error.map(str::to_owned),
        }
    }

    fn exited(code: i64, oom: bool, error: Option<&str>) -> ContainerState {
        ContainerState::Exited {
            exit_code: code,
            oom_killed: oom,
            error: error.map(str::to_owned),
        }
    }

    #[test]
    fn observations_become_transitions() {
        let node = NodeName::parse("node1").unwrap();
        let now = Utc::now();
        let starting = session("train1", SessionState::Starting);
        let waiting = session("train1", SessionState::Waiting);
        let held = session("train1", SessionState::Held);
        let observe = |s: &SessionRecord, c: &ObservedContainer| {
            observe(s, c, &node, false, now).map(|c| (c.to, c.reason))
        };

        let running = |s: &SessionRecord| observe(s, &seen(s, ContainerState::Running, None));
        assert_eq!(
            running(&starting),
            Some((
                SessionState::Waiting,
                "container running on node1".to_owned()
            ))
        );
        assert_eq!(running(&waiting), None);

        let oom = observe(&waiting, &seen(&waiting, exited(137, true, None), None));
        assert_eq!(
            oom,
            Some((
                SessionState::Failed,
                "container exited with code 137 (out of memory: raise the memory limit or use less)"
                    .to_owned()
            ))
        );
        let with_error = observe(
            &starting,
            &seen(
                &starting,
                exited(127, false, Some("exec: \"bash\": not found")),
                None,
            ),
        );
        assert_eq!(
            with_error.unwrap().1,
            "container exited with code 127: exec: \"bash\": not found"
        );
        let plain = observe(&waiting, &seen(&waiting, exited(1, false, None), None));
        assert!(plain.unwrap().1.contains("devctl session rm train1"));
        // A held session's container is stopped on purpose.
        assert_eq!(
            observe(&held, &seen(&held, exited(0, false, None), None)),
            None
        );

        let missing = observe(
            &starting,
            &seen(
                &starting,
                ContainerState::Missing,
                Some("image ongrid/nope:1 not found: ask your admin which images the site has"),
            ),
        );
        assert_eq!(
            missing,
            Some((
                SessionState::Failed,
                "image ongrid/nope:1 not found: ask your admin which images the site has"
                    .to_owned()
            ))
        );
        // Still being created: nothing to say yet.
        assert_eq!(
            observe(&starting, &seen(&starting, ContainerState::Missing, None)),
            None
        );
        assert_eq!(
            observe(&starting, &seen(&starting, ContainerState::Created, None)),
            None
        );
    }

    #[test]
    fn a_released_sessions_stopped_container_is_not_a_death() {
        let node = NodeName::parse("node1").unwrap();
        let now = Utc::now();
        let starting = session("train1", SessionState::Starting);
        let stopped = seen(&starting, exited(0, false, None), None);
        assert_eq!(observe(&starting, &stopped, &node, true, now), None);
        // A session that never ran: its container died starting.
        let failed = observe(&starting, &stopped, &node, false, now).unwrap();
        assert_eq!(failed.to, SessionState::Failed);
        // A resumed container that could not start is reported with its error.
        let broken = seen(
            &starting,
            exited(1, false, None),
            Some("cannot start: no GPU"),
        );
        let failed = observe(&starting, &broken, &node, true, now).unwrap();
        assert_eq!(
            failed.reason,
            "container exited with code 1: cannot start: no GPU"
        );
        // Once it runs, it is WAITING as any other.
        let running = seen(&starting, ContainerState::Running, None);
        let change = observe(&starting, &running, &node, true, now).unwrap();
        assert_eq!(change.to, SessionState::Waiting);
    }
}
