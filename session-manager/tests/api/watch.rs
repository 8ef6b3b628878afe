//! The long-polls: an agent's `GET /v1/agent/desired?after=<version>` answers as soon as its
//! node's desired state changes (a placement, a hold), and a person's
//! `GET /v1/sessions/{name}?wait_for=...` as soon as the session reaches one of the states. No
//! agent runs here and the sync interval is an hour, so only the manager's push can answer them
//! within the few seconds each is given.

use ongrid_core::holds::HoldRequest;

use super::*;

/// Far shorter than the sync interval and the long-polls' own timeouts.
const PUSHED_WITHIN: Duration = Duration::from_secs(10);

pub(super) fn etag(response: &reqwest::Response) -> String {
    let tag = response
        .headers()
        .get(reqwest::header::ETAG)
        .expect("an ETag")
        .to_str()
        .unwrap();
    tag.trim_matches('"').to_owned()
}

/// The node's long-poll after `version`, waiting at most `timeout` seconds.
pub(super) fn long_poll(
    api: &Api,
    version: &str,
    timeout: u64,
) -> JoinHandle<(StatusCode, String, Option<DesiredState>)> {
    let request = api
        .get(&format!(
            "/v1/agent/desired?after={version}&timeout={timeout}"
        ))
        .timeout(Duration::from_secs(timeout + 30));
    tokio::spawn(async move {
        let response = request.send().await.unwrap();
        let status = response.status();
        let version = etag(&response);
        let body = response.text().await.unwrap();
        let desired = (status == StatusCode::OK).then(|| serde_json::from_str(&body).unwrap());
        (status, version, desired)
    })
}

/// Follows the node's long-polls from `first` until an answer's desired state is `wanted`; its
/// version and desired state. Each answer must be a change (200), never a timeout.
async fn poll_until(
    api: &Api,
    first: JoinHandle<(StatusCode, String, Option<DesiredState>)>,
    wanted: impl Fn(&DesiredState) -> bool,
) -> (String, DesiredState) {
    let mut answer = first.await.unwrap();
    loop {
        let (status, version, desired) = answer;
        assert_eq!(status, StatusCode::OK, "a long-poll timed out unanswered");
        let desired = desired.expect("a 200 carries the desired state");
        if wanted(&desired) {
            return (version, desired);
        }
        answer = long_poll(api, &version, 120).await.unwrap();
    }
}

pub(super) async fn register_versioned(api: &Api, node: &str, gpus: Vec<GpuInfo>) -> String {
    let body = RegisterNode {
        node: NodeName::parse(node).unwrap(),
        agent_version: "test".to_owned(),
        gpu_backend: "simulated".to_owned(),
        gpus,
        stream_url: None,
        start_modes: Default::default(),
    };
    let response = api.post("/v1/agent/register", &body).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    etag(&response)
}

#[tokio::test]
async fn a_change_of_desired_state_answers_the_nodes_long_poll_at_once() {
    let site = Site::new();
    let mut config = site.config.clone();
    config.sync_interval = Duration::from_secs(3600);
    let m = site.start_with(config, None).await;
    let v0 = register_versioned(&m.node1, "node1", vec![a100(1)]).await;
    let node2_v0 = register_versioned(&m.node2, "node2", vec![a100(2)]).await;

    // Nothing changes: the poll waits its whole timeout and answers 204 with the same version.
    let started = tokio::time::Instant::now();
    let (status, version, _) = long_poll(&m.node1, &v0, 1).await.unwrap();
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert_eq!(version, v0);
    assert!(started.elapsed() >= Duration::from_secs(1), "it waited");
    // A version the agent does not have is answered at once.
    let (status, version, desired) =
        tokio::time::timeout(PUSHED_WITHIN, long_poll(&m.node1, "0123456789abcdef", 120))
            .await
            .expect("answered at once")
            .unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(version, v0);
    assert!(desired.unwrap().sessions.is_empty());

    // Both nodes wait; a session is placed on node1.
    let node1_poll = long_poll(&m.node1, &v0, 120);
    let node2_poll = long_poll(&m.node2, &node2_v0, 3);
    let created = m.alice.create(Some("train1"), one_gpu()).await;
    assert_eq!(created.state, SessionState::Starting);
    let (status, v1, desired) = tokio::time::timeout(PUSHED_WITHIN, node1_poll)
        .await
        .expect("node1's long-poll answered when the session was placed")
        .unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_ne!(v1, v0);
    let desired = desired.unwrap();
    assert_eq!(desired.sessions.len(), 1);
    assert_eq!(desired.sessions[0].session_id, created.id);
    assert_eq!(desired.sessions[0].run, RunState::Running);
    // node2's desired state did not change: it is not answered before its timeout.
    let (status, version, _) = node2_poll.await.unwrap();
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert_eq!(version, node2_v0);

    // The sync answers with the same version, so an agent that has it keeps waiting.
    let response = m
        .node1
        .post(
            "/v1/agent/sync",
            &NodeReport {
                node: NodeName::parse("node1").unwrap(),
                gpus: vec![a100(1)],
                containers: Vec::new(),
                activity: Vec::new(),
                freezes: Vec::new(),
                jobs: Vec::new(),
            },
        )
        .send()
        .await
        .unwrap();
    assert_eq!(etag(&response), v1);

    // Its owner waits for it to run: answered when the agent reports the container running.
    let waiting = {
        let request = m
            .alice
            .get("/v1/sessions/train1?wait_for=waiting,failed&timeout=60");
        tokio::spawn(async move { request.send().await.unwrap().json::<SessionView>().await })
    };
    let node1_poll = long_poll(&m.node1, &v1, 120);
    m.node1
        .sync(
            "node1",
            vec![a100(1)],
            vec![container(&created, ContainerState::Running, None)],
        )
        .await;
    let view = tokio::time::timeout(PUSHED_WITHIN, waiting)
        .await
        .expect("the wait answered when the agent reported the container")
        .unwrap()
        .unwrap();
    assert_eq!(view.state, SessionState::Waiting);

    // A wait for a connection is answered by the gateway's event (no node's desired state
    // changes: node1's long-poll keeps waiting).
    let connected = {
        let request = m
            .alice
            .get("/v1/sessions/train1?wait_for=connected&timeout=60");
        tokio::spawn(async move { request.send().await.unwrap().json::<SessionView>().await })
    };
    m.gateway
        .connection(&ConnectionEvent {
            connection_id: uuid::Uuid::from_u128(1),
            event: ConnectionEventKind::Open,
            at: Utc::now(),
            owner: Dn::parse(ALICE).unwrap(),
            fingerprint: "SHA256:FMdHV0bU+9XlaPjjJLAHWoiOLovS2CpdtRPnTxXxb9U".to_owned(),
            source: "::ffff:192.0.2.7".parse().unwrap(),
            institute: InstituteName::parse("uni-lab").unwrap(),
            session_id: created.id,
            bytes_in: 0,
            bytes_out: 0,
            close_reason: None,
        })
        .await;
    let view = tokio::time::timeout(PUSHED_WITHIN, connected)
        .await
        .expect("the wait answered when the gateway reported the connection")
        .unwrap()
        .unwrap();
    assert_eq!(view.state, SessionState::Connected);

    // A hold stops the container: the node's long-poll answers with it stopped.
    let held: SessionView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice
                .post("/v1/sessions/train1/hold", &HoldRequest { reason: None }),
        )
        .await;
    assert_eq!(held.state, SessionState::Held);
    // The poll may first answer an earlier change (the report of the running container):
    // polling on from each answer's version reaches the hold well within the hour of no sync.
    let (v2, _) = tokio::time::timeout(
        PUSHED_WITHIN,
        poll_until(&m.node1, node1_poll, |desired| {
            desired.sessions[0].run == RunState::Stopped
        }),
    )
    .await
    .expect("node1's long-poll answered when the session was held");
    assert_ne!(v2, v1);

    // A wait that is not met answers with the session as it is when its timeout passes.
    let view: SessionView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice
                .get("/v1/sessions/train1?wait_for=waiting&timeout=1"),
        )
        .await;
    assert_eq!(view.state, SessionState::Held);
    let refused = m
        .alice
        .fails(
            StatusCode::BAD_REQUEST,
            m.alice.get("/v1/sessions/train1?wait_for=runnning"),
        )
        .await;
    assert!(
        refused.error.message.contains("waiting,connected,idle"),
        "{}",
        refused.error.message
    );
    m.stop().await;
}

#[tokio::test]
async fn an_unregistered_node_cannot_watch() {
    let site = Site::new();
    let m = site.start().await;
    let refused = m
        .node2
        .fails(StatusCode::NOT_FOUND, m.node2.get("/v1/agent/desired"))
        .await;
    assert!(
        refused.error.message.contains("POST /v1/agent/register"),
        "{}",
        refused.error.message
    );
    m.stop().await;
}
