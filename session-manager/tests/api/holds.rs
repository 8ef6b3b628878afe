//! The lifecycle routes over the real API with a clock the test moves: deadlines in the session's
//! view, keep-alive caps, hold by the owner and by an admin with a reason, release pinned to the
//! node with the same container, and the timer's no-connection hold.

use ongrid_core::holds::{HoldReason, HoldRequest, KeepRequest, SignalKind};

use super::*;

fn hold(reason: Option<&str>) -> HoldRequest {
    HoldRequest {
        reason: reason.map(str::to_owned),
    }
}

#[tokio::test]
async fn sessions_are_held_kept_and_released_by_hand_and_by_the_timer() {
    let site = Site::new();
    let clock = Arc::new(ManualClock::new(Utc::now()));
    let m = site
        .start_with(site.config.clone(), Some(clock.clone()))
        .await;
    m.node1.register("node1", vec![a100(1)]).await;

    // A session's own timeouts are checked against the site's maxima.
    let too_long = CreateSession {
        name: None,
        gpus: one_gpu(),
        image: None,
        idle_timeout_secs: Some(9 * 3600),
        max_duration_secs: None,
        reservation: None,
    };
    let refused = m
        .alice
        .fails(
            StatusCode::BAD_REQUEST,
            m.alice.post("/v1/sessions", &too_long),
        )
        .await;
    assert!(
        refused
            .error
            .message
            .contains("more than this site allows (8 hours)"),
        "{}",
        refused.error.message
    );
    let body = CreateSession {
        name: Some(SessionName::parse("train1").unwrap()),
        idle_timeout_secs: Some(3600),
        max_duration_secs: Some(86_400),
        ..too_long
    };
    let created: SessionView = m
        .alice
        .ok(StatusCode::CREATED, m.alice.post("/v1/sessions", &body))
        .await;
    assert_eq!(created.state, SessionState::Starting);
    let running = container(&created, ContainerState::Running, None);
    m.node1
        .sync("node1", vec![a100(1)], vec![running.clone()])
        .await;
    let ready = clock.now();
    let view = m.alice.wait_for("train1", SessionState::Waiting).await;
    let lifecycle = view.lifecycle.expect("a live session shows its lifecycle");
    let deadlines = &lifecycle.deadlines;
    assert_eq!(deadlines.idle_timeout_secs, 3600);
    assert_eq!(deadlines.max_end_at, Some(ready + TimeDelta::days(1)));
    let next = deadlines.next_hold.clone().expect("a planned hold");
    assert_eq!(next.reason, HoldReason::NoConnection);
    assert_eq!(next.at, ready + TimeDelta::minutes(20));

    // Keep-alive: capped by keep_max (12 hours), and it defers the connect deadline.
    let kept: SessionView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice.post(
                "/v1/sessions/train1/keep",
                &KeepRequest {
                    duration_secs: 100 * 3600,
                },
            ),
        )
        .await;
    let lifecycle = kept.lifecycle.unwrap();
    let until = lifecycle.deadlines.keep_until.expect("kept");
    assert_eq!(until, clock.now() + TimeDelta::hours(12));
    assert_eq!(lifecycle.kept_alive_by, Some(SignalKind::Keep));
    assert_eq!(lifecycle.deadlines.next_hold.unwrap().at, until);

    // Holding by hand: reasons are for admins holding others' sessions; Bob cannot.
    let path = format!("/v1/sessions/train1/hold?owner={}", urlencode(ALICE));
    m.bob
        .fails(StatusCode::NOT_FOUND, m.bob.post(&path, &hold(None)))
        .await;
    m.alice
        .fails(
            StatusCode::BAD_REQUEST,
            m.alice.post("/v1/sessions/train1/hold", &hold(Some("x"))),
        )
        .await;
    m.admin
        .fails(StatusCode::BAD_REQUEST, m.admin.post(&path, &hold(None)))
        .await;
    let held: SessionView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin.post(&path, &hold(Some("GPU maintenance"))),
        )
        .await;
    assert_eq!(held.state, SessionState::Held);
    assert!(
        held.reason.starts_with("admin: GPU maintenance (held by "),
        "{}",
        held.reason
    );
    assert!(
        held.lifecycle.is_some(),
        "a HELD session shows its lifecycle"
    );
    let desired = m
        .node1
        .sync("node1", vec![a100(1)], vec![running.clone()])
        .await;
    assert_eq!(desired.sessions.len(), 1);
    assert_eq!(desired.sessions[0].run, RunState::Stopped);
    m.alice
        .fails(
            StatusCode::CONFLICT,
            m.alice.post("/v1/sessions/train1/hold", &hold(None)),
        )
        .await;
    m.alice
        .fails(
            StatusCode::CONFLICT,
            m.alice.post(
                "/v1/sessions/train1/keep",
                &KeepRequest { duration_secs: 60 },
            ),
        )
        .await;

    // Bob takes the freed GPU; Alice's release waits for it, pinned to node1, container kept.
    let bobs = m.bob.create(Some("other"), one_gpu()).await;
    assert_eq!(bobs.state, SessionState::Starting);
    let released: SessionView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice
                .post("/v1/sessions/train1/release", &serde_json::json!({})),
        )
        .await;
    assert_eq!(released.state, SessionState::Pending);
    assert_eq!(released.queue_position, Some(1));
    assert_eq!(released.node.as_ref().map(|n| n.as_str()), Some("node1"));
    assert!(
        released.reason.contains("waits for a GPU on node1"),
        "{}",
        released.reason
    );
    let exited = ContainerState::Exited {
        exit_code: 137,
        oom_killed: false,
        error: None,
    };
    let stopped = container(&created, exited.clone(), None);
    let desired = m
        .node1
        .sync("node1", vec![a100(1)], vec![stopped.clone()])
        .await;
    let alices = desired
        .sessions
        .iter()
        .find(|s| s.session_id == created.id)
        .expect("a pinned session's container is kept");
    assert_eq!(alices.run, RunState::Stopped);
    assert!(!alices.resume);

    // Bob leaves: Alice's session is placed on node1 again. The agent's report of the stopped
    // container before it starts it again is not a death, and the agent is told to start it
    // again even if it no longer remembers stopping it.
    m.bob
        .ok::<SessionView>(StatusCode::OK, m.bob.delete("/v1/sessions/other"))
        .await;
    m.alice.wait_for("train1", SessionState::Starting).await;
    let desired = m.node1.sync("node1", vec![a100(1)], vec![stopped]).await;
    let alices = desired
        .sessions
        .iter()
        .find(|s| s.session_id == created.id)
        .expect("the released session is on node1");
    assert_eq!((alices.run, alices.resume), (RunState::Running, true));
    assert_eq!(m.alice.show("train1").await.state, SessionState::Starting);
    m.node1.sync("node1", vec![a100(1)], vec![running]).await;
    let back = m.alice.wait_for("train1", SessionState::Waiting).await;
    let restart = clock.now();
    let next = back.lifecycle.unwrap().deadlines.next_hold.unwrap();
    assert_eq!(
        next.at,
        restart + TimeDelta::minutes(20),
        "a new countdown, no old keep"
    );

    // Nobody connects: the timer holds it once the (moved) clock passes the deadline.
    clock.advance(TimeDelta::minutes(21));
    let held = m.alice.wait_for("train1", SessionState::Held).await;
    assert!(
        held.reason.starts_with("no-connection: "),
        "{}",
        held.reason
    );
    m.stop().await;
}
