//! Node and GPU operations over the real API: drains (admins only; nothing new placed, what
//! runs keeps running; undrain places the queue), the wait for a drained node to empty, a node
//! that stops syncing (its running sessions FAILED with the reason, their containers stopped
//! when it is back), and removing a node (only offline and empty; its agent brings it back).

use ongrid_core::api::{DrainRequest, RunState};

use super::watch::long_poll;

use super::*;

/// How soon an agent's open long-poll is answered once its node changed.
const ANSWERED_WITHIN: Duration = Duration::from_secs(10);

fn drain(reason: Option<&str>) -> DrainRequest {
    DrainRequest {
        reason: reason.map(str::to_owned),
    }
}

async fn nodes(api: &Api) -> Vec<NodeView> {
    api.ok(StatusCode::OK, api.get("/v1/nodes")).await
}

#[tokio::test]
async fn drained_nodes_and_gpus_get_nothing_new_until_undrained() {
    let site = Site::new();
    let m = site.start().await;
    m.node1.register("node1", vec![a100(1), a100(2)]).await;
    m.node2.register("node2", vec![a100(3)]).await;
    let first = m.alice.create(Some("first"), one_gpu()).await;
    assert_eq!(first.state, SessionState::Starting);
    assert_eq!(first.node.as_ref().map(|n| n.as_str()), Some("node1"));

    // Only admins drain, and the reason is one line.
    let refused = m
        .alice
        .fails(
            StatusCode::FORBIDDEN,
            m.alice.post("/v1/nodes/node1/drain", &drain(None)),
        )
        .await;
    assert_eq!(
        refused.error.message,
        "only admins can drain a node; admins are listed in the manager's config"
    );
    m.admin
        .fails(
            StatusCode::BAD_REQUEST,
            m.admin.post("/v1/nodes/node1/drain", &drain(Some("a\nb"))),
        )
        .await;
    let missing = m
        .admin
        .fails(
            StatusCode::NOT_FOUND,
            m.admin.post("/v1/nodes/node9/drain", &drain(None)),
        )
        .await;
    assert_eq!(
        missing.error.message,
        "no node node9 is registered: see `devctl admin node ls`"
    );

    let drained: NodeView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin
                .post("/v1/nodes/node1/drain", &drain(Some("new PSU"))),
        )
        .await;
    let node_drain = drained.drain.clone().unwrap();
    assert_eq!(node_drain.reason, "new PSU");
    assert_eq!(node_drain.by, "site-admin");
    assert_eq!(drained.sessions, 1, "the running session is counted");
    assert_eq!(drained.agent_version, "test");
    assert!(drained.gpus.iter().all(|g| g.free == 0));
    // Draining again keeps the first drain's reason and time.
    let again: NodeView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin.post("/v1/nodes/node1/drain", &drain(Some("other"))),
        )
        .await;
    assert_eq!(again.drain, Some(node_drain));

    // The running session keeps running; a new one goes to node2.
    let desired = m.node1.sync("node1", vec![a100(1), a100(2)], vec![]).await;
    assert_eq!(desired.sessions.len(), 1);
    assert_eq!(desired.sessions[0].run, RunState::Running);
    let second = m.bob.create(Some("second"), one_gpu()).await;
    assert_eq!(second.state, SessionState::Starting);
    assert_eq!(second.node.as_ref().map(|n| n.as_str()), Some("node2"));

    // A drained GPU gets nothing either: the next session waits.
    let gpu3 = a100(3).uuid;
    let bob_refused = m
        .bob
        .fails(
            StatusCode::FORBIDDEN,
            m.bob.post(&format!("/v1/gpus/{gpu3}/drain"), &drain(None)),
        )
        .await;
    assert!(bob_refused
        .error
        .message
        .starts_with("only admins can drain a GPU"));
    let gpu_view: GpuView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin
                .post(&format!("/v1/gpus/{gpu3}/drain"), &drain(None)),
        )
        .await;
    assert_eq!(gpu_view.drain.as_ref().unwrap().reason, "maintenance");
    assert_eq!(gpu_view.used, 1);
    assert_eq!(gpu_view.free, 0);
    m.admin
        .fails(
            StatusCode::BAD_REQUEST,
            m.admin.post("/v1/gpus/GPU-1/drain", &drain(None)),
        )
        .await;
    let third = m.bob.create(Some("third"), one_gpu()).await;
    assert_eq!(third.state, SessionState::Pending);

    // Everyone sees the drains.
    let listed = nodes(&m.alice).await;
    assert_eq!(listed[0].drain.as_ref().unwrap().reason, "new PSU");
    assert_eq!(
        listed[1].gpus[0].drain.as_ref().unwrap().reason,
        "maintenance"
    );
    assert_eq!(listed[1].sessions, 1);

    // Undrain: the queued session is placed on node1's free GPU.
    let back: NodeView = m
        .admin
        .ok(StatusCode::OK, m.admin.delete("/v1/nodes/node1/drain"))
        .await;
    assert_eq!(back.drain, None);
    let placed = m.bob.wait_for("third", SessionState::Starting).await;
    assert_eq!(placed.node.as_ref().map(|n| n.as_str()), Some("node1"));
    let gpu_back: GpuView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin.delete(&format!("/v1/gpus/{gpu3}/drain")),
        )
        .await;
    assert_eq!(gpu_back.drain, None);
    m.stop().await;
}

#[tokio::test]
async fn a_drain_wait_answers_when_the_node_empties() {
    let site = Site::new();
    let m = site.start().await;
    m.node1.register("node1", vec![a100(1)]).await;
    m.alice.create(Some("train1"), one_gpu()).await;
    let _: NodeView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin.post("/v1/nodes/node1/drain", &drain(None)),
        )
        .await;

    // Not empty: the answer comes after the timeout, still with the session.
    let started = tokio::time::Instant::now();
    let busy: NodeView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin.get("/v1/nodes/node1?wait_empty=true&timeout=1"),
        )
        .await;
    assert_eq!(busy.sessions, 1);
    assert!(started.elapsed() >= Duration::from_secs(1));

    // Waiting, then the session ends: the answer comes at once.
    let admin = m.admin.get("/v1/nodes/node1?wait_empty=true&timeout=30");
    let waiter = tokio::spawn(async move { admin.send().await.unwrap() });
    let _: SessionView = m
        .alice
        .ok(StatusCode::OK, m.alice.delete("/v1/sessions/train1"))
        .await;
    let answer = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the wait answers once the node is empty")
        .unwrap();
    assert_eq!(answer.status(), StatusCode::OK);
    let empty: NodeView = answer.json().await.unwrap();
    assert_eq!((empty.sessions, empty.jobs), (0, 0));
    m.admin
        .fails(
            StatusCode::BAD_REQUEST,
            m.admin.get("/v1/nodes/node1?wait=true"),
        )
        .await;
    m.stop().await;
}

#[tokio::test]
async fn a_silent_node_loses_its_sessions_and_is_removed_only_when_empty() {
    let site = Site::new();
    let clock = Arc::new(ManualClock::new(Utc::now()));
    let m = site
        .start_with(site.config.clone(), Some(clock.clone()))
        .await;
    m.node1.register("node1", vec![a100(1)]).await;
    let train1 = m.alice.create(Some("train1"), one_gpu()).await;
    let running = container(&train1, ContainerState::Running, None);
    m.node1
        .sync("node1", vec![a100(1)], vec![running.clone()])
        .await;
    assert_eq!(m.alice.show("train1").await.state, SessionState::Waiting);

    // An online node is not removed.
    let online = m
        .admin
        .fails(StatusCode::CONFLICT, m.admin.delete("/v1/nodes/node1"))
        .await;
    assert!(
        online.error.message.starts_with("node node1 is online"),
        "{}",
        online.error.message
    );

    // The node stops syncing for longer than node_timeout (1 hour): the next scheduling round
    // (here the one a new session runs) fails its running session with the reason.
    clock.advance(TimeDelta::seconds(3601));
    let waiting = m.bob.create(Some("other"), one_gpu()).await;
    assert_eq!(waiting.state, SessionState::Pending);
    let lost = m.alice.show("train1").await;
    assert_eq!(lost.state, SessionState::Failed);
    assert!(
        lost.reason
            .starts_with("node lost: the agent of node1 has not synced since "),
        "{}",
        lost.reason
    );
    assert!(
        lost.reason.contains("`devctl session rm train1`"),
        "{}",
        lost.reason
    );
    let listed = nodes(&m.admin).await;
    assert!(!listed[0].online);
    assert_eq!(listed[0].sessions, 0);
    assert_eq!(
        listed[0].gpus[0].used, 0,
        "the lost session's GPU is no longer used"
    );

    // Not empty: the FAILED session's container is still there.
    let busy = m
        .admin
        .fails(StatusCode::CONFLICT, m.admin.delete("/v1/nodes/node1"))
        .await;
    assert!(
        busy.error
            .message
            .contains("still has sessions train1 (FAILED)"),
        "{}",
        busy.error.message
    );

    // The node comes back: the lost session's container is stopped, never started again;
    // the waiting session is placed there.
    let desired = m
        .node1
        .sync("node1", vec![a100(1)], vec![running.clone()])
        .await;
    let stopped = desired
        .sessions
        .iter()
        .find(|s| s.session_id == train1.id)
        .unwrap();
    assert_eq!(stopped.run, RunState::Stopped);
    assert_eq!(m.alice.show("train1").await.state, SessionState::Failed);
    m.bob.wait_for("other", SessionState::Starting).await;

    // Emptied and silent again: removed, and gone from the listing.
    for (api, name) in [(&m.alice, "train1"), (&m.bob, "other")] {
        let _: SessionView = api
            .ok(StatusCode::OK, api.delete(&format!("/v1/sessions/{name}")))
            .await;
    }
    let _: NodeView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin.post("/v1/nodes/node1/drain", &drain(None)),
        )
        .await;
    clock.advance(TimeDelta::seconds(3601));
    m.alice
        .fails(StatusCode::FORBIDDEN, m.alice.delete("/v1/nodes/node1"))
        .await;
    // The agent's long-poll, open at its current version, waits; the removal answers it, at once,
    // that the node is not registered.
    let (status, version, _) = long_poll(&m.node1, "0123456789abcdef", 0).await.unwrap();
    assert_eq!(status, StatusCode::OK);
    let open_poll = {
        let request = m
            .node1
            .get(&format!("/v1/agent/desired?after={version}&timeout=120"));
        tokio::spawn(async move {
            let response = request.send().await.unwrap();
            (response.status(), response.text().await.unwrap())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!open_poll.is_finished(), "the poll waits for a change");
    let removed: NodeView = m
        .admin
        .ok(StatusCode::OK, m.admin.delete("/v1/nodes/node1"))
        .await;
    assert_eq!(removed.name.as_str(), "node1");
    let not_registered =
        "node node1 is not registered: the agent must POST /v1/agent/register first";
    let (status, body) = tokio::time::timeout(ANSWERED_WITHIN, open_poll)
        .await
        .expect("the open poll answered when its node was removed")
        .unwrap();
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(body.contains(not_registered), "{body}");
    let refused = m
        .node1
        .fails(StatusCode::NOT_FOUND, m.node1.get("/v1/agent/desired"))
        .await;
    assert_eq!(refused.error.message, not_registered);
    assert!(nodes(&m.admin).await.is_empty());
    m.admin
        .fails(StatusCode::NOT_FOUND, m.admin.delete("/v1/nodes/node1"))
        .await;
    // A removed node's sync is refused until its agent registers again, which brings it back
    // as new (undrained).
    m.node1
        .fails(
            StatusCode::NOT_FOUND,
            m.node1.post(
                "/v1/agent/sync",
                &NodeReport {
                    node: NodeName::parse("node1").unwrap(),
                    gpus: vec![a100(1)],
                    containers: Vec::new(),
                    activity: Vec::new(),
                    freezes: Vec::new(),
                    jobs: Vec::new(),
                },
            ),
        )
        .await;
    m.node1.register("node1", vec![a100(1)]).await;
    let listed = nodes(&m.admin).await;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].drain, None);
    m.stop().await;
}

#[tokio::test]
async fn a_gpu_its_node_reports_failed_is_drained_and_its_session_fails() {
    let site = Site::new();
    let m = site.start().await;
    m.node1.register("node1", vec![a100(1), a100(2)]).await;
    let train1 = m.alice.create(Some("train1"), one_gpu()).await;
    assert_eq!(train1.gpus, [GpuId::Gpu(a100(1).uuid)]);
    let running = container(&train1, ContainerState::Running, None);
    m.node1
        .sync("node1", vec![a100(1), a100(2)], vec![running.clone()])
        .await;
    assert_eq!(m.alice.show("train1").await.state, SessionState::Waiting);

    // The agent's health check sees an Xid 79 on GPU 1: the sync wakes the scheduler, which
    // drains the GPU and fails the session on it with a reason that says what to do.
    let fell_off = GpuInfo {
        health: GpuHealth::Failed(
            "Xid 79 at 2026-11-25 10:00:00 UTC: GPU has fallen off the bus".into(),
        ),
        ..a100(1)
    };
    m.node1
        .sync("node1", vec![fell_off, a100(2)], vec![running.clone()])
        .await;
    let failed = m.alice.wait_for("train1", SessionState::Failed).await;
    assert!(
        failed.reason.starts_with(&format!(
            "GPU {} is out of service (failed: Xid 79 at 2026-11-25 10:00:00 UTC: GPU has \
             fallen off the bus): your files in the home volume are kept; `devctl session rm \
             train1`",
            a100(1).uuid
        )),
        "{}",
        failed.reason
    );
    let desired = m
        .node1
        .sync("node1", vec![a100(1), a100(2)], vec![running])
        .await;
    assert_eq!(
        desired.sessions[0].run,
        RunState::Stopped,
        "its container is stopped"
    );

    // Healthy again, the GPU stays drained (CHTC's practice): a new session gets GPU 2.
    let listed = nodes(&m.admin).await;
    let drain = listed[0].gpus[0]
        .drain
        .clone()
        .expect("drained by the health check");
    assert_eq!(drain.by, "health check");
    assert!(
        drain.reason.starts_with("failed: Xid 79"),
        "{}",
        drain.reason
    );
    let second = m.alice.create(Some("second"), one_gpu()).await;
    assert_eq!(second.gpus, [GpuId::Gpu(a100(2).uuid)]);
    let third = m.alice.create(Some("third"), one_gpu()).await;
    assert_eq!(third.state, SessionState::Pending);

    // An admin puts it back in service: the queued session gets it.
    let path = format!("/v1/gpus/{}/drain", a100(1).uuid);
    let undrained: GpuView = m.admin.ok(StatusCode::OK, m.admin.delete(&path)).await;
    assert_eq!(undrained.drain, None);
    let placed = m.alice.wait_for("third", SessionState::Starting).await;
    assert_eq!(placed.gpus, [GpuId::Gpu(a100(1).uuid)]);
    m.stop().await;
}

/// A GPU the agent asks to start shared (the simulated file's `mode = "shared:4"`) is shared
/// from its first registration, and takes two sessions; after an admin makes it exclusive, a
/// registration asking again changes nothing. A mode the rules refuse, or one for a GPU the agent
/// does not report, refuses the registration, saying which GPU and where to fix it.
#[tokio::test]
async fn a_gpu_starts_in_the_mode_its_agent_asks_until_an_admin_changes_it() {
    let site = Site::new();
    let m = site.start().await;
    let register = |start_modes: Vec<(GpuInfo, &str)>| RegisterNode {
        node: NodeName::parse("node1").unwrap(),
        agent_version: "test".to_owned(),
        gpu_backend: "simulated".to_owned(),
        gpus: vec![a100(1)],
        stream_url: None,
        start_modes: start_modes
            .into_iter()
            .map(|(gpu, mode)| (gpu.uuid, mode.parse().unwrap()))
            .collect(),
    };
    let _: DesiredState = m
        .node1
        .ok(
            StatusCode::OK,
            m.node1
                .post("/v1/agent/register", &register(vec![(a100(1), "shared:4")])),
        )
        .await;
    let gpu = &nodes(&m.admin).await[0].gpus[0];
    assert_eq!(gpu.mode, GpuMode::Shared { max_sessions: 4 });
    let shared = GpuRequest {
        sharing: Sharing::Shared,
        ..GpuRequest::default()
    };
    let one = m.alice.create(Some("one"), shared).await;
    let two = m.alice.create(Some("two"), shared).await;
    assert_eq!(
        (one.state, two.state),
        (SessionState::Starting, SessionState::Starting),
        "two sessions share the GPU"
    );
    assert_eq!(one.gpus, two.gpus);

    let _: GpuView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin.put(
                &format!("/v1/gpus/{}/mode", a100(1).uuid),
                &serde_json::json!({"mode": {"mode": "exclusive"}}),
            ),
        )
        .await;
    let _: DesiredState = m
        .node1
        .ok(
            StatusCode::OK,
            m.node1
                .post("/v1/agent/register", &register(vec![(a100(1), "shared:4")])),
        )
        .await;
    assert_eq!(nodes(&m.admin).await[0].gpus[0].mode, GpuMode::Exclusive);

    let mut bad = register(Vec::new());
    bad.start_modes
        .insert(a100(1).uuid, GpuMode::Shared { max_sessions: 1 });
    let refused = m
        .node1
        .fails(
            StatusCode::BAD_REQUEST,
            m.node1.post("/v1/agent/register", &bad),
        )
        .await;
    assert!(
        refused.error.message.starts_with(&format!(
            "GPU {} cannot start in mode shared:1: GPU mode \"shared:1\" must be",
            a100(1).uuid
        )),
        "{}",
        refused.error.message
    );
    assert!(
        refused
            .error
            .message
            .ends_with("fix its `mode` in the agent's simulated GPU file"),
        "{}",
        refused.error.message
    );
    let refused = m
        .node1
        .fails(
            StatusCode::BAD_REQUEST,
            m.node1
                .post("/v1/agent/register", &register(vec![(a100(2), "shared:2")])),
        )
        .await;
    assert!(
        refused
            .error
            .message
            .contains("the agent does not report that GPU"),
        "{}",
        refused.error.message
    );
    m.stop().await;
}
