//! Routes for node agents: registration and the periodic sync (heartbeat + desired state).
//!
//! A sync records that the node is alive and its GPUs' health, then reads what the agent saw:
//! a STARTING session whose container runs becomes WAITING; a session that should run whose
//! container exited, or could not be created, becomes FAILED with a reason the user can act on.
//! The answer is the node's [`DesiredState`]: sessions holding GPUs there run, HELD ones are
//! stopped, anything else (ENDED, FAILED, unknown) is absent, so the agent removes it.

use std::collections::{BTreeSet, HashSet};

use axum::extract::State;
use axum::Json;
use ongrid_core::api::{
    ContainerState, ContainerUser, DesiredSession, DesiredState, NodeReport, ObservedContainer,
    RegisterNode, RunState,
};
use ongrid_core::{GpuInfo, NodeName, SessionState};

use super::{ApiError, ApiJson, AppState};
use crate::auth::AgentNode;
use crate::store::{
    Change, FactsScope, NodeRegistration, Placement, SessionFilter, SessionRecord, StoreError,
};

pub async fn register(
    State(state): State<AppState>,
    AgentNode(node): AgentNode,
    ApiJson(body): ApiJson<RegisterNode>,
) -> Result<Json<DesiredState>, ApiError> {
    check_node(&node, &body.node)?;
    check_gpus(&body.gpus)?;
    let stream_url = body.stream_url.map(|url| url.trim().to_owned());
    if let Some(url) = &stream_url {
        check_stream_url(url).map_err(ApiError::bad_request)?;
    }
    let registration = NodeRegistration {
        name: node.clone(),
        gpu_backend: body.gpu_backend,
        agent_version: body.agent_version,
        stream_url: stream_url.clone(),
    };
    state
        .store
        .register_node(registration, &body.gpus, state.clock.now())
        .await?;
    tracing::info!(%node, gpus = body.gpus.len(), stream_url = stream_url.as_deref().unwrap_or("none"), "Node registered.");
    state.wake.notify_one();
    desired_state(&state, &node).await.map(Json)
}

pub async fn sync(
    State(state): State<AppState>,
    AgentNode(node): AgentNode,
    ApiJson(report): ApiJson<NodeReport>,
) -> Result<Json<DesiredState>, ApiError> {
    check_node(&node, &report.node)?;
    check_gpus(&report.gpus)?;
    let now = state.clock.now();
    if !state.store.record_sync(&node, &report.gpus, now).await? {
        return Err(ApiError::not_found(format!(
            "node {node} is not registered: the agent must POST /v1/agent/register first"
        )));
    }
    for container in &report.containers {
        let Some(session) = state.store.session(container.session_id).await? else {
            continue;
        };
        if session.node.as_ref() != Some(&node) {
            continue;
        }
        if super::lifecycle::held_container_not_started_yet(&state, &session, container).await? {
            continue;
        }
        let Some((to, reason)) = observe(&session, container, &node) else {
            continue;
        };
        let change = Change {
            to,
            at: now,
            reason: reason.clone(),
            placement: Placement::Keep,
        };
        match state.store.transition(session.id, change).await {
            Ok(_) => {
                tracing::info!(session_id = %session.id, %node, state = %to, %reason, "Session changed on its node's report.");
            }
            // Changed meanwhile (for example removed by its owner): the next sync sees it.
            Err(StoreError::InvalidTransition(_)) => {}
            Err(other) => return Err(other.into()),
        }
    }
    super::images::record_freezes(&state, &node, &report).await?;
    state
        .store
        .record_activity(
            &node,
            &report.activity,
            now,
            state.config.lifecycle.thresholds,
        )
        .await?;
    state.wake.notify_one();
    desired_state(&state, &node).await.map(Json)
}

fn check_node(token_node: &NodeName, body_node: &NodeName) -> Result<(), ApiError> {
    if token_node != body_node {
        return Err(ApiError::forbidden(format!(
            "this token belongs to node {token_node}; it cannot speak for node {body_node}"
        )));
    }
    Ok(())
}

fn check_gpus(gpus: &[GpuInfo]) -> Result<(), ApiError> {
    let mut seen = BTreeSet::new();
    for gpu in gpus {
        if !seen.insert(&gpu.uuid) {
            return Err(ApiError::bad_request(format!(
                "GPU {} is listed twice in the report",
                gpu.uuid
            )));
        }
    }
    Ok(())
}

/// Checks the agent's stream endpoint well enough to refuse mistakes: the gateway dials it with
/// TLS, so it must be `wss://host[:port][/path]`.
pub fn check_stream_url(url: &str) -> Result<(), String> {
    let Some(rest) = url.strip_prefix("wss://") else {
        return Err(format!(
            "stream_url {url:?} must start with wss:// (the gateway reaches agents over TLS): \
             check [streams] url in the agent's config"
        ));
    };
    let host = rest.split('/').next().unwrap_or_default();
    if host.is_empty()
        || url.len() > 2048
        || url.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(format!(
            "stream_url {url:?} is not a URL like wss://node1.example.org:8444: check [streams] \
             url in the agent's config"
        ));
    }
    Ok(())
}

/// What an observed container means for its session, if anything: the new state and why.
pub fn observe(
    session: &SessionRecord,
    container: &ObservedContainer,
    node: &NodeName,
) -> Option<(SessionState, String)> {
    let agent_error = container.error.as_deref().filter(|e| !e.trim().is_empty());
    match &container.state {
        ContainerState::Running if session.state == SessionState::Starting => Some((
            SessionState::Waiting,
            format!("container running on {node}"),
        )),
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
            Some((SessionState::Failed, reason))
        }
        ContainerState::Missing if session.state.wants_container_running() => {
            agent_error.map(|error| (SessionState::Failed, error.to_owned()))
        }
        _ => None,
    }
}

/// The node's desired state: its GPU-holding sessions running; its HELD and FAILED sessions
/// stopped, so their containers (and whatever the user installed in them) are kept until the
/// owner removes the session.
async fn desired_state(state: &AppState, node: &NodeName) -> Result<DesiredState, ApiError> {
    let sessions = state
        .store
        .sessions(SessionFilter::Node(node.clone()))
        .await?;
    // A STARTING session that has run before was released from a hold: its container exists,
    // stopped, and is to be started again.
    let mut resuming = HashSet::new();
    for session in sessions
        .iter()
        .filter(|s| s.state == SessionState::Starting)
    {
        let facts = state
            .store
            .lifecycle_facts(FactsScope::Session(session.id))
            .await?;
        if facts.iter().any(|f| f.first_started_at.is_some()) {
            resuming.insert(session.id);
        }
    }
    let sessions = sessions
        .into_iter()
        .filter_map(|session| {
            let run = if session.state.wants_container_running() {
                RunState::Running
            } else if matches!(session.state, SessionState::Held | SessionState::Failed)
                || (session.state == SessionState::Pending && session.node.is_some())
            {
                // A released session waiting for a GPU on its node keeps its container too.
                RunState::Stopped
            } else {
                return None;
            };
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
                limits: state.config.session_limits,
                labels: Default::default(),
                resume: resuming.contains(&session.id),
            })
        })
        .collect();
    Ok(DesiredState {
        node: node.clone(),
        sync_interval_secs: state.config.sync_interval.as_secs().max(1),
        sessions,
        freezes: super::images::freeze_orders(state, node).await?,
    })
}

#[cfg(test)]
mod tests {
    use chrono::Utc;
    use ongrid_core::{Dn, GpuRequest, SessionId, SessionName, UserName};

    use super::*;

    fn session(state: SessionState) -> SessionRecord {
        SessionRecord {
            id: SessionId::new_random(),
            name: SessionName::parse("train1").unwrap(),
            owner: Dn::parse("/CN=Alice").unwrap(),
            user_name: UserName::parse("alice").unwrap(),
            uid: 20_000,
            state,
            reason: String::new(),
            request: GpuRequest::default(),
            image: "ongrid/dev:latest".to_owned(),
            node: Some(NodeName::parse("node1").unwrap()),
            gpus: Vec::new(),
            created_at: Utc::now(),
            queued_at: Utc::now(),
            preferred_node: None,
        }
    }

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
    fn stream_urls_must_be_wss() {
        assert!(check_stream_url("wss://node1.example.org:8444").is_ok());
        assert!(check_stream_url("wss://127.0.0.1:40123").is_ok());
        assert!(check_stream_url("wss://[::1]:8444/streams").is_ok());
        let err = check_stream_url("ws://node1:8444").unwrap_err();
        assert!(err.contains("wss://"), "{err}");
        assert!(check_stream_url("wss://").is_err());
        assert!(check_stream_url("wss:///path").is_err());
        assert!(check_stream_url("wss://node 1:8444").is_err());
    }

    #[test]
    fn observations_become_transitions() {
        let node = NodeName::parse("node1").unwrap();
        let starting = session(SessionState::Starting);
        let waiting = session(SessionState::Waiting);
        let held = session(SessionState::Held);

        let running =
            |s: &SessionRecord| observe(s, &seen(s, ContainerState::Running, None), &node);
        assert_eq!(
            running(&starting),
            Some((
                SessionState::Waiting,
                "container running on node1".to_owned()
            ))
        );
        assert_eq!(running(&waiting), None);

        let oom = observe(
            &waiting,
            &seen(&waiting, exited(137, true, None), None),
            &node,
        );
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
            &node,
        );
        assert_eq!(
            with_error.unwrap().1,
            "container exited with code 127: exec: \"bash\": not found"
        );
        let plain = observe(
            &waiting,
            &seen(&waiting, exited(1, false, None), None),
            &node,
        );
        assert!(plain.unwrap().1.contains("devctl session rm train1"));
        // A held session's container is stopped on purpose.
        assert_eq!(
            observe(&held, &seen(&held, exited(0, false, None), None), &node),
            None
        );

        let missing = observe(
            &starting,
            &seen(
                &starting,
                ContainerState::Missing,
                Some("image ongrid/nope:1 not found: ask your admin which images the site has"),
            ),
            &node,
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
            observe(
                &starting,
                &seen(&starting, ContainerState::Missing, None),
                &node
            ),
            None
        );
        assert_eq!(
            observe(
                &starting,
                &seen(&starting, ContainerState::Created, None),
                &node
            ),
            None
        );
    }
}
